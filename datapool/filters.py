"""RL data filters and reward shaping over a round's step table, run after the quality gate and before training.

A filter is ``fn(frame, cfg) -> (frame, stats)`` registered in FILTERS under the name params.yaml lists; ``frame`` is
the step table of ``DataPool.steps_frame`` / ``datapool.parquet.read_steps`` (one row per step, the trajectory's
columns repeated on each of its rows). Filters drop whole trajectories or groups, or shape rewards; they never
modify their input. docs/algorithms.md §7 (filters) and §8 (shaping).

Shaping keeps the books: an adjustment ``a`` to a trajectory is added to ``reward`` on its last step, to
``episode_return`` on every one of its rows, and to ``shaping`` on every one of its rows. So the step rewards still
sum to the return, and ``episode_return - shaping`` is always the return the env gave.

Every filter reports ``<name>_dropped_trajectories``, ``<name>_dropped_groups``, ``<name>_dropped_steps`` and
``<name>_shaped_trajectories``; shaping filters add ``<name>_shaping_sum`` (sum of the adjustments over trajectories).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from models.checks import ConfigValueError
from models.registry import Registry

FILTERS = Registry("filter")
"""name -> ``fn(frame: DataFrame, cfg: FilterConfig) -> (DataFrame, dict[str, float])``."""

MIN_GROUP_TRAJECTORIES = 2
"""tool_failure drops a group it leaves with fewer trajectories than this: one trajectory has no group baseline."""


@dataclass(frozen=True)
class FilterConfig:
    """params.yaml ``train.filters``: which filters run, in order, and their knobs."""

    names: tuple[str, ...] = field(default=(), metadata={"registry": FILTERS})
    """Filters and shaping applied before the advantages (FILTERS), in this order; each at most once. Empty by
    default: FrozenLake's turn limit is part of the task, so "truncated" would drop real failures."""
    keep_truncated: bool = False
    """truncated: keep trajectories cut by the turn limit (status "truncated") or whose response hit max tokens.
    They are flagged and counted either way; by default they are dropped (their outcome is unknown, not a failure)."""
    overlong_max_tokens: int = 20480
    """overlong: L_max, the trajectory's total response tokens at which the full penalty applies (DAPO: 20480).
    Set it to the rollout's real budget (max turns x max_new_tokens), or the penalty never applies."""
    overlong_buffer_tokens: int = 4096
    """overlong: the soft zone below L_max over which the penalty rises linearly from 0 (DAPO: 4096)."""
    overlong_penalty: float = 1.0
    """overlong: the penalty at and beyond L_max (DAPO: 1.0, the size of the outcome reward)."""
    efficiency_bonus: float = 0.1
    """efficiency_gating: the largest bonus a correct trajectory can get (the most efficient of its cohort on both
    tool calls and tokens); small next to the outcome reward so a correct trajectory always beats a wrong one."""
    efficiency_tool_weight: float = 0.5
    """efficiency_gating: weight of the tool-call rank in the bonus; the token rank gets 1 - this."""
    tool_penalty_per_call: float = 0.05
    """tool_penalty: penalty per redundant tool call at a group success rate of 1 (scaled by the group's rate)."""
    dual_path_penalty_per_call: float = 0.02
    """dual_path: penalty per tool call of a tool-using success when the group's tool-free path also succeeded."""

    def __post_init__(self) -> None:
        if isinstance(self.names, str) or not all(isinstance(n, str) for n in self.names):
            raise ConfigValueError("names", self.names, "a list of filter names")
        unknown = [n for n in self.names if n not in FILTERS]
        if unknown:
            raise ConfigValueError("names", list(self.names), f"registered filters, not {unknown}; valid: "
                                   f"{', '.join(FILTERS.names())}")
        repeated = sorted({n for n in self.names if list(self.names).count(n) > 1})
        if repeated:
            raise ConfigValueError("names", list(self.names), f"each filter listed once, not {repeated} twice "
                                   "(shaping twice doubles it)")
        if self.overlong_buffer_tokens < 1 or self.overlong_max_tokens < self.overlong_buffer_tokens:
            raise ValueError(f"FilterConfig: need 1 <= overlong_buffer_tokens <= overlong_max_tokens, got "
                             f"{self.overlong_buffer_tokens} and {self.overlong_max_tokens}: shrink the buffer")
        for name in ("overlong_penalty", "efficiency_bonus", "tool_penalty_per_call", "dual_path_penalty_per_call"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"FilterConfig: {name} must be a finite number >= 0 (a penalty is subtracted, "
                                 f"a bonus added), got {value}")
        if not 0.0 <= self.efficiency_tool_weight <= 1.0:
            raise ValueError(f"FilterConfig: efficiency_tool_weight must be in [0, 1], got "
                             f"{self.efficiency_tool_weight}")


