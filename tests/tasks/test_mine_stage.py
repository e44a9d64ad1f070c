"""mine stage: the method switch (frequent sub-sequences or MDL macros) writes a bank with a changelog line."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from datapool.records import StepRecord, TrajectoryRecord
from datapool.store import DataPool
from skills.bank import load_bank
from skills.lifecycle import RoundBank, load_round_bank, save_round_bank
from tasks import mine
from tasks.config import ParamsError, parse_params
from tasks.layout import Layout


def won_trajectory(tid: str, actions: list[str]) -> TrajectoryRecord:
    steps = [StepRecord(trajectory_id=tid, group_id="g", step_index=i, prompt_ids=[1], response_ids=[2],
                        logprobs=[-0.1], prompt_text="p", observation="o", action=a, response_text=" " + a,
                        reward=1.0 if i == len(actions) - 1 else 0.0, anchor=f"s{i}", policy_version="v")
             for i, a in enumerate(actions)]
    return TrajectoryRecord(trajectory_id=tid, group_id="g", scenario="{}", env="household", split="train", round=1,
                            policy_version="v", status="complete", episode_return=1.0, won=True,
                            num_steps=len(steps), response_tokens=len(steps), steps=steps)


def planted_round(layout: Layout) -> None:
    """20 won episodes, each with `go to X; open X; take Y from X` around random noise actions."""
    rng = random.Random(0)
    trajectories = []
    for t in range(20):
        recep, obj = f"{rng.choice(['fridge', 'cabinet', 'drawer'])} {rng.randint(1, 3)}", f"apple {rng.randint(1, 3)}"
        noise = [rng.choice(["look", "inventory", f"go to shelf {rng.randint(1, 3)}"]) for _ in range(rng.randint(0, 3))]
        actions = noise + [f"go to {recep}", f"open {recep}", f"take {obj} from {recep}"] + ["look"]
        trajectories.append(won_trajectory(f"t{t}", actions))
    with DataPool(layout.pool_url) as pool:
        pool.add_trajectories(trajectories)
        pool.export_round(1, layout.steps(1))
    save_round_bank(layout.skills(0), RoundBank(), [], header="round 0: none")  # the warm start always writes one


def test_mdl_method_mines_the_planted_macro_with_slots(tmp_path: Path):
    layout = Layout(tmp_path)
    planted_round(layout)
    metrics = mine.run(parse_params({"mine": {"method": "mdl", "max_length": 4}}), layout, 1)
    assert load_bank(layout.skills(1)) == []  # with skills.validate (default) mined skills wait as candidates
    bank = load_round_bank(layout.skills(1)).candidates
    assert metrics["candidates"] == len(bank) == metrics["added"] >= 1
    planted = ["go to {a}", "open {a}", "take {b} from {a}"]
    best = max(bank, key=lambda skill: skill.stats["mdl_gain"])  # the bank lists skills by name
    assert list(best.macro)[:3] == planted and best.stats["count"] == 20
    assert "mined (mdl)" in (layout.skills(1) / "CHANGELOG.md").read_text()


def test_frequent_method_is_the_default_and_a_bad_method_is_refused(tmp_path: Path):
    layout = Layout(tmp_path)
    planted_round(layout)
    metrics = mine.run(parse_params({"skills": {"validate": False}}), layout, 1)
    assert "mined (frequent)" in (layout.skills(1) / "CHANGELOG.md").read_text()
    live = load_bank(layout.skills(1))  # without validation they go live directly
    assert metrics["live"] == len(live) == metrics["added"] >= 1
    assert load_round_bank(layout.skills(1)).candidates == []
    with pytest.raises(ParamsError, match="mine.method"):
        parse_params({"mine": {"method": "llm"}})
