"""Curation and failures reach training: exclusions and labels made in the pool after a rollout apply to what the
validate stage exports (through the curate stage's snapshot, a DVC dep of validate), and trajectories whose env
failed are left out by default, counted, and kept with validate.keep_failed."""
from pathlib import Path

import pandas as pd

from datapool.parquet import export_steps, read_steps
from datapool.records import StepRecord, TrajectoryRecord
from datapool.store import DataPool
from tasks import curate, validate
from tasks.config import parse_params
from tasks.layout import Layout

PARAMS = parse_params({"rollout": {"group_size": 2}, "pipeline": {"rounds": 1},
                       "validate": {"drop_zero_variance": False}})


def trajectory(tid: str, group: str, ret: float, status: str = "complete") -> TrajectoryRecord:
    steps = [StepRecord(trajectory_id=tid, group_id=group, step_index=k, prompt_ids=[1, 2, 3], response_ids=[4, 0],
                        logprobs=[-0.5, -0.1], prompt_text="p", observation="o", action="left",
                        response_text=" left", reward=ret if k == 1 else 0.0, anchor=f"m:{k}",
                        policy_version="warmstart") for k in range(2)]
    return TrajectoryRecord(trajectory_id=tid, group_id=group, scenario="{}", env="frozenlake", split="train",
                            round=1, policy_version="warmstart", status=status, episode_return=ret, won=ret > 0,
                            num_steps=2, response_tokens=4, error="env timed out" if status == "failed" else None,
                            steps=steps)


def rollout_round(layout: Layout, trajectories: list[TrajectoryRecord]) -> None:
    with DataPool(layout.pool_url) as pool:
        pool.add_trajectories(trajectories)
        frame = pool.steps_frame(round=1)
    export_steps(frame, layout.steps(1), metadata={"round": 1})


def kept(layout: Layout) -> pd.DataFrame:
    return read_steps(layout.validated(1))[0]


def test_exclusions_and_labels_made_after_the_rollout_reach_the_validated_data(tmp_path: Path):
    layout = Layout(tmp_path)
    rollout_round(layout, [trajectory("a", "g0", 1.0), trajectory("b", "g0", 0.0), trajectory("c", "g1", 1.0),
                           trajectory("d", "g1", 0.0)])
    curate.run(PARAMS, layout)
    first = layout.curation(1).read_bytes()
    validate.run(PARAMS, layout, 1)
    assert kept(layout)["trajectory_id"].nunique() == 4

    with DataPool(layout.pool_url) as pool:  # as the gateway UI or `arlflow pool curate` would
        pool.curate("b", excluded=True, note="reward hacking")
        pool.curate("c", step_index=1, excluded=True)
        pool.curate("a", label="clean")
        pool.curate("d", step_index=0, label="odd")
    metrics = curate.run(PARAMS, layout)
    assert metrics["round_1"] == {"excluded_trajectories": 1, "excluded_steps": 1, "labelled": 2}
    assert layout.curation(1).read_bytes() != first  # the dep of validate_1 changed: DVC reruns it
    assert curate.run(PARAMS, layout) == metrics and layout.curation(1).read_bytes() == curate.write_curation(
        curate.read_curation(layout.curation(1)), tmp_path / "again.parquet").read_bytes()  # deterministic

    metrics = validate.run(PARAMS, layout, 1)
    frame = kept(layout)
    assert "b" not in set(frame["trajectory_id"])
    assert frame.loc[frame["trajectory_id"] == "c", "step_index"].tolist() == [0]
    labels = dict(zip(zip(frame["trajectory_id"], frame["step_index"]), frame["label"]))
    assert labels[("a", 0)] == labels[("a", 1)] == "clean" and labels[("d", 0)] == "odd" and labels[("d", 1)] == ""
    assert metrics["curated_excluded_trajectories"] == 1 and metrics["curated_excluded_steps"] == 3
    assert not frame["excluded"].any()

    with DataPool(layout.pool_url) as pool:  # lifting an exclusion brings the data back
        pool.curate("b", excluded=False)
    curate.run(PARAMS, layout)
    validate.run(PARAMS, layout, 1)
    assert "b" in set(kept(layout)["trajectory_id"])


def test_failed_trajectories_are_left_out_by_default_and_counted(tmp_path: Path):
    layout = Layout(tmp_path)
    rollout_round(layout, [trajectory("a", "g0", 1.0), trajectory("b", "g0", 0.0, status="failed"),
                           trajectory("c", "g1", 1.0), trajectory("d", "g1", 0.0)])
    metrics = validate.run(PARAMS, layout, 1)
    assert "b" not in set(kept(layout)["trajectory_id"])
    assert metrics["failed_trajectories"] == 1 and metrics["failed_steps"] == 2 and not metrics["failed_kept"]
    keep = parse_params({"rollout": {"group_size": 2}, "validate": {"keep_failed": True, "drop_zero_variance": False}})
    metrics = validate.run(keep, layout, 1)
    assert "b" in set(kept(layout)["trajectory_id"]) and metrics["failed_kept"]


def test_curate_writes_empty_snapshots_without_creating_a_pool(tmp_path: Path):
    layout = Layout(tmp_path)
    metrics = curate.run(PARAMS, layout)
    assert metrics == {"round_1": {"excluded_trajectories": 0, "excluded_steps": 0, "labelled": 0}}
    assert not (tmp_path / "data" / "pool.db").exists() and curate.read_curation(layout.curation(1)).empty