# --------------------------------------------------------------------------------------------------- helpers

def _require(frame: pd.DataFrame, name: str, columns: tuple[str, ...]) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"filter {name!r}: the step table lacks columns {missing}; pass a frame from "
                         f"DataPool.steps_frame or datapool.parquet.read_steps")


def trajectory_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per trajectory, indexed by trajectory_id in order of first appearance.

    Columns (each only when its source column is in ``frame``): group_id, episode_return, won, status; tool_calls,
    tool_successes (summed over steps) and uses_tools (tool_calls > 0); response_tokens (sum of len(response_ids));
    any_truncated (some step's response hit max tokens).
    """
    by_traj = frame.groupby("trajectory_id", sort=False, dropna=False)
    table = by_traj[[c for c in ("group_id", "episode_return", "won", "status") if c in frame.columns]].first()
    if "won" in table.columns:
        table["won"] = table["won"].astype(bool)
    for name in ("tool_calls", "tool_successes"):
        if name in frame.columns:
            table[name] = by_traj[name].sum().astype("int64")
    if "tool_calls" in table.columns:
        table["uses_tools"] = table["tool_calls"] > 0
    if "response_ids" in frame.columns:
        table["response_tokens"] = frame["response_ids"].map(len).groupby(frame["trajectory_id"], sort=False).sum()
    if "truncated" in frame.columns:
        table["any_truncated"] = frame["truncated"].astype(bool).groupby(frame["trajectory_id"], sort=False).any()
    return table


def _counts(name: str, before: pd.DataFrame, after: pd.DataFrame, shaped: int = 0) -> dict[str, float]:
    """Counts of what went from ``before`` to ``after`` (filters only remove, so differences are drops)."""
    return {
        f"{name}_dropped_trajectories": before["trajectory_id"].nunique() - after["trajectory_id"].nunique(),
        f"{name}_dropped_groups": before["group_id"].nunique(dropna=False) - after["group_id"].nunique(dropna=False),
        f"{name}_dropped_steps": len(before) - len(after),
        f"{name}_shaped_trajectories": shaped,
    }


def _drop_trajectories(name: str, frame: pd.DataFrame, drop_ids) -> tuple[pd.DataFrame, dict[str, float]]:
    kept = frame.loc[~frame["trajectory_id"].isin(drop_ids)].reset_index(drop=True)
    return kept, _counts(name, frame, kept)


def _shape(name: str, frame: pd.DataFrame, adjustment: pd.Series) -> tuple[pd.DataFrame, dict[str, float]]:
    """Add ``adjustment`` (per trajectory_id; absent = 0) to the last step's reward, to episode_return and shaping."""
    adjustment = adjustment[adjustment != 0].astype("float64")
    out = frame.reset_index(drop=True)  # a new frame: columns assigned below never reach the caller's
    per_row = out["trajectory_id"].map(adjustment).fillna(0.0).astype("float64")  # [rows]
    is_last = out.index.isin(out.groupby("trajectory_id", sort=False)["step_index"].idxmax())  # [rows]
    out = out.assign(reward=out["reward"].astype("float64") + per_row.where(is_last, 0.0),
                     episode_return=out["episode_return"].astype("float64") + per_row,
                     shaping=(out["shaping"] if "shaping" in out.columns else 0.0) + per_row)
    stats = _counts(name, frame, out, shaped=len(adjustment))
    stats[f"{name}_shaping_sum"] = float(adjustment.sum())
    return out, stats


def _beaten_share(values: pd.Series, groups: pd.Series) -> pd.Series:
    """Per row: the share of the other members of its group with a strictly larger value, in [0, 1]; 0 alone."""
    size = values.groupby(groups).transform("size")
    at_most = values.groupby(groups).rank(method="max")  # members with a value <= this one, itself included
    return ((size - at_most) / (size - 1).clip(lower=1)).where(size > 1, 0.0)


# --------------------------------------------------------------------------------------------------- filters

def degenerate_group_ids(frame: pd.DataFrame) -> list:
    """Groups whose trajectories all have the same episode_return (zero GRPO signal), in order of appearance.

    A group of one trajectory counts (no spread), and so does a group whose returns are all NaN. The rollout stage
    re-samples these scenarios up to its limit.
    """
    _require(frame, "degenerate_groups", ("trajectory_id", "group_id", "episode_return"))
    returns = frame.drop_duplicates("trajectory_id")
    by_group = returns.groupby("group_id", sort=False, dropna=False)["episode_return"]
    spread = by_group.max() - by_group.min()
    return list(spread.index[~(spread > 0)])


@FILTERS.register("degenerate_groups")
def degenerate_groups(frame: pd.DataFrame, cfg: FilterConfig) -> tuple[pd.DataFrame, dict[str, float]]:
    """Drop every group whose returns are all equal (DAPO dynamic sampling); see ``degenerate_group_ids``."""
    kept = frame.loc[~frame["group_id"].isin(degenerate_group_ids(frame))].reset_index(drop=True)
    return kept, _counts("degenerate_groups", frame, kept)


@FILTERS.register("tool_failure")
def tool_failure(frame: pd.DataFrame, cfg: FilterConfig) -> tuple[pd.DataFrame, dict[str, float]]:
    """Drop trajectories that made tool calls of which none succeeded (TAO-RL), then every group this left with
    fewer than MIN_GROUP_TRAJECTORIES; the group baseline is recomputed downstream over what remains.
    Extra stat: ``tool_failure_failed_trajectories`` (those with all calls failed)."""
    _require(frame, "tool_failure", ("trajectory_id", "group_id", "tool_calls", "tool_successes"))
    table = trajectory_table(frame)
    failed = (table["tool_calls"] > 0) & (table["tool_successes"] == 0)
    remaining = table.loc[~failed, "group_id"].value_counts()
    thin = [g for g in table.loc[failed, "group_id"].unique() if remaining.get(g, 0) < MIN_GROUP_TRAJECTORIES]
    drop = table.index[failed | table["group_id"].isin(thin)]
    kept, stats = _drop_trajectories("tool_failure", frame, drop)
    stats["tool_failure_failed_trajectories"] = int(failed.sum())
    return kept, stats


@FILTERS.register("truncated")
def truncated(frame: pd.DataFrame, cfg: FilterConfig) -> tuple[pd.DataFrame, dict[str, float]]:
    """Flag trajectories with status "truncated" (turn limit) or a step with ``truncated`` (response cut at max
    tokens); drop them unless ``cfg.keep_truncated``. Extra stat: ``truncated_flagged_trajectories`` (always)."""
    _require(frame, "truncated", ("trajectory_id", "group_id", "status", "truncated"))
    table = trajectory_table(frame)
    flagged = (table["status"] == "truncated") | table["any_truncated"]
    kept, stats = _drop_trajectories("truncated", frame, [] if cfg.keep_truncated else table.index[flagged])
    stats["truncated_flagged_trajectories"] = int(flagged.sum())
    return kept, stats


@FILTERS.register("overlong")
def overlong(frame: pd.DataFrame, cfg: FilterConfig) -> tuple[pd.DataFrame, dict[str, float]]:
    """DAPO soft overlong punishment on the trajectory's total response tokens L (arXiv:2503.14476):
    a = -penalty * clip((L - (L_max - buffer)) / buffer, 0, 1): 0 up to L_max - buffer, -penalty from L_max on."""
    _require(frame, "overlong", ("trajectory_id", "group_id", "step_index", "response_ids", "reward",
                                 "episode_return"))
    tokens = trajectory_table(frame)["response_tokens"]
    start = cfg.overlong_max_tokens - cfg.overlong_buffer_tokens
    over = ((tokens - start) / cfg.overlong_buffer_tokens).clip(lower=0.0, upper=1.0)
    return _shape("overlong", frame, -cfg.overlong_penalty * over)


@FILTERS.register("efficiency_gating")
def efficiency_gating(frame: pd.DataFrame, cfg: FilterConfig) -> tuple[pd.DataFrame, dict[str, float]]:
    """SlimSearcher adaptive reward gating (arXiv abstract; formulation ours): only correct (won) trajectories get a
    bonus, from their rank within the group's correct cohort, never from absolute length:

        bonus_i = efficiency_bonus * (w * beaten_i(tool_calls) + (1 - w) * beaten_i(response tokens))

    beaten_i(x) = share of the other cohort members with strictly more x, in [0, 1]. A cohort of one, or members
    tied on both, get 0; incorrect trajectories get 0.
    """
    _require(frame, "efficiency_gating", ("trajectory_id", "group_id", "step_index", "won", "tool_calls",
                                          "response_ids", "reward", "episode_return"))
    table = trajectory_table(frame)
    cohort = table[table["won"]]
    w = cfg.efficiency_tool_weight
    share = (w * _beaten_share(cohort["tool_calls"], cohort["group_id"])
             + (1.0 - w) * _beaten_share(cohort["response_tokens"], cohort["group_id"]))
    return _shape("efficiency_gating", frame, cfg.efficiency_bonus * share)


@FILTERS.register("tool_penalty")
def tool_penalty(frame: pd.DataFrame, cfg: FilterConfig) -> tuple[pd.DataFrame, dict[str, float]]:
    """EAPO difficulty-aware tool penalty (arXiv abstract; formulation ours). Per group, on successful trajectories:

        a_i = -tool_penalty_per_call * success_rate_g * (tool_calls_i - min_{j won in g} tool_calls_j)

    success_rate_g = won / trajectories of the group in ``frame``: easy scenarios are penalized more. A failed
    trajectory is not penalized (its calls are not known to be redundant); a group with no success gets nothing.
    """
    _require(frame, "tool_penalty", ("trajectory_id", "group_id", "step_index", "won", "tool_calls", "reward",
                                     "episode_return"))
    table = trajectory_table(frame)
    rate = table.groupby("group_id")["won"].transform("mean")
    cohort = table[table["won"]]
    redundant = cohort["tool_calls"] - cohort.groupby("group_id")["tool_calls"].transform("min")
    return _shape("tool_penalty", frame, -cfg.tool_penalty_per_call * rate[cohort.index] * redundant)


@FILTERS.register("dual_path")
def dual_path(frame: pd.DataFrame, cfg: FilterConfig) -> tuple[pd.DataFrame, dict[str, float]]:
    """AKBE dual-path knowledge boundary (arXiv abstract; formulation ours). A trajectory uses tools when its
    tool_calls > 0. If some tool-free trajectory of a group won, the tool was not needed: every tool-using winner
    of that group gets a_i = -dual_path_penalty_per_call * tool_calls_i. Other groups are untouched.
    """
    _require(frame, "dual_path", ("trajectory_id", "group_id", "step_index", "won", "tool_calls", "reward",
                                  "episode_return"))
    table = trajectory_table(frame)
    tool_free_won = table.loc[table["won"] & ~table["uses_tools"], "group_id"].unique()
    target = table["won"] & table["uses_tools"] & table["group_id"].isin(tool_free_won)
    return _shape("dual_path", frame, -cfg.dual_path_penalty_per_call * table.loc[target, "tool_calls"])


# --------------------------------------------------------------------------------------------------- running

def apply_filters(frame: pd.DataFrame, cfg: FilterConfig) -> tuple[pd.DataFrame, dict[str, float]]:
    """Run the filters ``cfg.names`` in that order; return (the kept, shaped frame with a ``shaping`` column, stats).

    Stats merge every filter's, plus ``filters_{trajectories,groups,steps}_{in,out}``. ``frame`` is never modified.
    """
    out = frame.reset_index(drop=True)
    if "shaping" not in out.columns:
        out = out.assign(shaping=0.0)
    stats: dict[str, float] = {
        "filters_trajectories_in": frame["trajectory_id"].nunique(),
        "filters_groups_in": frame["group_id"].nunique(dropna=False), "filters_steps_in": len(frame),
    }
    for name in cfg.names:
        out, filter_stats = FILTERS[name](out, cfg)
        stats.update(filter_stats)
    stats.update({"filters_trajectories_out": out["trajectory_id"].nunique(),
                  "filters_groups_out": out["group_id"].nunique(dropna=False), "filters_steps_out": len(out)})
    return out, stats
