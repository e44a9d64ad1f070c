"""Training batches from the data pool's step table: complete GRPO groups, or GiGPO step rows, under a token budget.

A group (the G rollouts of one scenario under one policy version) is usable when at least two of its trajectories
are complete and not excluded by curation: GRPO's advantage compares a trajectory with its group, so a partial group
would bias it, and a group of one has no baseline. Groups are taken whole, in a seeded random order, until the next
one would exceed the token budget (prompt + response ids of every chosen step row).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

BATCH_ALGORITHMS = ("grpo", "gigpo")
"""grpo: whole trajectories (every step row of each usable trajectory). gigpo: the step rows of usable
trajectories, minus excluded steps; GiGPO's step-level groups form from their ``anchor`` column downstream."""

REQUIRED_COLUMNS = ("trajectory_id", "group_id", "step_index", "prompt_ids", "response_ids", "status")


@dataclass
class Batch:
    rows: pd.DataFrame
    """The chosen step rows (the input's columns), ordered by group, trajectory, step index."""
    summary: dict[str, Any]
    """algorithm, token_budget, groups, trajectories, steps, tokens, and ``dropped``: excluded_trajectories,
    excluded_steps, incomplete_trajectories, small_groups, over_budget_groups."""


def _excluded(frame: pd.DataFrame) -> pd.Series:
    if "excluded" not in frame.columns:
        return pd.Series(False, index=frame.index)
    return frame["excluded"].fillna(False).astype(bool)


def build_batch(frame: pd.DataFrame, *, algorithm: str, token_budget: int, seed: int = 0) -> Batch:
    """Choose whole usable groups of ``frame`` (``DataPool.steps_frame`` or ``read_steps``) for ``algorithm``
    until the next group would exceed ``token_budget`` tokens; see the module docstring.

    A trajectory is dropped when its status is not "complete" (incomplete) or, for grpo, when any of its rows is
    excluded (for gigpo only the excluded step rows go, and the trajectory when all of them do).
    """
    if algorithm not in BATCH_ALGORITHMS:
        raise ValueError(f"field 'algorithm' is {algorithm!r}; valid algorithms: {', '.join(BATCH_ALGORITHMS)}")
    if isinstance(token_budget, bool) or not isinstance(token_budget, (int, np.integer)) or token_budget < 1:
        raise ValueError(f"field 'token_budget' must be an int >= 1, got {token_budget!r}")
    missing = [name for name in REQUIRED_COLUMNS if name not in frame.columns]
    if missing:
        raise ValueError(f"build_batch: the step table lacks columns {missing}; pass a frame from "
                         f"DataPool.steps_frame or datapool.parquet.read_steps")

    excluded = _excluded(frame)
    excluded_trajs = set(frame.loc[excluded, "trajectory_id"])
    complete = frame.groupby("trajectory_id")["status"].transform(lambda s: (s == "complete").all())
    incomplete_trajs = set(frame.loc[~complete.astype(bool), "trajectory_id"])
    keep = complete.astype(bool)
    if algorithm == "grpo":
        keep &= ~frame["trajectory_id"].isin(excluded_trajs)
        dropped_steps = 0
    else:
        dropped_steps = int((keep & excluded).sum())
        keep &= ~excluded
    candidates = frame.loc[keep]

    per_group = candidates.groupby("group_id")["trajectory_id"].nunique()
    usable = sorted(per_group[per_group >= 2].index)
    small_groups = int(frame["group_id"].nunique() - len(usable))
    tokens = (candidates["prompt_ids"].map(len) + candidates["response_ids"].map(len)).groupby(
        candidates["group_id"]).sum()

    order = np.random.default_rng(seed).permutation(len(usable))
    chosen: list[str] = []
    total = 0
    for position in order:
        group = usable[position]
        if total + int(tokens[group]) > token_budget:
            break
        chosen.append(group)
        total += int(tokens[group])

    rows = candidates[candidates["group_id"].isin(chosen)].sort_values(
        ["group_id", "trajectory_id", "step_index"]).reset_index(drop=True)
    all_excluded = excluded_trajs - set(candidates["trajectory_id"]) if algorithm == "gigpo" else excluded_trajs
    summary = {
        "algorithm": algorithm, "token_budget": int(token_budget), "seed": seed,
        "groups": len(chosen), "trajectories": int(rows["trajectory_id"].nunique()), "steps": len(rows),
        "tokens": total,
        "dropped": {
            "excluded_trajectories": len(all_excluded - incomplete_trajs),
            "excluded_steps": dropped_steps,
            "incomplete_trajectories": len(incomplete_trajs),
            "small_groups": small_groups,
            "over_budget_groups": len(usable) - len(chosen),
        },
    }
    return Batch(rows=rows, summary=summary)
