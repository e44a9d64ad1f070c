"""build_batch: whole GRPO groups only, GiGPO step rows without excluded steps, the token budget, clear errors."""
from __future__ import annotations

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapool.batches import build_batch


def rows(group: str, trajs: int, steps: int = 2, *, status: str = "complete", excluded=(), prompt: int = 3,
         response: int = 2, prefix: str = "") -> list[dict]:
    """Step rows of one group: ``trajs`` trajectories x ``steps`` steps, each step prompt+response tokens."""
    out = []
    for t in range(trajs):
        tid = f"{prefix or group}-t{t}"
        for k in range(steps):
            out.append({"trajectory_id": tid, "group_id": group, "step_index": k, "prompt_ids": [1] * prompt,
                        "response_ids": [2] * response, "status": status, "anchor": f"s{k}",
                        "excluded": (tid, k) in excluded or tid in excluded, "episode_return": float(t)})
    return out


def frame(*parts: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([row for part in parts for row in part])


def test_grpo_takes_whole_complete_groups_and_drops_the_rest() -> None:
    df = frame(
        rows("a", 3),                                  # usable: 3 trajectories, 6 rows, 30 tokens
        rows("b", 2, excluded={("b-t0", 1)}),          # one step of b-t0 excluded -> b-t0 goes -> 1 left: dropped
        rows("c", 3, excluded={"c-t2"}),               # c-t2 excluded -> 2 left: usable
        rows("d", 1),                                  # a group of one: no baseline
        rows("e", 2, status="truncated"),              # not complete
    )
    batch = build_batch(df, algorithm="grpo", token_budget=10_000)
    assert sorted(batch.rows["group_id"].unique()) == ["a", "c"]
    assert sorted(batch.rows["trajectory_id"].unique()) == ["a-t0", "a-t1", "a-t2", "c-t0", "c-t1"]
    assert not batch.rows["excluded"].any()
    s = batch.summary
    assert (s["groups"], s["trajectories"], s["steps"], s["tokens"]) == (2, 5, 10, 50)
    assert s["dropped"] == {"excluded_trajectories": 2, "excluded_steps": 0, "incomplete_trajectories": 2,
                            "small_groups": 3, "over_budget_groups": 0}
    # rows are every step of each chosen trajectory, in order
    assert batch.rows.groupby("trajectory_id")["step_index"].apply(list).tolist() == [[0, 1]] * 5


def test_gigpo_keeps_the_trajectory_and_drops_only_excluded_steps() -> None:
    df = frame(rows("b", 2, excluded={("b-t0", 1)}), rows("c", 2, excluded={"c-t1"}))
    batch = build_batch(df, algorithm="gigpo", token_budget=10_000)
    assert list(zip(batch.rows["trajectory_id"], batch.rows["step_index"])) == [("b-t0", 0), ("b-t1", 0),
                                                                                 ("b-t1", 1)]
    assert "anchor" in batch.rows.columns
    assert batch.summary["dropped"]["excluded_steps"] == 3 and batch.summary["dropped"]["small_groups"] == 1
    assert batch.summary["dropped"]["excluded_trajectories"] == 1


def test_the_token_budget_stops_before_it_is_exceeded_and_never_splits_a_group() -> None:
    df = frame(*(rows(f"g{i}", 2) for i in range(5)))  # each group: 2 trajectories x 2 steps x 5 tokens = 20
    assert build_batch(df, algorithm="grpo", token_budget=19).summary["groups"] == 0  # no partial group
    batch = build_batch(df, algorithm="grpo", token_budget=65)
    assert batch.summary["groups"] == 3 and batch.summary["tokens"] == 60
    assert batch.summary["dropped"]["over_budget_groups"] == 2
    assert batch.rows.groupby("group_id")["trajectory_id"].nunique().tolist() == [2, 2, 2]
    # the seed picks which groups; the same seed the same ones
    again = build_batch(df, algorithm="grpo", token_budget=65)
    assert again.rows.equals(batch.rows)
    picks = {tuple(sorted(build_batch(df, algorithm="grpo", token_budget=65, seed=s).rows["group_id"].unique()))
             for s in range(10)}
    assert len(picks) > 1


def test_bad_arguments_say_what_is_valid() -> None:
    df = frame(rows("a", 2))
    with pytest.raises(ValueError, match="valid algorithms: grpo, gigpo"):
        build_batch(df, algorithm="ppo", token_budget=10)
    with pytest.raises(ValueError, match="'token_budget'"):
        build_batch(df, algorithm="grpo", token_budget=0)
    with pytest.raises(ValueError, match="lacks columns \\['status'\\]"):
        build_batch(df.drop(columns=["status"]), algorithm="grpo", token_budget=10)
    empty = build_batch(df.iloc[:0], algorithm="gigpo", token_budget=10)
    assert len(empty.rows) == 0 and empty.summary["groups"] == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3), st.sampled_from(["complete", "failed"]),
                          st.booleans()), min_size=1, max_size=6),
       st.integers(1, 200), st.sampled_from(["grpo", "gigpo"]))
def test_any_batch_respects_the_budget_and_whole_groups(groups, budget, algorithm) -> None:
    df = frame(*(rows(f"g{i}", t, k, status=status, excluded={f"g{i}-t0"} if ex else set())
                 for i, (t, k, status, ex) in enumerate(groups)))
    batch = build_batch(df, algorithm=algorithm, token_budget=budget)
    assert batch.summary["tokens"] <= budget
    assert batch.summary["tokens"] == int((batch.rows["prompt_ids"].map(len)
                                           + batch.rows["response_ids"].map(len)).sum()) if len(batch.rows) else True
    assert (batch.rows["status"] == "complete").all() and not batch.rows["excluded"].any()
    for group, chosen in batch.rows.groupby("group_id"):
        usable = df[(df["group_id"] == group) & (df["status"] == "complete") & ~df["excluded"]]
        assert chosen["trajectory_id"].nunique() == usable["trajectory_id"].nunique() >= 2  # the whole group
        if algorithm == "grpo":
            assert len(chosen) == len(usable)
