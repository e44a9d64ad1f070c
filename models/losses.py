"""Policy losses (docs/algorithms.md §2), the KL and entropy terms, and the supervised loss used by warm-start.

Every loss registered in LOSSES has the signature
`fn(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip, aggregation, token_weights=None)
-> (loss, metrics)` over [B, L] tensors that are already aligned (position t holds the log-prob of the token the
policy produced there) and with the per-trajectory advantage already broadcast to the generated tokens.
token_weights [B, L] (detached), when given, multiplies the per-token loss before aggregation: the truncated
importance weights of stale rows (`truncated_is_weights`, docs/algorithms.md §2.7). It is passed only when some row
is stale, so a loss without the argument still trains on-policy batches.

`policy_objective` is what a trainer calls: the registered policy loss + beta * KL(policy || reference)
- entropy_coef * entropy, with every term logged separately; `LossConfig` (params.yaml ``train.loss``) selects it.

KL metrics are named by their estimator (Schulman 2020, "Approximating KL Divergence"), with r = pi / pi_old the
token ratio: ``approx_kl_k2`` = mean 0.5 (log r)^2 and ``approx_kl_k3`` = mean (r - 1) - log r (CleanRL's
``approx_kl``) between the policy and the rollout's old policy; ``kl_ref_<kind>`` is the penalty estimate to the
reference policy (``kl_kind``), the term ``kl_beta`` weighs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from models.config import AGGREGATIONS, KL_KINDS, LOSSES, LossConfig

LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0
NO_STALE_WEIGHT_METRICS = {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_weight_truncated_fraction": 0.0}
"""`truncated_is_weights`' metrics when no token is stale: every weight is then exactly 1."""


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


def _old_policy_kl(log_ratio: Tensor, valid: Tensor) -> dict[str, float]:
    """approx_kl_k2 = mean 0.5 (log r)^2 and approx_kl_k3 = mean (r - 1) - log r over the valid tokens, with
    log r = logp - old_logp (clamped to +-20 for the exponential). Both estimate KL(old || new) >= 0."""
    log_ratio = log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, L]
    k3 = torch.expm1(log_ratio) - log_ratio                                 # [B, L] (r - 1) - log r
    return {"approx_kl_k2": float(masked_token_mean(0.5 * log_ratio * log_ratio, valid)),
            "approx_kl_k3": float(masked_token_mean(k3, valid))}


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
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with asymmetric (clip-higher) bounds and optional dual clip.

    rho = exp(clamp(logp - old_logp, -20, 20));
    l = max(-A * rho, -A * clip(rho, 1 - clip_low, 1 + clip_high));
    dual clip (A < 0 only, c = dual_clip): l = min(l, -A * c);
    token_weights w (decoupled PPO for stale rows, old_logp then being the proximal policy): l = w * l.

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347; clip-higher from Yu et al.
    2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv:2503.14476; dual clip from Ye et al.
    2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning", arXiv:1912.09729.

    Args: logp, old_logp, advantages, mask, token_weights (None = no weighting): [B, L]. Returns the aggregated loss
    and metrics (clip_fraction: share of valid tokens where the clipped term is the larger; approx_kl_k2: token mean
    of 0.5 * (log r)^2;
    approx_kl_k3: token mean of (r - 1) - log r, CleanRL's approx_kl;
    ratio_mean; dual_clip_fraction when dual_clip is set).
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1.0 (the usual value is 3.0), got {dual_clip}")
    valid = mask.bool()                                                     # [B, L]
    # zero the inputs at masked positions: garbage there (inf, nan) must not reach the gradient via 0 * nan
    advantages = torch.where(valid, advantages, torch.zeros_like(advantages))  # [B, L]
    log_ratio = torch.where(valid, logp - old_logp, torch.zeros_like(logp))  # [B, L]
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)          # [B, L]
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
    if token_weights is not None:
        loss_mat = loss_mat * token_weights.detach()                        # [B, L]
    loss = aggregate(loss_mat, valid, aggregation)                          # []

    with torch.no_grad():
        metrics = {name: float(masked_token_mean(m.float(), valid)) for name, m in metrics_masks.items()}
        diff = torch.where(valid, logp - old_logp, torch.zeros_like(logp)).detach()  # [B, L]
        metrics.update(_old_policy_kl(diff, valid))
        metrics["ratio_mean"] = float(masked_token_mean(ratio.detach(), valid))
    return loss, metrics


