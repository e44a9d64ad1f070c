"""Step and trajectory records: what the rollout loop produces and the data pool stores.

Token ids are the ids the engine sampled; they are never re-tokenized from text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TRAJECTORY_STATUSES = ("complete", "truncated", "failed")


@dataclass
class StepRecord:
    trajectory_id: str
    group_id: str            # one group = the G rollouts of one scenario under one policy version
    step_index: int
    prompt_ids: list[int]     # exactly the ids fed to the engine
    response_ids: list[int]   # exactly the ids the engine sampled (eos included when produced)
    logprobs: list[float]     # rollout log-prob of each response id, len == len(response_ids)
    prompt_text: str
    observation: str          # env observation this step acted on
    action: str               # parsed action ("" when invalid)
    response_text: str        # decoded response
    reward: float
    anchor: str               # canonical env state (str of the env's hashable anchor)
    policy_version: str
    action_valid: bool = True
    truncated: bool = False   # the response hit max_new_tokens without eos
    skill_ids: list[str] = field(default_factory=list)
    context_manager: str = "full"
    tool_calls: int = 0       # tool calls the agent made in this step's action
    tool_successes: int = 0   # of those, how many the tool reported as successful (<= tool_calls)
    process_reward: float = 0.0  # fold context: +-alpha on a step that closed a subgoal (ALGORITHMS.md section 10)


@dataclass
class TrajectoryRecord:
    trajectory_id: str
    group_id: str
    scenario: str             # Scenario.to_json()
    env: str
    split: str
    round: int
    policy_version: str
    status: str               # one of TRAJECTORY_STATUSES
    episode_return: float
    won: bool
    num_steps: int
    response_tokens: int      # total sampled tokens over the episode
    wall_time_s: float = 0.0
    error: str | None = None  # why an episode failed (env raised, timed out)
    metadata: dict[str, Any] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
