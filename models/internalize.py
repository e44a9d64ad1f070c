"""Skill internalization (SIRI, docs/algorithms.md §9): distil what validated skills taught into the plain-prompt policy.

A skill in the prompt helps only while it is retrieved and fits in the context. Internalization trains the policy to
take the actions a helpful skill led to when the skill is NOT in its prompt, so the behaviour survives without it
(at inference the plain prompt is used). For a skill-guided action with advantage A_t on its tokens, guided by a
skill of validated utility u(c) (mean reward with the skill minus without it):

    selected tokens: A_t > 0, in steps whose skill has u(c) > 0 (a skill of unknown utility is not trusted)
    w_t   = coef * min(u(c) * A_t, w_max)                       (0 for a token that is not selected)
    L_int = -sum_t w_t * log pi(a_t | prompt WITHOUT the skill) / N

N is the number of response tokens of the kept steps in the mini-batch, the normalization plain SFT uses, which is
how `models.trainer.sft_update(..., weights=...)` optimizes it on the pairs `internalization_pairs` returns. With a
scalar advantage per action (the usual GRPO case) every token of a kept step is selected, so N is exactly the
number of selected tokens and L_int is the weighted mean of docs/algorithms.md; with per-token advantages the
unselected tokens of a kept step stay in N (they are context, not targets) and weigh that step down a little.

The capped product keeps one lucky rollout of a barely useful skill from dominating, and a weight that is 0 for
negative advantages means internalization only ever imitates, never unlearns: unlearning is the RL loss's job.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from models.config import InternalizeConfig

TokenWeights = float | list[float]   # one weight for every response token of a pair, or one per response token


@dataclass(frozen=True)
class GuidedStep:
    """One action the policy took with a skill in its prompt, as an internalization candidate."""

    plain_prompt_ids: list[int]
    """The prompt this step would have had WITHOUT the skill: the one the policy is trained (and later run) on."""
    response_ids: list[int]
    """The action tokens the policy produced under the skill-guided prompt."""
    advantage: float | list[float]
    """The action's advantage: one value for every token, or one per token (len(response_ids) values)."""
    utility: float | None
    """u(c) of the skill that guided the step (docs/algorithms.md §9 validation); None when unknown."""

    def __post_init__(self) -> None:
        if not self.plain_prompt_ids:
            raise ValueError("GuidedStep has an empty plain prompt: its first action token would have no context")
        if not self.response_ids:
            raise ValueError("GuidedStep has no response tokens: there is no action to internalize")
        if self.utility is not None and not math.isfinite(self.utility):
            raise ValueError(f"GuidedStep utility must be finite or None (unknown), got {self.utility}")
        advantages = token_advantages(self)
        if len(advantages) != len(self.response_ids):
            raise ValueError(f"GuidedStep has {len(advantages)} advantages for {len(self.response_ids)} response "
                             f"tokens: give one per token or a single number")
        if not all(math.isfinite(a) for a in advantages):
            raise ValueError(f"GuidedStep advantages must be finite, got {self.advantage}")


def token_advantages(step: GuidedStep) -> list[float]:
    """The step's advantage per response token (a scalar advantage is broadcast)."""
    if isinstance(step.advantage, numbers.Real):
        return [float(step.advantage)] * len(step.response_ids)
    return [float(a) for a in step.advantage]


def internalization_pairs(
    steps: Sequence[GuidedStep], cfg: InternalizeConfig
) -> tuple[list[tuple[list[int], list[int]]], list[list[float]], dict[str, float]]:
    """SIRI selection: (plain prompt, action) pairs with per-token weights w_t = coef * min(u * A_t, w_max).

    A token is selected when its step's utility u is known and > 0, its advantage A_t > 0 and its weight is > 0
    (coef 0 selects nothing). Unselected tokens get weight 0 (kept as context); steps with no selected token are
    dropped. Train with `sft_update(engine, pairs, weights=weights, ...)`, see the module docstring.

    Returns (pairs, weights, metrics): weights[i] has one value per response token of pairs[i]; metrics are
    guided_steps (candidates), selected_steps (pairs kept), selected_tokens and mean_weight (over selected tokens,
    0 when none).
    """
    pairs: list[tuple[list[int], list[int]]] = []
    weights: list[list[float]] = []
    selected_tokens, weight_sum = 0, 0.0
    for step in steps:
        if step.utility is None or step.utility <= 0:
            continue
        step_weights = [cfg.coef * min(step.utility * a, cfg.w_max) if a > 0 else 0.0
                        for a in token_advantages(step)]
        selected = [w for w in step_weights if w > 0]
        if not selected:
            continue
        pairs.append((list(step.plain_prompt_ids), list(step.response_ids)))
        weights.append(step_weights)
        selected_tokens += len(selected)
        weight_sum += sum(selected)
    metrics = {
        "guided_steps": float(len(steps)),
        "selected_steps": float(len(pairs)),
        "selected_tokens": float(selected_tokens),
        "mean_weight": weight_sum / selected_tokens if selected_tokens else 0.0,
    }
    return pairs, weights, metrics


def check_token_weights(weights: Sequence[float | Sequence[float]],
                        pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[TokenWeights]:
    """Validates sft_update's `weights` against its pairs and returns them as plain floats.

    One entry per pair: a number (every response token) or one number per response token; all finite and >= 0.
    """
    if len(weights) != len(pairs):
        raise ValueError(f"got {len(weights)} weights for {len(pairs)} pairs: give one entry per pair (a number, "
                         f"or a list with one number per response token)")
    checked: list[TokenWeights] = []
    for i, (entry, (_, response)) in enumerate(zip(weights, pairs)):
        if isinstance(entry, numbers.Real):
            values = [float(entry)]
            checked.append(values[0])
        else:
            values = [float(w) for w in entry]
            if len(values) != len(response):
                raise ValueError(f"pair {i}: {len(values)} weights for {len(response)} response tokens: give one "
                                 f"per token or a single number")
            checked.append(values)
        if not all(math.isfinite(w) and w >= 0 for w in values):
            raise ValueError(f"pair {i}: weights must be finite and >= 0 (0 leaves a token untrained), got {entry}")
    return checked


def weighted_sft_loss(logits: Tensor, labels: Tensor, mask: Tensor, weights: Tensor) -> Tensor:
    """-sum_t w_t log p(labels_t) / (number of positions where mask is 1): `losses.sft_loss` with per-token weights.

    logits [B, L, V] are aligned with labels [B, L] (logits[b, t] scores labels[b, t]); mask, weights [B, L].
    Weights of 1 everywhere give exactly sft_loss's value and gradient. Labels and weights at masked positions may
    hold anything.
    """
    valid = mask.bool()                                                     # [B, L]
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels))      # [B, L]
    token_ce = F.cross_entropy(logits.float().transpose(1, 2), safe_labels, reduction="none")  # [B, L]
    weighted = weights.to(token_ce.device, token_ce.dtype) * token_ce       # [B, L]
    total = torch.where(valid, weighted, torch.zeros_like(weighted)).sum()  # []
    return total / valid.sum().clamp_min(1)