@LOSSES.register("vanilla_pg")
def vanilla_pg(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    aggregation: str = "token-mean",
    token_weights: Tensor | None = None,
    **ignored: object,
) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE: l = -A * logp (times token_weights w when given: l = -w * A * logp), no ratio and no clip
    (clip_low / clip_high / dual_clip are accepted and ignored).

    Williams 1992, "Simple Statistical Gradient-Following Algorithms for Connectionist Reinforcement Learning",
    Machine Learning 8:229-256. The gradient is unbiased only on-policy: use it with one epoch of one mini-batch
    per rollout batch; later steps on the same rows are not corrected for the policy having moved.

    Args: logp, old_logp, advantages, mask, token_weights (None = no weighting): [B, L]. Metrics as ppo_clip's
    (clip_fraction is 0: nothing is clipped), so dashboards compare the two.
    """
    valid = mask.bool()                                                     # [B, L]
    advantages = torch.where(valid, advantages, torch.zeros_like(advantages))  # [B, L] no nan leaks via 0 * nan
    loss_mat = -advantages * logp                                           # [B, L]
    if token_weights is not None:
        loss_mat = loss_mat * token_weights.detach()                        # [B, L]
    loss = aggregate(loss_mat, valid, aggregation)                          # []
    with torch.no_grad():
        diff = torch.where(valid, logp - old_logp, torch.zeros_like(logp))  # [B, L]
        ratio = torch.exp(diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))    # [B, L]
        metrics = {
            "clip_fraction": 0.0,
            **_old_policy_kl(diff, valid),
            "ratio_mean": float(masked_token_mean(ratio, valid)),
        }
    return loss, metrics


def truncated_is_weights(prox_logp: Tensor, behaviour_logp: Tensor, stale_rows: Tensor, mask: Tensor, cap: float
                         ) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance weights of the decoupled PPO objective (docs/algorithms.md §2.7), detached:

    w[b, t] = min(exp(clamp(prox_logp - behaviour_logp, -20, 20)), cap) at the valid tokens of the stale rows,
    exactly 1.0 everywhere else (on-policy rows, rows without rollout log-probs, masked positions).

    Hilton et al. 2021, "Batch size-invariance for policy optimization", arXiv:2110.00641 (decoupled PPO: the clip
    is taken w.r.t. the proximal policy, the behaviour policy is corrected by importance sampling); used for stale
    rollouts by Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language
    Reasoning", arXiv:2505.24298. The cap bounds the variance (truncated IS).

    Args: prox_logp (the proximal policy: the weights at the start of the update), behaviour_logp (the rollout's
    recorded log-probs), mask: [B, L]; stale_rows [B] bool: the rows to weight; cap >= 1. Returns (w [B, L], metrics
    over the valid tokens of the stale rows: is_weight_mean, is_weight_max and is_weight_truncated_fraction, the share
    of tokens whose untruncated weight exceeds the cap; 1.0, 1.0, 0.0 when there are none, every weight being 1).
    """
    with torch.no_grad():
        if not bool(stale_rows.any()):                                      # the usual case: no work per token
            return torch.ones_like(prox_logp), dict(NO_STALE_WEIGHT_METRICS)
        weighted = mask.bool() & stale_rows.to(mask.device).bool()[:, None]  # [B, L]
        log_ratio = torch.where(weighted, prox_logp - behaviour_logp, torch.zeros_like(prox_logp))  # [B, L]
        raw = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, L]
        weights = torch.where(weighted, raw.clamp_max(cap), torch.ones_like(raw))  # [B, L]
        if not bool(weighted.any()):
            return weights, dict(NO_STALE_WEIGHT_METRICS)
        metrics = {
            "is_weight_mean": float(masked_token_mean(weights, weighted)),
            "is_weight_max": float(weights[weighted].max()),
            "is_weight_truncated_fraction": float(masked_token_mean((raw > cap).float(), weighted)),
        }
    return weights, metrics


