"""Outcome advantage estimators (ALGORITHMS.md §1): per-trajectory advantages from per-trajectory scores and groups.

Every estimator has the signature `fn(scores: Tensor[N], group_index: LongTensor[N]) -> Tensor[N]`, where
`group_index[i]` names the group (the G rollouts of one scenario under one policy version) of trajectory i. Group
indices need not be contiguous or sorted. The result is broadcast to the trajectory's generated tokens by the caller.
"""
from __future__ import annotations

import torch
from torch import Tensor

from models.registry import Registry

ADVANTAGES = Registry("advantage")

GRPO_EPS = 1e-6


def _group_stats(scores: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-trajectory group size, centered score s_i - mean_g and unbiased group std, each [N], in float64.

    The centered score of a group whose scores are all equal is exactly 0 (a float mean need not equal the value).
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


def _out_dtype(scores: Tensor) -> torch.dtype:
    return scores.dtype if scores.is_floating_point() else torch.get_default_dtype()


def _check(scores: Tensor, group_index: Tensor) -> None:
    if scores.ndim != 1 or group_index.shape != scores.shape:
        raise ValueError(
            f"scores and group_index must be 1-D of equal length, got {tuple(scores.shape)} and "
            f"{tuple(group_index.shape)}"
        )


@ADVANTAGES.register("grpo")
def grpo(scores: Tensor, group_index: Tensor) -> Tensor:
    """GRPO: A_i = (s_i - mean_g) / (std_g + 1e-6), std unbiased.

    Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
    arXiv:2402.03300. A group of one uses mean 0 and std 1 (A = s); an all-equal group gives exactly 0.
    """
    _check(scores, group_index)
    count, centered, std = _group_stats(scores, group_index)               # [N] each
    singleton = count == 1                                                  # [N]
    centered = torch.where(singleton, scores.to(torch.float64), centered)  # [N] singleton: mean 0
    std = torch.where(singleton, torch.ones_like(std), std)                 # [N] singleton: std 1
    return (centered / (std + GRPO_EPS)).to(_out_dtype(scores))            # [N]


@ADVANTAGES.register("dr_grpo")
def dr_grpo(scores: Tensor, group_index: Tensor) -> Tensor:
    """Dr. GRPO: A_i = s_i - mean_g (no std normalization).

    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", arXiv:2503.20783.
    A group of one uses mean 0 (A = s), as GRPO does.
    """
    _check(scores, group_index)
    count, centered, _ = _group_stats(scores, group_index)                 # [N] each
    advantages = torch.where(count == 1, scores.to(torch.float64), centered)  # [N] singleton: mean 0
    return advantages.to(_out_dtype(scores))


@ADVANTAGES.register("rloo")
def rloo(scores: Tensor, group_index: Tensor) -> Tensor:
    """RLOO: A_i = n/(n-1) * (s_i - mean_g) = s_i - mean of the other n-1 rollouts; n = 1 gives A = s.

    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
    Feedback in LLMs", arXiv:2402.14740 (after Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!").
    """
    _check(scores, group_index)
    count, centered, _ = _group_stats(scores, group_index)                 # [N] each
    scaled = count / (count - 1).clamp_min(1) * centered                    # [N]
    return torch.where(count == 1, scores.to(torch.float64), scaled).to(_out_dtype(scores))  # [N]
