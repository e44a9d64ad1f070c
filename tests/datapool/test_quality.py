"""The great-expectations gate over the step table, and the zero-variance group filter."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from datapool.parquet import read_steps
from datapool.quality import QualityLimits, QualityReport, drop_zero_variance_groups, validate_steps
from datapool.records import StepRecord, TrajectoryRecord
from datapool.store import DataPool

LIMITS = QualityLimits(max_prompt_tokens=8, max_response_tokens=3, reward_min=-1.0, reward_max=1.0, group_size=3)


def good_frame(groups: int = 2, group_size: int = 3, steps: int = 2) -> pd.DataFrame:
    rows = []
    for g in range(groups):
        for t in range(group_size):
            for k in range(steps):
                rows.append({
                    "trajectory_id": f"g{g}-t{t}", "group_id": f"g{g}", "step_index": k,
                    "prompt_ids": [1, 2, 3], "response_ids": [4, 5], "logprobs": [-0.1, -0.2],
                    "reward": 1.0 if (k == steps - 1 and t == 0) else 0.0, "episode_return": float(t == 0),
                })
    return pd.DataFrame(rows)


def test_good_frame_passes() -> None:
    report = validate_steps(good_frame(), LIMITS)
    assert report.success, report.render()
    assert report.row_count == 12 and all(r["success"] for r in report.results)
    assert "passed" in report.render()
    json.dumps(report.to_dict())  # serializable


def _corrupt(df: pd.DataFrame, kind: str) -> pd.DataFrame:
    df = df.copy()
    if kind == "empty_response":
        df.at[3, "response_ids"] = []
        df.at[3, "logprobs"] = []
    elif kind == "empty_prompt":
        df.at[3, "prompt_ids"] = []
    elif kind == "prompt_too_long":
        df.at[3, "prompt_ids"] = list(range(9))
    elif kind == "response_too_long":
        df.at[3, "response_ids"] = [1, 2, 3, 4]
        df.at[3, "logprobs"] = [-0.1] * 4
    elif kind == "logprob_mismatch":
        df.at[3, "logprobs"] = [-0.1]
    elif kind == "nonfinite_logprob":
        df.at[3, "logprobs"] = [-0.1, float("nan")]
    elif kind in ("nan_reward", "none_reward"):
        df["reward"] = df["reward"].astype(object) if kind == "none_reward" else df["reward"]
        df.at[3, "reward"] = None if kind == "none_reward" else np.nan
    elif kind == "inf_reward":
        df.at[3, "reward"] = np.inf
    elif kind == "neg_inf_reward":
        df.at[3, "reward"] = -np.inf
    elif kind == "reward_out_of_range":
        df.at[3, "reward"] = 5.0
    elif kind == "incomplete_group":
        df = df[df["trajectory_id"] != "g1-t2"]
    elif kind == "null_group":
        df["group_id"] = df["group_id"].astype(object)
        df.at[3, "group_id"] = None
    elif kind == "null_trajectory":
        df["trajectory_id"] = df["trajectory_id"].astype(object)
        df.at[3, "trajectory_id"] = None
    return df


CASES = [
    ("empty_response", "expect_column_values_to_be_between", "response_len", "response_len=0"),
    ("empty_prompt", "expect_column_values_to_be_between", "prompt_len", "prompt_len=0"),
    ("prompt_too_long", "expect_column_values_to_be_between", "prompt_len", "prompt_len=9"),
    ("response_too_long", "expect_column_values_to_be_between", "response_len", "response_len=4"),
    ("logprob_mismatch", "expect_column_values_to_be_in_set", "logprob_len_mismatch", "logprob_len_mismatch=1"),
    ("nonfinite_logprob", "expect_column_values_to_be_in_set", "logprobs_finite", "logprobs_finite=False"),
    ("nan_reward", "expect_column_values_to_not_be_null", "reward", "reward=nan"),
    ("none_reward", "expect_column_values_to_not_be_null", "reward", "reward=nan"),
    ("inf_reward", "expect_column_values_to_be_between", "reward", "reward=inf"),
    ("neg_inf_reward", "expect_column_values_to_be_between", "reward", "reward=-inf"),
    ("reward_out_of_range", "expect_column_values_to_be_between", "reward", "reward=5.0"),
    ("incomplete_group", "expect_column_values_to_be_in_set", "group_trajectories", "group_id=g1"),
    ("null_group", "expect_column_values_to_not_be_null", "group_id", "trajectory_id=g0-t1"),
    ("null_trajectory", "expect_column_values_to_not_be_null", "trajectory_id", "step_index=1"),
]


@pytest.mark.parametrize("kind, expectation, column, example", CASES, ids=[c[0] for c in CASES])
def test_each_kind_of_bad_data_fails_with_its_expectation_named(kind: str, expectation: str, column: str,
                                                                 example: str) -> None:
    report = validate_steps(_corrupt(good_frame(), kind), LIMITS)
    assert not report.success
    failed = {(r["expectation_type"], r["column"]) for r in report.failures}
    assert (expectation, column) in failed
    text = report.render()
    assert f"{expectation} on column '{column}'" in text and example in text
    result = next(r for r in report.failures if (r["expectation_type"], r["column"]) == (expectation, column))
    assert result["unexpected_count"] >= 1 and 1 <= len(result["examples"]) <= 5
    json.dumps(report.to_dict(), allow_nan=False)


def test_incomplete_group_example_names_each_group_once() -> None:
    df = good_frame(groups=8)
    df = df[~df["trajectory_id"].str.endswith("-t2")]  # every group now has 2 of 3 trajectories
    report = validate_steps(df, LIMITS)
    result = next(r for r in report.failures if r["column"] == "group_trajectories")
    assert result["unexpected_count"] == len(df)
    assert [e["group_id"] for e in result["examples"]] == [f"g{g}" for g in range(5)]


def test_episodes_that_failed_before_their_first_step_count_as_present_not_lost() -> None:
    """An env that fails at reset leaves a trajectory without step rows; the rollout lists them per group
    (STEPLESS metadata) so the group-size check passes only for exactly those (before: the round failed the gate)."""
    from datapool.quality import stepless_groups
    from datapool.records import TrajectoryRecord

    df = good_frame(groups=2)
    df = df[df["trajectory_id"] != "g1-t2"]
    assert not validate_steps(df, LIMITS).success
    failed = TrajectoryRecord(trajectory_id="g1-t2", group_id="g1", scenario="{}", env="frozenlake", split="train",
                              round=1, policy_version="v", status="failed", episode_return=0.0, won=False,
                              num_steps=0, response_tokens=0, steps=[])
    assert stepless_groups([failed]) == {"g1": 1}
    assert validate_steps(df, LIMITS, stepless=stepless_groups([failed])).success
    assert not validate_steps(df, LIMITS, stepless={"g0": 1}).success  # another group's count does not cover it
    assert not validate_steps(df, LIMITS, stepless={"g1": 2}).success  # nor more than went missing


def test_empty_frame_fails_with_a_clear_message() -> None:
    report = validate_steps(good_frame().iloc[:0], LIMITS, round=4)
    assert not report.success and report.row_count == 0
    assert "no steps for round 4" in report.render()


def test_missing_columns_are_a_usage_error() -> None:
    with pytest.raises(ValueError, match="lacks columns"):
        validate_steps(good_frame().drop(columns=["logprobs"]), LIMITS)


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="reward_min"):
        QualityLimits(8, 3, reward_min=1.0, reward_max=0.0, group_size=2)


def test_report_render_lists_counts_and_at_most_five_examples() -> None:
    df = good_frame()
    df["reward"] = 7.0
    report = validate_steps(df, LIMITS)
    assert isinstance(report, QualityReport)
    result = next(r for r in report.failures if r["column"] == "reward")
    assert result["unexpected_count"] == 12 and len(result["examples"]) == 5
    assert "12 unexpected" in report.render()


def test_drop_zero_variance_groups_counts() -> None:
    df = good_frame(groups=3)  # every group has returns (1, 0, 0): signal
    df.loc[df["group_id"] == "g1", "episode_return"] = 0.5  # g1: all equal
    df.loc[df["group_id"] == "g2", "episode_return"] = 0.0  # g2: all equal
    kept, stats = drop_zero_variance_groups(df)
    assert stats == {"groups_total": 3, "groups_dropped": 2, "steps_dropped": 12}
    assert set(kept["group_id"]) == {"g0"} and len(kept) == 6

    single = good_frame(groups=1, group_size=1)
    kept, stats = drop_zero_variance_groups(single)
    assert stats == {"groups_total": 1, "groups_dropped": 1, "steps_dropped": 2} and kept.empty


def test_frames_from_the_pool_and_its_parquet_export_pass(tmp_path: Path) -> None:
    trajs = []
    for g in range(2):
        for t in range(3):
            tid = f"g{g}-t{t}"
            steps = [StepRecord(tid, f"g{g}", k, [1, 2], [3], [-0.5], "p", "o", "up", " up", 0.0, "a", "v1")
                     for k in range(2)]
            trajs.append(TrajectoryRecord(tid, f"g{g}", "{}", "frozenlake", "train", 1, "v1", "complete",
                                          float(t == 0 and g == 0), t == 0, 2, 2, steps=steps))
    with DataPool(str(tmp_path / "pool.db")) as pool:
        pool.add_trajectories(trajs)
        from_pool = pool.steps_frame(round=1)
        pool.export_round(1, tmp_path / "r1.parquet")
    from_file, _ = read_steps(tmp_path / "r1.parquet")
    for df in (from_pool, from_file):
        assert validate_steps(df, LIMITS, round=1).success
        kept, stats = drop_zero_variance_groups(df)
        assert stats == {"groups_total": 2, "groups_dropped": 1, "steps_dropped": 6} and set(kept["group_id"]) == {"g0"}


def test_retokenized_steps_fail_the_gate_by_default() -> None:
    """Steps whose ids were re-derived from text fail "no retokenized steps"; frames without the column pass."""
    df = good_frame()
    df["retokenized"] = False
    assert validate_steps(df, LIMITS).success
    df.loc[3, "retokenized"] = True
    report = validate_steps(df, LIMITS)
    assert not report.success
    [failure] = report.failures
    assert failure["name"] == "no retokenized steps" and failure["unexpected_count"] == 1
    assert failure["examples"][0]["trajectory_id"] == df.loc[3, "trajectory_id"]
    assert "(no retokenized steps): 1 unexpected" in report.render()


def test_prefix_breaks_are_counted_with_examples_but_never_fail_the_gate() -> None:
    """A gateway step that does not extend its predecessor is still exactly what was fed and sampled: counted (the
    concatenated layout re-renders around it), not failed; frames without the column count none."""
    assert validate_steps(good_frame(), LIMITS).counted == {"prefix breaks (counted)": 0}
    df = good_frame()
    df["prefix_break"] = False
    df.loc[[3, 5], "prefix_break"] = True
    report = validate_steps(df, LIMITS)
    assert report.success and report.counted == {"prefix breaks (counted)": 2}
    [counted] = [r for r in report.results if r["name"] == "prefix breaks (counted)"]
    assert counted["success"] and {(e["trajectory_id"], e["step_index"]) for e in counted["examples"]} == {
        (df.loc[3, "trajectory_id"], 1), (df.loc[5, "trajectory_id"], 1)}
    assert report.render().endswith("; prefix breaks (counted): 2")
    df["retokenized"] = df.index == 3  # a failing gate still reports the count
    failing = validate_steps(df, LIMITS)
    assert not failing.success and "prefix breaks (counted): 2" in failing.render().splitlines()[0]
