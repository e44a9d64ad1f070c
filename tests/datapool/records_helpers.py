"""Records for the data pool tests: one trajectory that sets every field away from its default."""
from __future__ import annotations

from datapool.records import STEP_FIELDS, StepRecord, TrajectoryRecord


def full_trajectory(tid: str = "full") -> TrajectoryRecord:
    """One trajectory whose every step field differs from its default (text without NUL: PostgreSQL)."""
    steps = [StepRecord(
        trajectory_id=tid, group_id="g", step_index=k, prompt_ids=[1, 2, 3 + k], response_ids=[7, -8],
        logprobs=[-0.5, -1.25], prompt_text="Skill 1: walk\nTask: go", observation="o", action="skill 1",
        response_text=" skill 1", reward=0.5, anchor="(1, 2)", policy_version="v3", action_valid=False,
        truncated=True, skill_ids=["walk", "look"], context_manager="fold", tool_calls=2, tool_successes=1,
        process_reward=-0.1, retokenized=True, plain_prompt_ids=[3 + k, 4], macro_prompt_ids=[[3], [], [5, 6]],
        macro_action_ids=[[9, 0], [10, 0], [11]], action_choices=[[7, -8, 0], [5, 0]], prefix_break=True,
        staleness=2)
        for k in range(2)]
    unchanged = {f.name for f in STEP_FIELDS if f.has_default and getattr(steps[0], f.name) == f.default}
    assert not unchanged, f"full_trajectory leaves {unchanged} at their defaults: set them"
    return TrajectoryRecord(trajectory_id=tid, group_id="g", scenario='{"seed": 1}', env="household",
                            split="heldout", round=3, policy_version="v3", status="truncated", episode_return=1.0,
                            won=True, num_steps=2, response_tokens=4, wall_time_s=2.5, error="timeout",
                            metadata={"k": [1]}, steps=steps)
