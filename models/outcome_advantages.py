"""Outcome advantage estimators (docs/algorithms.md §1): every row of a trajectory gets the trajectory's advantage.

The per-trajectory outcome functions `grpo_scores`, `dr_grpo_scores`, `rloo_scores` (`fn(scores[N],
group_index[N]) -> [N]`) are the low-level pieces the batch estimators build on. Registered in ADVANTAGES: grpo,
dr_grpo, rloo (one advantage per trajectory, on all its tokens) and reinforce_pp, reinforce_pp_baseline (per-token
returns, whitened over the batch). Contract and conventions: models/advantages.py.
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from models.advantage_core import (
    ADVANTAGES, GRPO_EPS, AdvantageResult, StepBatch, _group_stats, _layout, _out_dtype, _penalized, _ranks_last_first,
    _result, _row_result, broadcast_rows,
)

if TYPE_CHECKING:  # for annotations only: models.advantages imports this module
    from models.advantages import AdvantageConfig

WHITEN_EPS = 1e-8


# ---------------------------------------------------------------------------------------------------------------
# Per-trajectory outcome functions (docs/algorithms.md §1)
# ---------------------------------------------------------------------------------------------------------------

def _check(scores: Tensor, group_index: Tensor) -> None:
    if scores.ndim != 1 or group_index.shape != scores.shape:
        raise ValueError(
            f"scores and group_index must be 1-D of equal length, got {tuple(scores.shape)} and "
            f"{tuple(group_index.shape)}"
        )


def grpo_scores(scores: Tensor, group_index: Tensor, eps: float = GRPO_EPS) -> Tensor:
    """GRPO: A_i = (s_i - mean_g) / (std_g + eps), std unbiased; [N] scores -> [N] advantages.

    Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
    arXiv:2402.03300. A group of one uses mean 0 and std 1 (A = s); an all-equal group gives exactly 0.
    """
    _check(scores, group_index)
    count, centered, std = _group_stats(scores, group_index)               # [N] each
    singleton = count == 1                                                  # [N]
    centered = torch.where(singleton, scores.to(torch.float64), centered)  # [N] singleton: mean 0
    std = torch.where(singleton, torch.ones_like(std), std)                 # [N] singleton: std 1
    return (centered / (std + eps)).to(_out_dtype(scores))                 # [N]


def dr_grpo_scores(scores: Tensor, group_index: Tensor) -> Tensor:
    """Dr. GRPO: A_i = s_i - mean_g (no std normalization); [N] -> [N].

    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", arXiv:2503.20783.
    A group of one uses mean 0 (A = s), as GRPO does.
    """
    _check(scores, group_index)
    count, centered, _ = _group_stats(scores, group_index)                 # [N] each
    advantages = torch.where(count == 1, scores.to(torch.float64), centered)  # [N] singleton: mean 0
    return advantages.to(_out_dtype(scores))


def rloo_scores(scores: Tensor, group_index: Tensor) -> Tensor:
    """RLOO: A_i = n/(n-1) * (s_i - mean_g) = s_i - mean of the other n-1 rollouts; n = 1 gives A = s; [N] -> [N].

    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
    Feedback in LLMs", arXiv:2402.14740 (after Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!").
    """
    _check(scores, group_index)
    count, centered, _ = _group_stats(scores, group_index)                 # [N] each
    scaled = count / (count - 1).clamp_min(1) * centered                    # [N]
    return torch.where(count == 1, scores.to(torch.float64), scaled).to(_out_dtype(scores))  # [N]


# ---------------------------------------------------------------------------------------------------------------
# Estimators (reinforce_pp* whiten token returns over the batch)
# ---------------------------------------------------------------------------------------------------------------

def _masked_whiten(values: Tensor, valid: Tensor) -> Tensor:
    """(v - mean) / sqrt(var + 1e-8) over the valid entries of the whole batch, var unbiased; 0 elsewhere."""
    picked = values[valid]                                                  # [n]
    out = torch.zeros_like(values)                                          # [R, L]
    if len(picked) < 2 or bool(picked.max() == picked.min()):
        return out                                                          # no spread: exactly 0
    centered = picked - picked.mean()                                       # [n]
    out[valid] = centered / torch.sqrt(centered.square().sum() / (len(picked) - 1) + WHITEN_EPS)
    return out


def _token_result(tokens: Tensor, batch: StepBatch) -> AdvantageResult:
    valid = batch.response_mask != 0                                        # [R, L]
    rows = tokens.sum(dim=1) / valid.sum(dim=1).clamp_min(1)                # [R] mean over valid tokens
    return _result(tokens, rows, batch)


def _outcome(batch: StepBatch, cfg: AdvantageConfig, scores_fn: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """[R] trajectory advantage of each row from s_i = sum of the trajectory's (penalized) row rewards."""
    lay = _layout(batch)
    rewards = _penalized(batch.rewards, batch, cfg)                         # [R]
    scores = torch.zeros(len(lay.traj_group), dtype=torch.float64).index_add_(0, lay.traj, rewards)  # [T]
    return scores_fn(scores, lay.traj_group)[lay.traj]                      # [R]


