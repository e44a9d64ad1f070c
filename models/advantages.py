"""Advantage estimators (docs/algorithms.md §1, §3, §4, §5, §10): one batch record in, token-level advantages out.

Every estimator registered in ADVANTAGES has the signature `fn(batch: StepBatch, cfg: AdvantageConfig) ->
AdvantageResult`. A batch holds one row per (trajectory, step) (step-row layout) or one row per trajectory
(concatenated layout: step_index 0). Rows may come in any order; a trajectory's rows are ordered by step_index, and
"the next row" of a row is the next one in that order. Group and trajectory ids need not be contiguous.

This module is the one to import: it imports every estimator module, so ADVANTAGES is complete once it is loaded, and
re-exports the public names. Where the code lives: models/config.py (AdvantageConfig, params.yaml ``train.advantage``,
and ADVANTAGES, torch-free), models/advantage_core.py (StepBatch, AdvantageResult, shared helpers),
models/outcome_advantages.py (§1: grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline and the per-trajectory
`grpo_scores`, `dr_grpo_scores`, `rloo_scores`), models/step_advantages.py (§3-§5: gigpo, graphgpo, turn_level; §10:
`add_process_advantages`); the skill-credit estimators are in models/skill_advantages.py.

Conventions shared by all estimators: math runs in float64 and is returned in the rewards' dtype (the default float
dtype for integer rewards); `std` is always the unbiased (n-1) standard deviation, for scenario groups, anchor
groups and turn groups alike; a group whose values are all equal gets exactly 0; token advantages are exactly 0
where response_mask is 0, and rows without a valid token never produce NaN.
"""
from __future__ import annotations

# Importing the estimator modules registers their estimators in ADVANTAGES.
from models import outcome_advantages, step_advantages  # noqa: F401
from models.advantage_core import ADVANTAGES, AdvantageResult, StepBatch, broadcast_rows
from models.config import ANCHOR_MODES, AdvantageConfig
from models.step_advantages import add_process_advantages

__all__ = ["ADVANTAGES", "ANCHOR_MODES", "AdvantageConfig", "AdvantageResult", "StepBatch", "add_process_advantages",
           "broadcast_rows"]
