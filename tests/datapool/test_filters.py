"""RL data filters and reward shaping: hand-worked frames per filter, order of application, bookkeeping, errors."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapool.filters import FILTERS, FilterConfig, apply_filters, degenerate_group_ids, trajectory_table
from datapool.parquet import export_steps, read_steps
from datapool.records import StepRecord, TrajectoryRecord
from datapool.store import DataPool


def traj(tid: str, group: str, *, rewards=(0.0, 1.0), won: bool = True, status: str = "complete",
         tools=None, successes=None, tokens=None, cut=None, episode_return: float | None = None) -> list[dict]:
    """Step rows of one trajectory; per-step lists default to no tool calls, 2 tokens, not truncated."""
    n = len(rewards)
    tools, successes = tools or [0] * n, successes or [0] * n
    tokens, cut = tokens or [2] * n, cut or [False] * n
    ret = float(sum(rewards)) if episode_return is None else episode_return
    return [{"trajectory_id": tid, "group_id": group, "step_index": k, "response_ids": list(range(tokens[k])),
             "reward": float(rewards[k]), "truncated": cut[k], "tool_calls": tools[k], "tool_successes": successes[k],
             "status": status, "won": won, "episode_return": ret} for k in range(n)]


def frame(*trajs: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([row for rows in trajs for row in rows])


def returns(df: pd.DataFrame) -> dict[str, float]:
    first = df.groupby("trajectory_id", sort=False)["episode_return"].first()
    return {tid: round(float(r), 10) for tid, r in first.items()}


def last_rewards(df: pd.DataFrame) -> dict[str, float]:
    last = df.loc[df.groupby("trajectory_id", sort=False)["step_index"].idxmax()]
    return {tid: round(float(r), 10) for tid, r in zip(last["trajectory_id"], last["reward"])}


CFG = FilterConfig()


# ------------------------------------------------------------------------------------------------ drop filters

def test_degenerate_groups_drops_groups_with_equal_returns() -> None:
    """g0 returns (1, 0): signal, kept. g1 (0.5, 0.5), g2 one trajectory, g3 (NaN, NaN): no spread, dropped."""
    df = frame(traj("a", "g0"), traj("b", "g0", rewards=(0, 0)),
               traj("c", "g1", rewards=(0, 0.5)), traj("d", "g1", rewards=(0.5, 0)),
               traj("e", "g2"),
               traj("f", "g3", episode_return=float("nan")), traj("g", "g3", episode_return=float("nan")))
    assert degenerate_group_ids(df) == ["g1", "g2", "g3"]
    kept, stats = FILTERS["degenerate_groups"](df, CFG)
    assert kept["trajectory_id"].unique().tolist() == ["a", "b"] and kept.index.tolist() == [0, 1, 2, 3]
    assert stats == {"degenerate_groups_dropped_trajectories": 5, "degenerate_groups_dropped_groups": 3,
                     "degenerate_groups_dropped_steps": 10, "degenerate_groups_shaped_trajectories": 0}


def test_tool_failure_drops_all_failed_tool_users_then_thin_groups() -> None:
    """g0: a called 2 tools, none succeeded -> dropped; b (1 of 1 across steps) and c (no calls) remain: 2, kept.
    g1: d failed -> e is left alone -> g1 dropped. g2: no calls, untouched. g3: a lone trajectory the filter did not
    shrink stays (only groups *left* with < 2 go)."""
    df = frame(traj("a", "g0", tools=[1, 1], successes=[0, 0]), traj("b", "g0", tools=[0, 1], successes=[0, 1]),
               traj("c", "g0"),
               traj("d", "g1", tools=[3, 0]), traj("e", "g1", tools=[1, 1], successes=[1, 0]),
               traj("f", "g2"), traj("g", "g2"),
               traj("h", "g3"))
    kept, stats = FILTERS["tool_failure"](df, CFG)
    assert kept["trajectory_id"].unique().tolist() == ["b", "c", "f", "g", "h"]
    assert stats == {"tool_failure_dropped_trajectories": 3, "tool_failure_dropped_groups": 1,
                     "tool_failure_dropped_steps": 6, "tool_failure_shaped_trajectories": 0,
                     "tool_failure_failed_trajectories": 2}


def test_truncated_is_flagged_always_and_dropped_by_default() -> None:
    """a hit the turn limit (status), b's second response hit max tokens, c is clean."""
    df = frame(traj("a", "g0", status="truncated"), traj("b", "g0", cut=[False, True]), traj("c", "g0"),
               traj("d", "g1", status="failed"))
    kept, stats = FILTERS["truncated"](df, CFG)
    assert kept["trajectory_id"].unique().tolist() == ["c", "d"]
    assert stats == {"truncated_dropped_trajectories": 2, "truncated_dropped_groups": 0,
                     "truncated_dropped_steps": 4, "truncated_shaped_trajectories": 0,
                     "truncated_flagged_trajectories": 2}

    kept, stats = FILTERS["truncated"](df, FilterConfig(keep_truncated=True))
    pd.testing.assert_frame_equal(kept, df)
    assert stats["truncated_flagged_trajectories"] == 2 and stats["truncated_dropped_trajectories"] == 0