def kl_penalty(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    kind: str = "k3",
    aggregation: str = "token-mean",
) -> Tensor:
    """Sample estimate of KL(policy || reference) on the sampled tokens, aggregated like the policy loss.

    k1 = logp - ref_logp; k2 = 0.5 * (logp - ref_logp)^2;
    k3 = exp(d) - d - 1 with d = clamp(ref_logp - logp, -20, 20), clamped to [-10, 10] (low variance, always >= 0).
    Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html; used as a loss term in
    Shao et al. 2024, "DeepSeekMath" (GRPO), arXiv:2402.03300.

    Args: logp (differentiable), ref_logp, mask: [B, L]; values at masked positions never matter (not even inf/nan).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; valid: {', '.join(KL_KINDS)}")
    valid = mask.bool()                                                     # [B, L]
    diff = torch.where(valid, logp - ref_logp, torch.zeros_like(logp))     # [B, L] logp - ref_logp
    if kind == "k1":
        kl_mat = diff                                                       # [B, L]
    elif kind == "k2":
        kl_mat = 0.5 * diff * diff                                          # [B, L]
    else:
        d = (-diff).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)                # [B, L] ref_logp - logp
        kl_mat = (torch.exp(d) - d - 1.0).clamp(-K3_CLAMP, K3_CLAMP)        # [B, L]
    return aggregate(kl_mat, valid, aggregation)


def entropy_from_logits(logits: Tensor, mask: Tensor, aggregation: str = "token-mean") -> Tensor:
    """Policy entropy H = -sum_v p_v log p_v at the valid positions, aggregated; differentiable (entropy bonus).

    Only the valid positions' [N, V] softmax is materialized (in float32), not the whole [B, L, V].
    Args: logits [B, L, V] (position t predicts the token at t + 1, as in the collated batch), mask [B, L].
    """
    valid = mask.to(logits.device).bool()                                   # [B, L]
    picked = logits[valid].float()                                          # [N, V]
    logp = torch.log_softmax(picked, dim=-1)                                # [N, V]
    probs = logp.exp()                                                      # [N, V]
    # 0 * log 0 = 0 for tokens a -inf logit rules out (p * logp would be nan there, in value and gradient)
    safe_logp = torch.where(probs > 0, logp, torch.zeros_like(logp))        # [N, V]
    token_entropy = -(probs * safe_logp).sum(dim=-1)                        # [N]
    entropy_mat = torch.zeros(valid.shape, dtype=token_entropy.dtype, device=logits.device)
    entropy_mat = entropy_mat.masked_scatter(valid, token_entropy)          # [B, L]
    return aggregate(entropy_mat, valid, aggregation)


def policy_objective(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    *,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    behaviour_logp: Tensor | None = None,
    stale_rows: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """total = LOSSES[cfg.name] + kl_beta * kl_penalty(logp, ref_logp) - entropy_coef * entropy (docs/algorithms.md §2).

    The KL term uses the same mask and aggregation as the policy loss (GRPO's "KL in the loss", Shao et al. 2024,
    arXiv:2402.03300); the entropy bonus follows Schulman et al. 2017, arXiv:1707.06347 (eq. 9).
    Off-policy correction (§2.7): with behaviour_logp and stale_rows given, old_logp is the proximal policy and, under
    cfg.off_policy "decoupled", the policy loss of the stale rows' tokens is weighted by
    `truncated_is_weights(old_logp, behaviour_logp, stale_rows, mask, cfg.is_weight_cap)`. With no stale row the
    loss is called without weights: bit-identical to a call without these arguments.

    Args: logp, old_logp, advantages, mask, ref_logp, behaviour_logp: [B, L]; stale_rows [B] bool (rows sampled by an
    older policy that carry their rollout log-probs); entropy: the scalar from `entropy_from_logits` (computed
    by the caller, who holds the logits). ref_logp may be given with kl_beta 0 to log the KL only.
    Returns (total, metrics): the policy loss's own metrics plus pg_loss, kl_loss and kl_ref_<kl_kind> (the
    penalty's KL estimate, when ref_logp is given), entropy (when given), is_weight_mean / is_weight_max /
    is_weight_truncated_fraction (when behaviour_logp and stale_rows are given; logged under off_policy "none" too)
    and loss (the total).
    """
    if cfg.kl_beta != 0.0 and ref_logp is None:
        raise ValueError(f"kl_beta is {cfg.kl_beta} but no ref_logp was given: pass the reference policy's log-probs "
                         f"or set kl_beta to 0")
    if cfg.entropy_coef != 0.0 and entropy is None:
        raise ValueError(f"entropy_coef is {cfg.entropy_coef} but no entropy was given: pass "
                         f"entropy_from_logits(logits, mask, aggregation) or set entropy_coef to 0")
    weighting: dict[str, Tensor] = {}
    weight_metrics: dict[str, float] = {}
    if behaviour_logp is not None and stale_rows is not None:
        weights, weight_metrics = truncated_is_weights(old_logp, behaviour_logp, stale_rows, mask, cfg.is_weight_cap)
        if cfg.off_policy == "decoupled" and bool(stale_rows.any()):
            weighting["token_weights"] = weights                            # [B, L]
    pg_loss, metrics = LOSSES[cfg.name](
        logp, old_logp, advantages, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip or None, aggregation=cfg.aggregation, **weighting,
    )
    metrics.update(weight_metrics)
    total = pg_loss                                                         # []
    metrics["pg_loss"] = float(pg_loss.detach())
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, mask, kind=cfg.kl_kind, aggregation=cfg.aggregation)  # []
        metrics["kl_loss"] = float(kl.detach())
        metrics[f"kl_ref_{cfg.kl_kind}"] = metrics["kl_loss"]
        if cfg.kl_beta != 0.0:
            total = total + cfg.kl_beta * kl
    if entropy is not None:
        metrics["entropy"] = float(entropy.detach())
        if cfg.entropy_coef != 0.0:
            total = total - cfg.entropy_coef * entropy
    metrics["loss"] = float(total.detach())
    return total, metrics


def sft_loss(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Token-mean cross-entropy over the positions where mask is 1.

    logits [B, L, V] are aligned with labels [B, L]: logits[b, t] scores labels[b, t] (the caller shifts).
    Labels at masked positions may hold anything (padding ids included).
    """
    valid = mask.bool()                                                     # [B, L]
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels))      # [B, L]
    token_ce = F.cross_entropy(logits.float().transpose(1, 2), safe_labels, reduction="none")  # [B, L]
    return masked_token_mean(token_ce, valid)
