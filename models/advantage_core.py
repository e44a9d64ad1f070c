"""Shared pieces of every advantage estimator: the batch record StepBatch, the result AdvantageResult, the ADVANTAGES
registry (declared torch-free in models/config.py), and the helpers that keep the conventions of models/advantages.py
identical across estimators (row layout and its checks, invalid-action penalty, float64 group statistics, result dtype
and metrics).

The estimators themselves live in models/outcome_advantages.py and models/step_advantages.py; import
models.advantages (the config, and the module that imports every estimator) to get the full registry.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, NamedTuple

import torch
from torch import Tensor

from models.config import ADVANTAGES, GRPO_EPS  # noqa: F401 - re-exported to the estimator modules

if TYPE_CHECKING:  # for annotations only: models.advantages imports this module
    from models.advantages import AdvantageConfig


# ---------------------------------------------------------------------------------------------------------------
# Batch record, result
# ---------------------------------------------------------------------------------------------------------------

class StepBatch(NamedTuple):
    """One row per step (step-row layout) or per trajectory (concatenated layout: one row, step_index 0)."""
    rewards: Tensor
    """[R] float, the env reward of the row's step (invalid-action penalty already included by the env)."""
    traj_index: Tensor
    """[R] long, trajectory of each row."""
    group_index: Tensor
    """[R] long, scenario group of each row (the G rollouts of one scenario, one policy version)."""
    step_index: Tensor
    """[R] long, turn number within the trajectory (unique within a trajectory)."""
    anchors: tuple[str, ...]
    """R canonical env states (the state the row's action was taken in)."""
    won: Tensor
    """[R] bool, the row's trajectory succeeded (the same on all its rows)."""
    action_valid: Tensor
    """[R] bool."""
    response_mask: Tensor
    """[R, L] float, 1 on the row's generated tokens."""
    turn_rewards: Tensor | None = None
    """[R] optional per-turn process rewards (turn_level); None = rewards."""


class AdvantageResult(NamedTuple):
    token_advantages: Tensor
    """[R, L], exactly 0 where response_mask is 0."""
    row_advantages: Tensor
    """[R] the row's advantage; for token-level estimators (reinforce_pp*) the mean over the row's valid tokens
    (0 for a row without one)."""
    metrics: dict[str, float]
    """advantage_mean / advantage_std (population) over valid tokens; gigpo/graphgpo add anchor_group_share (share
    of rows in anchor groups of two or more) and anchor_groups (number of anchor groups, singletons included);
    graphgpo adds graph_solved_group_share (share of scenario groups with a success)."""


def broadcast_rows(row_values: Tensor, response_mask: Tensor) -> Tensor:
    """[R] row values -> [R, L]: the row's value on its generated tokens, exactly 0 elsewhere (never NaN)."""
    if row_values.ndim != 1 or response_mask.ndim != 2 or response_mask.shape[0] != row_values.shape[0]:
        raise ValueError(f"need row_values [R] and response_mask [R, L], got {tuple(row_values.shape)} and "
                         f"{tuple(response_mask.shape)}")
    values = row_values[:, None].expand(response_mask.shape)                # [R, L]
    return torch.where(response_mask != 0, values, torch.zeros_like(values))  # [R, L]


# ---------------------------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------------------------

class _Layout(NamedTuple):
    traj: Tensor        # [R] dense trajectory id 0..T-1
    order: Tensor       # [R] row ids sorted by (trajectory, step)
    rank: Tensor        # [R] position of the row within its trajectory (0 = first step)
    next_row: Tensor    # [R] the trajectory's next row, -1 on its last row
    traj_first: Tensor  # [T] position in `order` of the trajectory's first row
    traj_group: Tensor  # [T] scenario group of each trajectory
    traj_won: Tensor    # [T] bool


def _check_batch(batch: StepBatch) -> None:
    rows = batch.rewards.shape[0] if batch.rewards.ndim == 1 else -1
    bad = [name for name in ("rewards", "traj_index", "group_index", "step_index", "won", "action_valid")
           if tuple(getattr(batch, name).shape) != (rows,)]
    if batch.turn_rewards is not None and tuple(batch.turn_rewards.shape) != (rows,):
        bad.append("turn_rewards")
    if len(batch.anchors) != rows:
        bad.append("anchors")
    if batch.response_mask.ndim != 2 or batch.response_mask.shape[0] != rows:
        bad.append("response_mask")
    if bad:
        raise ValueError(f"StepBatch fields {bad} do not match rewards [R={rows}] (response_mask must be [R, L]); "
                         "build the batch with one entry per row")