# ------------------------------------------------------------------------------------------------ shaping

def test_overlong_penalty_rises_linearly_in_the_buffer() -> None:
    """L_max 10, buffer 4, penalty 1: zero up to 6 tokens. Totals: a 3+3=6 -> 0; b 4+4=8 -> -(8-6)/4 = -0.5;
    c 5+5=10 -> -1; d 6+7=13 -> -1 (capped). Each return was 0 + 1 = 1; the last step's reward 1 takes the penalty."""
    cfg = FilterConfig(overlong_max_tokens=10, overlong_buffer_tokens=4, overlong_penalty=1.0)
    df = frame(traj("a", "g", tokens=[3, 3]), traj("b", "g", tokens=[4, 4]), traj("c", "g", tokens=[5, 5]),
               traj("d", "g", tokens=[6, 7]))
    df = df.iloc[::-1].reset_index(drop=True)  # last steps first: shaping must find them by step_index
    out, stats = FILTERS["overlong"](df, cfg)
    assert returns(out) == {"d": 0.0, "c": 0.0, "b": 0.5, "a": 1.0}
    assert last_rewards(out) == {"d": 0.0, "c": 0.0, "b": 0.5, "a": 1.0}
    assert (out.loc[out["step_index"] == 0, "reward"] == 0.0).all()  # first steps untouched
    assert out.groupby("trajectory_id")["shaping"].agg(set).to_dict() == {"a": {0.0}, "b": {-0.5}, "c": {-1.0},
                                                                         "d": {-1.0}}
    assert stats == {"overlong_dropped_trajectories": 0, "overlong_dropped_groups": 0, "overlong_dropped_steps": 0,
                     "overlong_shaped_trajectories": 3, "overlong_shaping_sum": -2.5}


def test_efficiency_gating_ranks_only_the_correct_cohort() -> None:
    """g0 cohort a, b, c (won); d lost. Tool calls a 1, b 3, c 1 -> share of others with strictly more calls:
    a 1/2, b 0, c 1/2. Tokens a 10, b 6, c 20 -> a 1/2, b 2/2, c 0. Bonus 0.1 * (0.5*tool + 0.5*token):
    a 0.1*(0.25+0.25) = 0.05, b 0.1*(0+0.5) = 0.05, c 0.1*(0.25+0) = 0.025; d (shortest of all, but wrong) 0.
    g1: one winner -> nothing to rank against -> 0. g2: two winners tied on both -> 0."""
    df = frame(traj("a", "g0", tools=[1, 0], successes=[1, 0], tokens=[5, 5]),
               traj("b", "g0", tools=[2, 1], successes=[2, 1], tokens=[3, 3]),
               traj("c", "g0", tools=[0, 1], successes=[0, 1], tokens=[10, 10]),
               traj("d", "g0", rewards=(0, 0), won=False, tokens=[1, 1]),
               traj("p", "g1", tools=[5, 5], successes=[5, 5]), traj("q", "g1", rewards=(0, 0), won=False),
               traj("r", "g2"), traj("s", "g2"))
    out, stats = FILTERS["efficiency_gating"](df, CFG)
    assert returns(out) == {"a": 1.05, "b": 1.05, "c": 1.025, "d": 0.0, "p": 1.0, "q": 0.0, "r": 1.0, "s": 1.0}
    assert last_rewards(out) == returns(out)  # every first-step reward was 0
    assert stats["efficiency_gating_shaped_trajectories"] == 3
    assert stats["efficiency_gating_shaping_sum"] == pytest.approx(0.125)


