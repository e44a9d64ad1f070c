"""The validate stage: a failing suite fails the stage with a readable report and leaves its outputs as they were."""
import math
from pathlib import Path

import pytest

from datapool.parquet import export_steps, read_steps
from datapool.records import StepRecord, TrajectoryRecord
from datapool.store import DataPool
from tasks import validate
from tasks.config import parse_params
from tasks.layout import Layout

PARAMS = parse_params({"rollout": {"group_size": 2}})


def trajectories(returns: list[list[float]]) -> list[TrajectoryRecord]:
    """One group per entry of `returns`, one trajectory per return, two steps each."""
    out = []
    for g, group in enumerate(returns):
        for i, ret in enumerate(group):
            tid = f"g{g}|{i}"
            steps = [StepRecord(trajectory_id=tid, group_id=f"g{g}", step_index=k, prompt_ids=[1, 2, 3],
                                response_ids=[4, 0], logprobs=[-0.5, -0.1], prompt_text="p", observation="o",
                                action="left", response_text=" left", reward=ret if k == 1 else 0.0,
                                anchor=f"m:{k}", policy_version="warmstart") for k in range(2)]
            out.append(TrajectoryRecord(trajectory_id=tid, group_id=f"g{g}", scenario="{}", env="frozenlake",
                                        split="train", round=1, policy_version="warmstart", status="complete",
                                        episode_return=ret, won=ret > 0, num_steps=2, response_tokens=4,
                                        steps=steps))
    return out


def write_round(layout: Layout, returns: list[list[float]]) -> None:
    with DataPool(f"sqlite:///{layout.root / 'pool.db'}") as pool:
        pool.add_trajectories(trajectories(returns))
        frame = pool.steps_frame(round=1)
    export_steps(frame, layout.steps(1), metadata={"round": 1})


def test_validate_passes_and_drops_zero_variance_groups(tmp_path: Path):
    layout = Layout(tmp_path)
    write_round(layout, [[1.0, 0.0], [0.0, 0.0]])
    metrics = validate.run(PARAMS, layout, 1)
    assert metrics["groups_total"] == 2 and metrics["groups_dropped"] == 1 and metrics["steps_dropped"] == 4
    kept, _ = read_steps(layout.validated(1))
    assert set(kept["group_id"]) == {"g0"}


def test_validate_failure_reports_expectation_count_and_example(tmp_path: Path):
    layout = Layout(tmp_path)
    write_round(layout, [[1.0, 0.0], [0.0, 1.0]])
    frame, meta = read_steps(layout.steps(1))
    frame.loc[frame.index[1], "reward"] = math.inf
    export_steps(frame, layout.steps(1), metadata=meta)
    with pytest.raises(validate.DataValidationError) as err:
        validate.run(PARAMS, layout, 1)
    message = str(err.value)
    assert "expect_column_values_to_be_between" in message and "reward" in message
    assert "1" in message and "g0|0" in message  # count and an example row
    assert not layout.validated(1).exists()
    assert not layout.round_metrics(1, "validate_report").exists()  # outputs only on success
    assert "failed.json" in message and layout.round_metrics(1, "validate_report.failed").exists()


def test_validate_rejects_incomplete_groups(tmp_path: Path):
    layout = Layout(tmp_path)
    write_round(layout, [[1.0, 0.0], [0.0]])
    with pytest.raises(validate.DataValidationError, match="group"):
        validate.run(PARAMS, layout, 1)