def _constant_per_traj(values: Tensor, traj: Tensor, num_traj: int, what: str) -> Tensor:
    """[R] -> [T] value of each trajectory; raises if its rows disagree."""
    values = values.long()                                                  # [R]
    high = torch.full((num_traj,), torch.iinfo(torch.long).min).scatter_reduce_(0, traj, values, "amax")  # [T]
    low = torch.full((num_traj,), torch.iinfo(torch.long).max).scatter_reduce_(0, traj, values, "amin")   # [T]
    if not torch.equal(high, low):
        raise ValueError(f"rows of one trajectory disagree on {what}; every row of a trajectory must carry the same")
    return high


def _layout(batch: StepBatch) -> _Layout:
    _check_batch(batch)
    rows = batch.rewards.shape[0]
    _, traj = torch.unique(batch.traj_index, return_inverse=True)           # [R]
    num_traj = int(traj.max()) + 1 if rows else 0
    order = torch.argsort(batch.step_index, stable=True)                    # [R]
    order = order[torch.argsort(traj[order], stable=True)]                  # [R] by trajectory, then step
    sorted_traj, sorted_step = traj[order], batch.step_index[order]         # [R] each
    same_traj = sorted_traj[1:] == sorted_traj[:-1]
    if (same_traj & (sorted_step[1:] == sorted_step[:-1])).any():
        raise ValueError("a trajectory has two rows with the same step_index; step rows must be unique per step")
    position = torch.arange(rows)                                           # [R]
    traj_first = torch.full((num_traj,), rows).scatter_reduce_(0, sorted_traj, position, "amin")  # [T]
    rank, next_row = torch.empty_like(position), torch.full((rows,), -1)    # [R] each
    rank[order] = position - traj_first[sorted_traj]
    next_row[order[:-1]] = torch.where(same_traj, order[1:], -1)
    return _Layout(traj, order, rank, next_row, traj_first,
                   _constant_per_traj(batch.group_index, traj, num_traj, "group_index"),
                   _constant_per_traj(batch.won, traj, num_traj, "won").bool())


def _penalty(batch: StepBatch, cfg: AdvantageConfig) -> Tensor:
    """[R] cfg.invalid_penalty on rows whose action was invalid, else 0 (float64)."""
    return cfg.invalid_penalty * (~batch.action_valid.bool()).double()     # [R]


def _penalized(values: Tensor, batch: StepBatch, cfg: AdvantageConfig) -> Tensor:
    """[R] values in float64 minus the invalid-action penalty."""
    return values.to(torch.float64) - _penalty(batch, cfg)                 # [R]


def _ranks_last_first(lay: _Layout) -> Iterator[Tensor]:
    """Row ids of each step rank, the last rank first: the order of a backward pass along all trajectories."""
    for k in range(int(lay.rank.max()) if len(lay.rank) else -1, -1, -1):
        yield torch.nonzero(lay.rank == k).squeeze(1)                       # [r_k]



def _group_stats(scores: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-element group size, centered value v_i - mean_g and unbiased group std, each [N], in float64.

    The centered value of a group whose values are all equal is exactly 0 (a float mean need not equal the value).
    """
    scores = scores.to(torch.float64)                                       # [N]
    _, inverse = torch.unique(group_index, return_inverse=True)             # [N] dense group ids 0..G-1
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, inverse, torch.ones_like(scores))  # [G]
    total = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, inverse, scores)                   # [G]
    high = torch.full((num_groups,), -torch.inf, dtype=scores.dtype).scatter_reduce_(0, inverse, scores, "amax")
    low = torch.full((num_groups,), torch.inf, dtype=scores.dtype).scatter_reduce_(0, inverse, scores, "amin")
    mean = total / count                                                    # [G]
    centered = scores - mean[inverse]                                       # [N]
    centered = torch.where((high == low)[inverse], torch.zeros_like(centered), centered)                # [N]
    sq = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, inverse, centered * centered)         # [G]
    std = torch.sqrt(sq / (count - 1).clamp_min(1))                         # [G] unbiased (n-1)
    return count[inverse], centered, std[inverse]                           # each [N]


def _out_dtype(values: Tensor) -> torch.dtype:
    return values.dtype if values.is_floating_point() else torch.get_default_dtype()


def _result(tokens: Tensor, rows: Tensor, batch: StepBatch, extra: dict[str, float] | None = None) -> AdvantageResult:
    dtype = _out_dtype(batch.rewards)
    valid = tokens[batch.response_mask != 0]                                # [n]
    metrics = {"advantage_mean": float(valid.mean()) if len(valid) else 0.0,
               "advantage_std": float(valid.std(correction=0)) if len(valid) else 0.0, **(extra or {})}
    return AdvantageResult(tokens.to(dtype), rows.to(dtype), metrics)


def _row_result(rows: Tensor, batch: StepBatch, extra: dict[str, float] | None = None) -> AdvantageResult:
    return _result(broadcast_rows(rows, batch.response_mask), rows, batch, extra)