def test_tool_penalty_scales_redundant_calls_by_group_success_rate() -> None:
    """g0: a won with 2 calls, b won with 5, c lost with 7, d lost with 0: rate 2/4, min among winners 2 ->
    b: -0.05 * 0.5 * 3 = -0.075; a 0; losers 0. g1 (easy, rate 1): calls 1, 1, 2, 4 -> 0, 0, -0.05, -0.15.
    g2: no winner -> nothing."""
    df = frame(traj("a", "g0", tools=[2, 0], successes=[2, 0]), traj("b", "g0", tools=[3, 2], successes=[1, 1]),
               traj("c", "g0", rewards=(0, 0), won=False, tools=[7, 0], successes=[1, 0]),
               traj("d", "g0", rewards=(0, 0), won=False),
               *(traj(t, "g1", tools=[n, 0], successes=[n, 0]) for t, n in zip("efgh", (1, 1, 2, 4))),
               traj("i", "g2", rewards=(0, 0), won=False, tools=[3, 3], successes=[3, 3]))
    out, stats = FILTERS["tool_penalty"](df, CFG)
    assert returns(out) == {"a": 1.0, "b": 0.925, "c": 0.0, "d": 0.0, "e": 1.0, "f": 1.0, "g": 0.95, "h": 0.85,
                            "i": 0.0}
    assert stats["tool_penalty_shaped_trajectories"] == 3
    assert stats["tool_penalty_shaping_sum"] == pytest.approx(-0.275)


def test_dual_path_penalizes_tool_users_when_the_tool_free_path_succeeded() -> None:
    """g0: a won without tools, so b (won, 3 calls) gets -0.02 * 3 = -0.06; c used tools but lost: 0.
    g1: the only tool-free trajectory (e) lost, so d's tool use was needed: 0."""
    df = frame(traj("a", "g0"), traj("b", "g0", tools=[1, 2], successes=[1, 2]),
               traj("c", "g0", rewards=(0, 0), won=False, tools=[2, 0], successes=[2, 0]),
               traj("d", "g1", tools=[2, 0], successes=[2, 0]), traj("e", "g1", rewards=(0, 0), won=False))
    assert trajectory_table(df)["uses_tools"].to_dict() == {"a": False, "b": True, "c": True, "d": True, "e": False}
    out, stats = FILTERS["dual_path"](df, CFG)
    assert returns(out) == {"a": 1.0, "b": 0.94, "c": 0.0, "d": 1.0, "e": 0.0}
    assert last_rewards(out)["b"] == 0.94 and stats["dual_path_shaped_trajectories"] == 1


# ------------------------------------------------------------------------------------------------ running

def test_order_of_application_matters_and_shaping_accumulates() -> None:
    """a and b both won (return 1); b is overlong (8 of L_max 10, buffer 4 -> -0.5).
    degenerate_groups first: returns (1, 1) -> g0 dropped. overlong first: returns (1, 0.5) -> g0 kept."""
    cfg = FilterConfig(overlong_max_tokens=10, overlong_buffer_tokens=4)
    df = frame(traj("a", "g0"), traj("b", "g0", tokens=[4, 4], tools=[1, 0], successes=[1, 0]),
               traj("c", "g1"), traj("d", "g1", rewards=(0, 0), won=False))
    early, stats = apply_filters(df, replace(cfg, names=("degenerate_groups", "overlong")))
    assert early["group_id"].unique().tolist() == ["g1"] and stats["overlong_shaped_trajectories"] == 0
    late, stats = apply_filters(df, replace(cfg, names=("overlong", "degenerate_groups")))
    assert late["group_id"].unique().tolist() == ["g0", "g1"] and returns(late)["b"] == 0.5
    assert stats["degenerate_groups_dropped_groups"] == 0
    assert {k: stats[k] for k in stats if k.startswith("filters_")} == {
        "filters_trajectories_in": 4, "filters_groups_in": 2, "filters_steps_in": 8,
        "filters_trajectories_out": 4, "filters_groups_out": 2, "filters_steps_out": 8}

    # overlong -0.5 then dual_path: a won tool-free, so b (1 call) -0.02 more; shaping holds the total
    both, stats = apply_filters(df, replace(cfg, names=("overlong", "dual_path")))
    b = both[both["trajectory_id"] == "b"]
    assert b["shaping"].round(10).tolist() == [-0.52, -0.52] and b["reward"].round(10).tolist() == [0.0, 0.48]
    assert (both["episode_return"] - both["shaping"]).tolist() == df["episode_return"].tolist()


