"""Auxiliary losses added to the policy loss (docs/algorithms.md §6): ECHO observation prediction and SEAL separation.

Every loss registered in AUX_LOSSES has the signature `fn(inputs: AuxInputs, cfg: AuxConfig) -> (loss, metrics)`.
The returned loss is already multiplied by its weight in `cfg` (the caller adds it to the policy loss as is); the
metrics hold the unweighted value, so runs with different weights compare.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from models.config import AUX_LOSSES, AuxConfig
from models.losses import aggregate, masked_token_mean


class AuxInputs(NamedTuple):
    """One micro-batch as the auxiliary losses see it; [B, L] tensors use the next-token alignment of collate_rows."""

    logits: Tensor            # [B, L, V] next-token logits aligned with target_ids
    target_ids: Tensor        # [B, L]
    observation_mask: Tensor  # [B, L] 1 where target_ids is an environment-observation token (concatenated layout)
    hidden: Tensor | None     # [B, L, H] last-layer hidden states (for seal), or None
    attention_mask: Tensor    # [B, L]
    success: Tensor           # [B] bool, trajectory succeeded
    group_index: Tensor       # [B] long


@AUX_LOSSES.register("echo")
def echo(inputs: AuxInputs, cfg: AuxConfig) -> tuple[Tensor, dict[str, float]]:
    """ECHO environment-prediction loss: cfg.echo_weight * L_env.

    L_env = mean over sequences that have observation tokens of (mean cross-entropy over their observation tokens),
    i.e. per-sequence length-normalized next-token prediction of what the environment said. Applied to every rollout,
    failed ones included; no ratio, no clip, no advantage. ECHO as specified in docs/algorithms.md §6 (the formula from the
    ECHO reference, the details ours); the world-model co-training variant (PaW) reuses it with other row selection.

    Only the observation positions' [N, V] logits are used, so gradient reaches those logits only.
    Returns (weighted loss, {"echo_loss": L_env, "echo_tokens": N}).
    """
    device = inputs.logits.device
    valid = (inputs.observation_mask.bool() & inputs.attention_mask.bool()).to(device)  # [B, L]
    picked_logits = inputs.logits[valid].float()                            # [N, V]
    picked_targets = inputs.target_ids.to(device)[valid]                    # [N]
    token_ce = F.cross_entropy(picked_logits, picked_targets, reduction="none")  # [N]
    ce_mat = torch.zeros(valid.shape, dtype=token_ce.dtype, device=device)
    ce_mat = ce_mat.masked_scatter(valid, token_ce)                         # [B, L]
    env_loss = aggregate(ce_mat, valid, "seq-mean-token-mean")              # []
    metrics = {"echo_loss": float(env_loss.detach()), "echo_tokens": float(valid.sum())}
    return cfg.echo_weight * env_loss, metrics


@AUX_LOSSES.register("seal")
def seal(inputs: AuxInputs, cfg: AuxConfig) -> tuple[Tensor, dict[str, float]]:
    """SEAL separation loss: cfg.seal_weight * mean over mixed groups of max(0, margin - (1 - cos(mu_succ, mu_fail))).

    Each sequence's last-layer hidden states are mean-pooled over its attention mask; within a group that has both
    successful and failed trajectories, mu_succ / mu_fail are the means of the pooled states of each outcome.
    Groups lacking one outcome contribute nothing; with no mixed group the loss is 0 (still connected to `hidden`,
    so a backward pass works). SEAL: separation of success and failure representations, docs/algorithms.md §6 (the
    formulation is ours; the source is an abstract).

    Returns (weighted loss, {"seal_loss": unweighted, "seal_groups": number of mixed groups, "seal_cosine": mean
    cosine similarity of the centroids over those groups, 0 when none}).
    """
    if inputs.hidden is None:
        raise ValueError("seal needs last-layer hidden states: run the model with output_hidden_states=True and "
                         "pass outputs.hidden_states[-1] as AuxInputs.hidden, or remove seal from the aux losses")
    hidden = inputs.hidden.float()                                          # [B, L, H]
    attn = inputs.attention_mask.to(hidden.device, hidden.dtype)            # [B, L]
    pooled = (hidden * attn[..., None]).sum(dim=1) / attn.sum(dim=1, keepdim=True).clamp_min(1.0)  # [B, H]

    _, group = torch.unique(inputs.group_index.to(hidden.device), return_inverse=True)  # [B] in 0..G-1
    n_groups = int(group.max()) + 1 if group.numel() else 0
    succeeded = inputs.success.to(hidden.device).bool()                    # [B]
    centroids = []
    counts = []
    for outcome in (succeeded, ~succeeded):
        sums = pooled.new_zeros(n_groups, pooled.shape[1]).index_add(0, group[outcome], pooled[outcome])  # [G, H]
        count = torch.bincount(group[outcome], minlength=n_groups)         # [G]
        centroids.append(sums / count.clamp_min(1)[:, None].to(sums.dtype))  # [G, H]
        counts.append(count)
    mixed = (counts[0] > 0) & (counts[1] > 0)                               # [G]
    cosine = F.cosine_similarity(centroids[0], centroids[1], dim=-1, eps=1e-8)  # [G]
    hinge = torch.relu(cfg.seal_margin - (1.0 - cosine))                    # [G]
    sep_loss = masked_token_mean(hinge, mixed)                              # []
    if n_groups == 0:
        sep_loss = hidden.sum() * 0.0                                       # [] empty batch: still a graph node
    metrics = {
        "seal_loss": float(sep_loss.detach()),
        "seal_groups": float(mixed.sum()),
        "seal_cosine": float(masked_token_mean(cosine.detach(), mixed)) if n_groups else 0.0,
    }
    return cfg.seal_weight * sep_loss, metrics