@ADVANTAGES.register("grpo")
def compute_grpo_advantages(batch: StepBatch, cfg: AdvantageConfig) -> AdvantageResult:
    """GRPO (Shao et al. 2024, arXiv:2402.03300) on s_i = sum of the trajectory's rewards, on all its tokens."""
    return _row_result(_outcome(batch, cfg, partial(grpo_scores, eps=cfg.eps)), batch)


@ADVANTAGES.register("dr_grpo")
def compute_dr_grpo_advantages(batch: StepBatch, cfg: AdvantageConfig) -> AdvantageResult:
    """Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): s_i - mean_g, broadcast to the trajectory's tokens."""
    return _row_result(_outcome(batch, cfg, dr_grpo_scores), batch)


@ADVANTAGES.register("rloo")
def compute_rloo_advantages(batch: StepBatch, cfg: AdvantageConfig) -> AdvantageResult:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): s_i - mean of the others, on the trajectory's tokens."""
    return _row_result(_outcome(batch, cfg, rloo_scores), batch)


@ADVANTAGES.register("reinforce_pp")
def compute_reinforce_pp_advantages(batch: StepBatch, cfg: AdvantageConfig) -> AdvantageResult:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
    arXiv:2501.03262): token returns G_t = r_t + token_gamma * G_{t+1}, then whitened over the batch's valid tokens.

    The generated tokens of a trajectory form one chain: its rows in step order, each row's valid tokens in order
    (masked tokens are skipped, neither discounted nor a reset); the chain ends with the trajectory. A row's reward
    sits on its last valid token; a row without valid tokens hands its reward to the last valid token before it in
    the trajectory (dropped if there is none), so with token_gamma = 1 the first token's return is the episode score.
    Whitening as verl's masked_whiten: (G - mean) / sqrt(var_unbiased + 1e-8).
    """
    lay = _layout(batch)
    valid = batch.response_mask != 0                                        # [R, L]
    count = valid.sum(dim=1)                                                # [R] valid tokens per row
    rewards = _penalized(batch.rewards, batch, cfg)                         # [R]
    rows, gamma = len(rewards), cfg.token_gamma
    # each row's reward goes to the latest row at or before it (in its trajectory) that has a valid token
    position = torch.arange(rows)                                           # [R] positions in lay.order
    holder = torch.cummax(torch.where(count[lay.order] > 0, position, -1), 0).values  # [R] in lay.order
    kept = holder >= lay.traj_first[lay.traj[lay.order]]                    # [R] holder is in the same trajectory
    row_reward = torch.zeros(rows, dtype=torch.float64).index_add_(
        0, lay.order[holder[kept]], rewards[lay.order][kept])               # [R]
    # G at a row's last token = its reward + gamma * G at the first token of the next row that has tokens
    last_return = torch.zeros(rows, dtype=torch.float64)                    # [R]
    carry = torch.zeros(rows, dtype=torch.float64)                          # [R] G entering the row from the right
    for at in _ranks_last_first(lay):
        nxt = lay.next_row[at]                                              # [r_k]
        after = torch.where(nxt >= 0, carry[nxt.clamp_min(0)], 0.0)         # [r_k]
        has_tokens = count[at] > 0                                          # [r_k]
        last_return[at] = torch.where(has_tokens, row_reward[at] + gamma * after, 0.0)  # [r_k]
        first_return = gamma ** (count[at] - 1).clamp_min(0).double() * last_return[at]  # [r_k]
        carry[at] = torch.where(has_tokens, first_return, after)            # [r_k]
    tokens_after = count[:, None] - torch.cumsum(valid.long(), dim=1)       # [R, L] valid tokens after each one
    returns = gamma ** tokens_after.clamp_min(0).double() * last_return[:, None]  # [R, L]
    returns = torch.where(valid, returns, torch.zeros_like(returns))        # [R, L]
    return _token_result(_masked_whiten(returns, valid), batch)


@ADVANTAGES.register("reinforce_pp_baseline")
def compute_reinforce_pp_baseline_advantages(batch: StepBatch, cfg: AdvantageConfig) -> AdvantageResult:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262; as verl): (s_i - mean_g) on the trajectory's tokens (a group
    of one keeps s_i), then whitened over the batch's valid tokens as reinforce_pp."""
    valid = batch.response_mask != 0                                        # [R, L]
    centered = broadcast_rows(_outcome(batch, cfg, dr_grpo_scores), batch.response_mask)  # [R, L]
    return _token_result(_masked_whiten(centered, valid), batch)