def test_unknown_repeated_and_string_names_are_rejected_when_configured() -> None:
    with pytest.raises(ValueError) as err:
        replace(CFG, names=("truncated", "overlong_v2", "nope"))
    message = str(err.value)
    assert "['overlong_v2', 'nope']" in message and ", ".join(FILTERS.names()) in message
    with pytest.raises(ValueError, match=r"not \['overlong'\] twice"):
        replace(CFG, names=("overlong", "truncated", "overlong"))
    with pytest.raises(ValueError, match="a list of filter names"):
        replace(CFG, names="overlong")


def test_missing_columns_name_the_filter() -> None:
    with pytest.raises(ValueError, match=r"filter 'tool_failure'.*\['tool_calls', 'tool_successes'\]"):
        apply_filters(frame(traj("a", "g0")).drop(columns=["tool_calls", "tool_successes"]),
                      replace(CFG, names=("tool_failure",)))


def test_no_filter_modifies_its_input() -> None:
    df = frame(traj("a", "g0", tools=[1, 0], tokens=[9, 9]), traj("b", "g0", status="truncated"),
               traj("c", "g0", tools=[2, 0], successes=[2, 0]), traj("d", "g0", rewards=(0, 0), won=False),
               traj("e", "g1"), traj("f", "g1"))
    df.index = df.index + 100  # a non-default index must survive too
    snapshot = df.copy(deep=True)
    ids = [id(v) for v in df["response_ids"]]
    cfg = FilterConfig(overlong_max_tokens=16, overlong_buffer_tokens=4)
    for name in FILTERS.names():
        FILTERS[name](df, cfg)
    out, _ = apply_filters(df, replace(cfg, names=tuple(FILTERS.names())))
    pd.testing.assert_frame_equal(df, snapshot)
    assert [id(v) for v in df["response_ids"]] == ids and "shaping" not in df.columns
    assert "shaping" in out.columns


def test_an_empty_frame_passes_through_every_filter() -> None:
    empty = frame(traj("a", "g0")).iloc[0:0]
    out, stats = apply_filters(empty, replace(CFG, names=tuple(FILTERS.names())))
    assert out.empty and "shaping" in out.columns
    assert all(value == 0 for value in stats.values())


