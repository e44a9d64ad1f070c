"""Curation and queries, on SQLite and PostgreSQL: labels and exclusions are kept (never deleted), steps_frame and
exports see them, query_trajectories filters by every field and flag, stats counts it all."""
from __future__ import annotations

import json
import time

import pytest

from datapool.records import StepRecord, TrajectoryRecord
from datapool.store import DataPool


def traj(tid: str, *, group: str = "g0", env: str = "frozenlake", round: int = 1, policy: str = "v1",
         status: str = "complete", ret: float = 1.0, flags: dict | None = None, steps: int = 2) -> TrajectoryRecord:
    """A trajectory whose step 1 carries ``flags`` (truncated / action_valid / retokenized / tool counts)."""
    records = []
    for k in range(steps):
        fields = dict(flags or {}) if k == 1 else {}
        records.append(StepRecord(
            trajectory_id=tid, group_id=group, step_index=k, prompt_ids=[1, 2], response_ids=[3], logprobs=[-0.1],
            prompt_text="p", observation=f"o{k}", action="a", response_text="r", reward=0.0, anchor=f"s{k}",
            policy_version=policy, **fields))
    return TrajectoryRecord(trajectory_id=tid, group_id=group, scenario="{}", env=env, split="train", round=round,
                            policy_version=policy, status=status, episode_return=ret, won=ret > 0, num_steps=steps,
                            response_tokens=steps, steps=records)


def test_curate_upserts_and_keeps_everything(pool: DataPool) -> None:
    pool.add_trajectories([traj("t1")])
    assert pool.curation_of("t1") == {"trajectory": None, "steps": {}}
    pool.curate("t1", step_index=1, excluded=True, label="loop", note="repeats itself")
    pool.curate("t1", step_index=1, label="loop2")  # excluded kept, label replaced, note kept
    pool.curate("t1", label="interesting")
    cur = pool.curation_of("t1")
    assert cur["trajectory"]["label"] == "interesting" and cur["trajectory"]["excluded"] is False
    step = cur["steps"][1]
    assert (step["excluded"], step["label"], step["note"]) == (True, "loop2", "repeats itself")
    assert step["updated_at"] <= time.time()
    pool.curate("t1", step_index=1, excluded=False, label="")  # un-exclude, clear the label: the row stays
    assert pool.curation_of("t1")["steps"][1] | {"updated_at": 0} == {
        "excluded": False, "label": None, "note": "repeats itself", "updated_at": 0}
    with pytest.raises(KeyError, match="unknown trajectory 'ghost'"):
        pool.curate("ghost", excluded=True)
    with pytest.raises(KeyError, match="unknown step 7 of trajectory 't1'"):
        pool.curate("t1", step_index=7, excluded=True)
    with pytest.raises(ValueError, match="'excluded'"):
        pool.curate("t1", excluded="yes")
    with pytest.raises(KeyError, match="unknown trajectory 'ghost'"):
        pool.curation_of("ghost")
    assert pool.counts() == {"trajectories": 1, "steps": 2}  # curation never touches the records


def test_exclusions_reach_steps_frame_and_exports(pool: DataPool, tmp_path) -> None:
    pool.add_trajectories([traj("a"), traj("b"), traj("c")])
    pool.curate("a", excluded=True)
    pool.curate("b", step_index=0, excluded=True)
    frame = pool.steps_frame()
    assert dict(zip(zip(frame["trajectory_id"], frame["step_index"]), frame["excluded"])) == {
        ("a", 0): True, ("a", 1): True, ("b", 0): True, ("b", 1): False, ("c", 0): False, ("c", 1): False}
    kept = pool.steps_frame(include_excluded=False)
    assert list(zip(kept["trajectory_id"], kept["step_index"])) == [("b", 1), ("c", 0), ("c", 1)]
    assert pool.export(tmp_path / "kept.parquet", include_excluded=False) == 3


def test_query_filters_and_flags(pool: DataPool) -> None:
    pool.add_trajectories([traj("old", round=0, ret=-1.0)])
    time.sleep(0.01)
    pool.add_trajectories([
        traj("trunc", flags={"truncated": True}, ret=0.5),
        traj("invalid", env="maze", flags={"action_valid": False}, ret=2.0, policy="v2"),
        traj("retok", flags={"retokenized": True}, status="failed"),
        traj("tools", flags={"tool_calls": 2, "tool_successes": 1}, round=2),
    ])
    time.sleep(0.01)
    pool.open_trajectory("live", group_id="g9", policy_version="v2")

    def ids(**filters) -> list[str]:
        return [row["trajectory_id"] for row in pool.query_trajectories(**filters)]

    everything = ids()
    assert everything[0] == "live" and everything[-1] == "old" and len(everything) == 6  # newest first
    assert ids(env="maze") == ["invalid"]
    assert sorted(ids(round=1)) == ["invalid", "retok", "trunc"]
    assert sorted(ids(policy_version="v2")) == ["invalid", "live"]
    assert ids(status="failed") == ["retok"] and ids(status="open") == ["live"]
    assert sorted(ids(min_return=0.5, max_return=1.0)) == ["retok", "tools", "trunc"]
    assert ids(max_return=0.0) == ["live", "old"]
    assert ids(flag="truncated") == ["trunc"] and ids(flag="invalid_action") == ["invalid"]
    assert ids(flag="retokenized") == ["retok"] and ids(flag="tool_failure") == ["tools"]
    assert ids(limit=2) == everything[:2] and ids(limit=2, offset=2) == everything[2:4]

    pool.curate("trunc", label="review")
    pool.curate("tools", step_index=0, label="review", excluded=True)
    pool.curate("invalid", excluded=True)
    assert sorted(ids(label="review")) == ["tools", "trunc"]
    assert ids(excluded=True) == ["invalid"] and "invalid" not in ids(excluded=False)
    row = next(r for r in pool.query_trajectories() if r["trajectory_id"] == "tools")
    assert row["labels"] == ["review"] and row["excluded"] is False and row["excluded_steps"] == 1
    assert row["flags"] == ["tool_failure"] and row["metadata"] == {} and row["round"] == 2
    assert isinstance(row["created_at"], float) and row["won"] is True
    json.dumps(pool.query_trajectories())  # JSON-ready for the UI

    for bad, field in [({"flag": "weird"}, "'flag'"), ({"status": "done"}, "'status'"), ({"limit": 0}, "'limit'"),
                       ({"offset": -1}, "'offset'"), ({"min_return": "high"}, "'min_return'")]:
        with pytest.raises(ValueError, match=field):
            pool.query_trajectories(**bad)


def test_stats_counts_statuses_envs_rounds_and_curation(pool: DataPool) -> None:
    empty = pool.stats()
    assert empty["trajectories"] == 0 and empty["steps"] == 0 and empty["retokenized_steps"] == 0
    pool.add_trajectories([traj("a"), traj("b", env="maze", round=2, flags={"retokenized": True}),
                           traj("c", status="failed")])
    pool.curate("a", excluded=True, label="x")
    pool.curate("b", step_index=1, excluded=True, label="x")
    stats = pool.stats()
    assert stats["trajectories"] == 3 and stats["steps"] == 6
    assert stats["by_status"] == {"complete": 2, "failed": 1}
    assert stats["by_env"] == {"frozenlake": 2, "maze": 1} and stats["by_round"] == {1: 2, 2: 1}
    assert stats["excluded_trajectories"] == 1 and stats["excluded_steps"] == 1 and stats["labels"] == {"x": 2}
    assert stats["retokenized_steps"] == 1 and stats["flagged_steps"]["retokenized"] == 1
    json.dumps(stats)
