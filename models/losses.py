"""Policy losses (ALGORITHMS.md §2) and the supervised loss used by warm-start.

Every loss registered in LOSSES has the signature
`fn(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip, aggregation) -> (loss, metrics)`
over [B, L] tensors that are already aligned (position t holds the log-prob of the token the policy produced there)
and with the per-trajectory advantage already broadcast to the generated tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from models.registry import Registry

LOSSES = Registry("loss")

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOG_RATIO_CLAMP = 20.0


def masked_token_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over the positions where mask is 1; 0 (still a graph node) when there are none.

    Masked positions get exactly zero gradient, even where x is not finite.
    """
    valid = mask.bool()                                                     # [B, L]
    total = torch.where(valid, x, torch.zeros_like(x)).sum()                # []
    return total / valid.sum().clamp_min(1)


def aggregate(loss_mat: Tensor, mask: Tensor, aggregation: str) -> Tensor:
    """Reduces a [B, L] per-token loss to a scalar.

    token-mean:              sum over valid tokens / number of valid tokens.
    seq-mean-token-sum:      mean over sequences of the sum over their tokens.
    seq-mean-token-mean:     mean over sequences of the mean over their tokens.
    seq-mean-token-sum-norm: mean over sequences of (sum over their tokens / L), L a constant (Dr. GRPO), so a
                             token's weight does not depend on its sequence's length.
    The seq-mean modes skip sequences with no valid token.
    """
    valid = mask.bool()                                                     # [B, L]
    if aggregation == "token-mean":
        return masked_token_mean(loss_mat, valid)
    token_sum = torch.where(valid, loss_mat, torch.zeros_like(loss_mat)).sum(dim=-1)  # [B]
    token_count = valid.sum(dim=-1)                                         # [B]
    has_tokens = token_count > 0                                            # [B]
    if aggregation == "seq-mean-token-sum":
        per_seq = token_sum                                                 # [B]
    elif aggregation == "seq-mean-token-mean":
        per_seq = token_sum / token_count.clamp_min(1)                      # [B]
    elif aggregation == "seq-mean-token-sum-norm":
        per_seq = token_sum / loss_mat.shape[-1]                            # [B]
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}; valid: {', '.join(AGGREGATIONS)}")
    return masked_token_mean(per_seq, has_tokens)                           # []


@LOSSES.register("ppo_clip")
def ppo_clip(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with asymmetric (clip-higher) bounds and optional dual clip.

    rho = exp(clamp(logp - old_logp, -20, 20));
    l = max(-A * rho, -A * clip(rho, 1 - clip_low, 1 + clip_high));
    dual clip (A < 0 only, c = dual_clip): l = min(l, -A * c).

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347; clip-higher from Yu et al.
    2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv:2503.14476; dual clip from Ye et al.
    2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning", arXiv:1912.09729.

    Args: logp, old_logp, advantages, mask: [B, L]. Returns the aggregated loss and metrics (clip_fraction: share of
    valid tokens where the clipped term is the larger; approx_kl: token mean of 0.5 * (logp - old_logp)^2;
    ratio_mean; dual_clip_fraction when dual_clip is set).
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1.0 (the usual value is 3.0), got {dual_clip}")
    valid = mask.bool()                                                     # [B, L]
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, L]
    ratio = torch.exp(log_ratio)                                            # [B, L]
    unclipped = -advantages * ratio                                         # [B, L]
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)    # [B, L]
    loss_mat = torch.maximum(unclipped, clipped)                            # [B, L]
    metrics_masks = {"clip_fraction": clipped > unclipped}
    if dual_clip is not None:
        bound = -advantages * dual_clip                                     # [B, L]
        dual_active = (advantages < 0) & (loss_mat > bound)                 # [B, L]
        loss_mat = torch.where(dual_active, bound, loss_mat)                # [B, L]
        metrics_masks["dual_clip_fraction"] = dual_active
    loss = aggregate(loss_mat, valid, aggregation)                          # []

    with torch.no_grad():
        metrics = {name: float(masked_token_mean(m.float(), valid)) for name, m in metrics_masks.items()}
        diff = (logp - old_logp).detach()                                   # [B, L]
        metrics["approx_kl"] = float(masked_token_mean(0.5 * diff * diff, valid))
        metrics["ratio_mean"] = float(masked_token_mean(ratio.detach(), valid))
    return loss, metrics


def sft_loss(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Token-mean cross-entropy over the positions where mask is 1.

    logits [B, L, V] are aligned with labels [B, L]: logits[b, t] scores labels[b, t] (the caller shifts).
    Labels at masked positions may hold anything (padding ids included).
    """
    valid = mask.bool()                                                     # [B, L]
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels))      # [B, L]
    token_ce = F.cross_entropy(logits.float().transpose(1, 2), safe_labels, reduction="none")  # [B, L]
    return masked_token_mean(token_ce, valid)