@pytest.mark.parametrize("kwargs, match", [
    ({"overlong_buffer_tokens": 0}, "overlong_buffer_tokens"),
    ({"overlong_max_tokens": 8, "overlong_buffer_tokens": 16}, "shrink the buffer"),
    ({"tool_penalty_per_call": -0.1}, "tool_penalty_per_call must be a finite number >= 0"),
    ({"efficiency_bonus": float("inf")}, "efficiency_bonus"),
    ({"efficiency_tool_weight": 1.5}, r"efficiency_tool_weight must be in \[0, 1\]"),
])
def test_bad_config_is_rejected_with_a_fix(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FilterConfig(**kwargs)


def test_a_pool_frame_goes_through_the_filters_and_into_parquet(tmp_path: Path) -> None:
    trajs = []
    for t, (won, calls) in enumerate([(True, 0), (True, 2), (False, 1)]):
        tid = f"t{t}"
        steps = [StepRecord(tid, "g0", k, [1, 2], [3, 4], [-0.5, -0.5], "p", "o", "up", " up", float(won and k == 1),
                            "a", "v1", tool_calls=calls if k == 0 else 0, tool_successes=calls if k == 0 else 0)
                 for k in range(2)]
        trajs.append(TrajectoryRecord(tid, "g0", "{}", "tools", "train", 1, "v1", "complete", float(won), won, 2, 4,
                                      steps=steps))
    with DataPool(str(tmp_path / "pool.db")) as pool:
        pool.add_trajectories(trajs)
        df = pool.steps_frame(round=1)
    out, stats = apply_filters(df, replace(CFG, names=("truncated", "tool_failure", "dual_path",
                                                       "degenerate_groups")))
    assert returns(out) == {"t0": 1.0, "t1": 0.96, "t2": 0.0} and stats["filters_groups_out"] == 1
    export_steps(out, tmp_path / "validated.parquet", metadata={"round": 1, **stats})
    back, meta = read_steps(tmp_path / "validated.parquet")
    assert back["shaping"].round(10).tolist() == [0.0, 0.0, -0.04, -0.04, 0.0, 0.0]
    assert meta["dual_path_shaped_trajectories"] == 1


# ------------------------------------------------------------------------------------------------ properties

def efficiency_by_loop(df: pd.DataFrame, cfg: FilterConfig) -> dict[str, float]:
    """The efficiency bonus written as plain loops over the trajectory table."""
    table = trajectory_table(df)
    bonus = {}
    for tid, row in table.iterrows():
        cohort = table[(table["group_id"] == row["group_id"]) & table["won"]]
        if not row["won"] or len(cohort) < 2:
            bonus[tid] = 0.0
            continue
        tool = sum(other > row["tool_calls"] for other in cohort["tool_calls"]) / (len(cohort) - 1)
        token = sum(other > row["response_tokens"] for other in cohort["response_tokens"]) / (len(cohort) - 1)
        bonus[tid] = cfg.efficiency_bonus * (cfg.efficiency_tool_weight * tool
                                             + (1 - cfg.efficiency_tool_weight) * token)
    return bonus


@st.composite
def step_tables(draw) -> pd.DataFrame:
    trajs = []
    for t in range(draw(st.integers(1, 8))):
        n = draw(st.integers(1, 3))
        tools = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
        trajs.append(traj(
            f"t{t}", f"g{draw(st.integers(0, 2))}", rewards=draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]),
                                                                          min_size=n, max_size=n)),
            won=draw(st.booleans()), status=draw(st.sampled_from(["complete", "truncated"])), tools=tools,
            successes=[draw(st.integers(0, c)) for c in tools],
            tokens=draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)),
            cut=draw(st.lists(st.booleans(), min_size=n, max_size=n))))
    return frame(*trajs).sample(frac=1.0, random_state=draw(st.integers(0, 9))).reset_index(drop=True)


@settings(max_examples=40, deadline=None)
@given(step_tables(), st.permutations(FILTERS.names()))
def test_any_filter_order_keeps_the_books(df: pd.DataFrame, names: list[str]) -> None:
    """Whatever runs: rows only disappear, whole trajectories at a time; step rewards still sum to the return;
    episode_return - shaping is the env's return; the reward changes only on last steps."""
    cfg = FilterConfig(overlong_max_tokens=12, overlong_buffer_tokens=6, efficiency_tool_weight=0.25)
    out, _ = apply_filters(df, replace(cfg, names=tuple(names)))
    original = df.set_index(["trajectory_id", "step_index"])
    shaped = out.set_index(["trajectory_id", "step_index"])
    assert set(shaped.index) <= set(original.index)
    kept = set(out["trajectory_id"])
    assert len(shaped) == int(df["trajectory_id"].isin(kept).sum())
    sums = out.groupby("trajectory_id")["reward"].sum()
    assert np.allclose(sums.to_numpy(), out.groupby("trajectory_id")["episode_return"].first()[sums.index])
    assert np.allclose(out["episode_return"] - out["shaping"], original.loc[shaped.index, "episode_return"])
    delta = shaped["reward"] - original.loc[shaped.index, "reward"]
    last = shaped.index.get_level_values(1) == shaped.groupby(level=0)["reward"].transform("size").to_numpy() - 1
    assert np.allclose(delta[~last], 0.0) and np.allclose(delta[last], shaped["shaping"][last])

    gated, _ = FILTERS["efficiency_gating"](df, cfg)
    expected = efficiency_by_loop(df, cfg)
    got = (gated.groupby("trajectory_id")["shaping"].first()).to_dict()
    assert all(math.isclose(got[t], expected[t], abs_tol=1e-12) for t in expected)
