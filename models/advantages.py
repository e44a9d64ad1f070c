"""Advantage estimators (docs/algorithms.md §1, §3, §4, §5, §10): one batch record in, token-level advantages out.

Every estimator registered in ADVANTAGES has the signature `fn(batch: StepBatch, cfg: AdvantageConfig) ->
AdvantageResult`. A batch holds one row per (trajectory, step) (step-row layout) or one row per trajectory
(concatenated layout: step_index 0). Rows may come in any order; a trajectory's rows are ordered by step_index, and
"the next row" of a row is the next one in that order. Group and trajectory ids need not be contiguous.

This module holds AdvantageConfig (params.yaml ``train.advantage``) and is the one to import: it imports every estimator
module, so ADVANTAGES is complete once it is loaded, and re-exports the public names. Where the code lives:
models/advantage_core.py (StepBatch, AdvantageResult, ADVANTAGES, shared helpers), models/outcome_advantages.py (§1:
grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline and the per-trajectory `grpo_scores`, `dr_grpo_scores`,
`rloo_scores`), models/step_advantages.py (§3-§5: gigpo, graphgpo, turn_level; §10: `add_process_advantages`);
the skill-credit estimators are in models/skill_advantages.py.

Conventions shared by all estimators: math runs in float64 and is returned in the rewards' dtype (the default float
dtype for integer rewards); `std` is always the unbiased (n-1) standard deviation, for scenario groups, anchor
groups and turn groups alike; a group whose values are all equal gets exactly 0; token advantages are exactly 0
where response_mask is 0, and rows without a valid token never produce NaN.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Importing the estimator modules registers their estimators in ADVANTAGES.
from models import outcome_advantages, step_advantages  # noqa: F401
from models.advantage_core import ADVANTAGES, GRPO_EPS, AdvantageResult, StepBatch, broadcast_rows
from models.checks import check_choice, check_config
from models.step_advantages import add_process_advantages

__all__ = ["ADVANTAGES", "ANCHOR_MODES", "AdvantageConfig", "AdvantageResult", "StepBatch", "add_process_advantages",
           "broadcast_rows"]

ANCHOR_MODES = ("exact", "fuzzy")


@dataclass(frozen=True)
class AdvantageConfig:
    """params.yaml ``train.advantage``: which estimator and its knobs (one config for every estimator; each reads the
    fields it needs)."""

    name: str = field(default="grpo", metadata={"registry": ADVANTAGES})
    """Estimator (ADVANTAGES): grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, gigpo, graphgpo, turn_level,
    and the skill-credit estimators skillc, d2skill (models/skill_advantages.py)."""
    eps: float = GRPO_EPS
    """Added to the std in every group normalization (episode, anchor and turn groups)."""
    gamma: float = 0.95
    """Per-step discount of the step returns R_t (gigpo, graphgpo, turn_level)."""
    omega: float = 1.0
    """Weight of the step advantage in gigpo: A = A^E + omega * A^S."""
    anchor_mode: str = "exact"
    """How gigpo/graphgpo group states: "exact" (identical anchor text) or "fuzzy" (similarity >= fuzzy_threshold)."""
    fuzzy_threshold: float = 0.95
    """Fuzzy mode: a row joins the first anchor cluster whose first member has similarity >= this (difflib ratio)."""
    invalid_penalty: float = 0.0
    """Extra penalty for an invalid action, subtracted from the row's reward and from its step return R_t
    (docs/algorithms.md §3.4). 0 by default because our envs already put it in the reward."""
    token_gamma: float = 1.0
    """REINFORCE++ per-token discount of the token returns."""
    graph_goal_reward: float = 10.0
    """GraphGPO step return of reaching the goal: R_t = graph_goal_reward * graph_decay ** d(s_{t+1})."""
    graph_decay: float = 0.1
    """GraphGPO decay per step of distance to the goal."""
    skillc_lambda: float = 1.0
    """skillc: weight of the one-sided correction A_i += skillc_lambda * max(Delta, 0) on skill-free rollouts above
    the group mean (docs/algorithms.md §9; 1.0 puts a full success gap on the scale of one GRPO unit; 0 = grpo)."""
    process_weight: float = 0.0
    """HIPIF process advantage (fold context): A = A + process_weight * A^proc, A^proc the steps' process rewards
    normalized within their group (`add_process_advantages`, docs/algorithms.md section 10); 0 = off."""

    def __post_init__(self) -> None:
        check_config(self, eps="positive", gamma="probability", token_gamma="probability",
                     graph_decay="probability", fuzzy_threshold="open_probability", skillc_lambda="non_negative",
                     process_weight="non_negative", invalid_penalty="non_negative")
        check_choice(self, "anchor_mode", ANCHOR_MODES)

