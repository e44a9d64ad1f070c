"""Staleness and importance-weight statistics of an RL update with stale rows (docs/algorithms.md §2.7).

The weights themselves are `models.losses.truncated_is_weights`; this module sums their per-micro-batch metrics over
micro-batches, ranks and updates, describes the rows' staleness, and keeps the off-policy knobs out of the
trainer's fingerprint when no row is stale (so an all-on-policy update resumes and fingerprints as before).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from models.batching import all_ranks_max, all_reduce_sum
from models.losses import NO_STALE_WEIGHT_METRICS, LossConfig

IS_WEIGHT_METRICS = tuple(NO_STALE_WEIGHT_METRICS)  # is_weight_mean/max/truncated_fraction, over stale rows' tokens
OFF_POLICY_SETTINGS = ("off_policy", "is_weight_cap")  # LossConfig fields that matter only when a row is stale
NO_STALE_TOKENS = {"sum": 0.0, "truncated": 0.0, "count": 0.0, "max": 0.0}  # `is_weight_totals` of no token


def staleness_metrics(staleness: Tensor) -> dict[str, float]:
    """stale_row_fraction (rows with staleness > 0 / rows), staleness_mean, staleness_max and staleness_count_<k>
    (rows with staleness k, for each k present) of the rows' staleness [B]."""
    values = staleness.double()                                             # [B]
    present, counts = torch.unique(staleness, return_counts=True)          # [K], [K]
    by_k = {f"staleness_count_{k}": float(n) for k, n in zip(present.tolist(), counts.tolist())}
    return {"stale_row_fraction": float((staleness > 0).double().mean()), "staleness_mean": float(values.mean()),
            "staleness_max": float(values.max()), **by_k}


def is_weight_totals(micro_metrics: list[dict[str, float]], device: torch.device) -> dict[str, float]:
    """Over the stale rows' tokens of one step's micro-batches on all ranks (from their IS_WEIGHT_METRICS and
    `_is_weight_count`): the sum of the importance weights, the number of truncated tokens, the token count, and the
    largest weight (0.0 without stale tokens: every weight is > 0, so it is neutral in the maximum over ranks)."""
    weighted = [m for m in micro_metrics if m["_is_weight_count"] > 0]
    local = torch.tensor([sum(m["is_weight_mean"] * m["_is_weight_count"] for m in weighted),
                          sum(m["is_weight_truncated_fraction"] * m["_is_weight_count"] for m in weighted),
                          sum(m["_is_weight_count"] for m in weighted)], dtype=torch.float64)  # [3]
    weight_sum, truncated, count = all_reduce_sum(local, device).tolist()
    top = all_ranks_max(max((m["is_weight_max"] for m in weighted), default=0.0), device)
    return {"sum": weight_sum, "truncated": truncated, "count": count, "max": top}


def add_is_weight_totals(totals: dict[str, float], step: dict[str, float]) -> dict[str, float]:
    """Two `is_weight_totals` combined: sums added, the maximum of the maxima."""
    return {k: max(totals[k], v) if k == "max" else totals[k] + v for k, v in step.items()}


def is_weight_metrics(totals: dict[str, float]) -> dict[str, float]:
    """IS_WEIGHT_METRICS from `is_weight_totals` (NO_STALE_WEIGHT_METRICS without stale tokens)."""
    if totals["count"] == 0:
        return dict(NO_STALE_WEIGHT_METRICS)
    return {"is_weight_mean": totals["sum"] / totals["count"], "is_weight_max": totals["max"],
            "is_weight_truncated_fraction": totals["truncated"] / totals["count"]}


def loss_settings(loss: LossConfig, batch: dict[str, Tensor]) -> dict[str, Any]:
    """The loss config as the fingerprint sees it: without the off-policy knobs when no row is stale (they change
    nothing then), so an all-on-policy call keeps the fingerprint it had before those knobs existed."""
    settings = dataclasses.asdict(loss)
    if not bool(batch["staleness"].any()):
        for name in OFF_POLICY_SETTINGS:
            settings.pop(name)
    return settings
