"""Skill credit (docs/algorithms.md §9, "Paired credit"): the `skillc` and `d2skill` advantage estimators and the skill
utility EMA, for groups whose rollouts are split into a skill-using half and a skill-free half.

Importing this module registers `skillc` and `d2skill` in `models.advantages.ADVANTAGES`, so the train stage must
import it before it looks an estimator up. Both estimators need to know, per row, whether the row's trajectory ran
with the skill in its prompt. `StepBatch` has no such field and stays unchanged; the flags travel in a wrapper:

    batch = step_batch(frame)                                    # StepBatch, as for every estimator
    if cfg.advantage in SKILL_ADVANTAGES:
        batch = SkillStepBatch(batch, skill_used=...)            # [R] bool, constant over a trajectory's rows
    result = ADVANTAGES[cfg.name](batch, cfg)                   # cfg: AdvantageConfig (skillc_lambda, gamma, ...)

Handed a bare `StepBatch`, they read it as "no row used a skill": both then equal GRPO exactly, and the metric
`skill_traj_share` = 0 shows that no flags arrived.

Both estimators work on trajectory scores s_i = sum of the trajectory's rewards (minus invalid_penalty, as every
outcome estimator), so the halves are compared per trajectory, never per row (a long trajectory does not count more).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

# The shared private pieces keep the conventions identical to the other estimators (layout checks, invalid penalty,
# float64 math, dtype of the result, metrics); models.advantages is left unchanged.
from models.advantage_core import _constant_per_traj, _group_stats, _Layout, _layout, _penalized, _row_result
from models.advantages import ADVANTAGES, AdvantageConfig, AdvantageResult, StepBatch
from models.config import SKILL_ADVANTAGES  # noqa: F401 - re-exported: the estimators that need a SkillStepBatch
from models.outcome_advantages import grpo_scores


class SkillStepBatch(NamedTuple):
    """A StepBatch plus, per row, whether its trajectory ran with the skill (candidate or retrieved) in its prompt."""
    batch: StepBatch
    skill_used: Tensor
    """[R] bool, the same on every row of a trajectory."""


class _Halves(NamedTuple):
    scores: Tensor      # [T] s_i, float64
    group: Tensor       # [T] dense group id 0..G-1
    skill: Tensor       # [T] bool, trajectory used the skill
    won: Tensor         # [T] bool
    n_skill: Tensor     # [G] trajectories in the skill half
    n_free: Tensor      # [G] trajectories in the skill-free half
    paired: Tensor      # [G] bool, both halves non-empty


def _unpack(batch: StepBatch | SkillStepBatch) -> tuple[StepBatch, Tensor]:
    if isinstance(batch, SkillStepBatch):
        rows = batch.batch.rewards.shape[0]
        if tuple(batch.skill_used.shape) != (rows,):
            raise ValueError(f"skill_used must be [R] = ({rows},), got {tuple(batch.skill_used.shape)}: one flag per "
                             "row of the StepBatch")
        return batch.batch, batch.skill_used.bool()
    return batch, torch.zeros(batch.rewards.shape[0], dtype=torch.bool)  # bare StepBatch: nobody used a skill


def _group_sum(values: Tensor, group: Tensor, num_groups: int) -> Tensor:
    return torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, values.to(torch.float64))  # [G]


def _halves(batch: StepBatch, skill_used: Tensor, lay: _Layout, cfg: AdvantageConfig) -> _Halves:
    num_traj = len(lay.traj_group)
    scores = _group_sum(_penalized(batch.rewards, batch, cfg), lay.traj, num_traj)            # [T]
    skill = _constant_per_traj(skill_used, lay.traj, num_traj, "skill_used").bool()            # [T]
    _, group = torch.unique(lay.traj_group, return_inverse=True)                                # [T]
    num_groups = int(group.max()) + 1 if num_traj else 0
    n_skill = _group_sum(skill, group, num_groups)                                              # [G]
    n_free = _group_sum(~skill, group, num_groups)                                              # [G]
    return _Halves(scores, group, skill, lay.traj_won, n_skill, n_free, (n_skill > 0) & (n_free > 0))


def _half_means(values: Tensor, h: _Halves) -> tuple[Tensor, Tensor]:
    """[T] values -> per-group means over the skill half and the free half, [G] each (0 where a half is empty)."""
    num_groups = len(h.paired)
    values = values.to(torch.float64)                                                           # [T]
    skill_sum = _group_sum(torch.where(h.skill, values, 0.0), h.group, num_groups)              # [G]
    free_sum = _group_sum(torch.where(h.skill, 0.0, values), h.group, num_groups)               # [G]
    return skill_sum / h.n_skill.clamp_min(1), free_sum / h.n_free.clamp_min(1)                 # [G] each


def _skill_metrics(h: _Halves, gap: Tensor) -> dict[str, float]:
    paired = h.paired                                                                           # [G]
    return {"skill_traj_share": float(h.skill.double().mean()) if len(h.skill) else 0.0,
            "skill_paired_group_share": float(paired.double().mean()) if len(paired) else 0.0,
            "skill_delta_mean": float(gap[paired].mean()) if paired.any() else 0.0}


@ADVANTAGES.register("skillc")
def compute_skillc_advantages(batch: StepBatch | SkillStepBatch, cfg: AdvantageConfig) -> AdvantageResult:
    """SkillC dual-stream advantage (SkillC, "Contrastive Skill Credit Assignment"; docs/algorithms.md §9).

    A_i = A^global_i + lambda * max(Delta_g, 0) * 1[i skill-free and s_i > mean_g], where A^global is GRPO over the
    whole group (both halves, one ranking), Delta_g = mean s(skill half) - mean s(free half) and mean_g the mean
    over the whole group (strictly above; an all-equal group has nobody above). The correction is one-sided: it
    only rewards skill-free successes when the skill helps (pushing the policy to do without it), never penalizes.
    No correction in a group with an empty half (Delta undefined), a singleton group included.
    Broadcast to the trajectory's generated tokens; lambda = AdvantageConfig.skillc_lambda.
    """
    plain, skill_used = _unpack(batch)
    lay = _layout(plain)
    lam = cfg.skillc_lambda
    h = _halves(plain, skill_used, lay, cfg)
    global_adv = grpo_scores(h.scores, h.group, cfg.eps)                                        # [T]
    _, centered, _ = _group_stats(h.scores, h.group)                                            # [T] s_i - mean_g
    mean_skill, mean_free = _half_means(h.scores, h)                                            # [G] each
    delta = torch.where(h.paired, mean_skill - mean_free, 0.0)                                  # [G]
    corrected = ~h.skill & (centered > 0) & (delta[h.group] > 0)                                # [T]
    traj_adv = global_adv + lam * torch.where(corrected, delta[h.group], 0.0)                   # [T]
    metrics = {**_skill_metrics(h, delta),
               "skillc_corrected_share": float(corrected.double().mean()) if len(corrected) else 0.0}
    return _row_result(traj_adv[lay.traj], plain, metrics)


@ADVANTAGES.register("d2skill")
def compute_d2skill_advantages(batch: StepBatch | SkillStepBatch, cfg: AdvantageConfig) -> AdvantageResult:
    """D2Skill paired-baseline advantage (Tu et al. 2026, "Dynamic Dual-Granularity Skill Bank for Agentic RL",
    arXiv:2603.28716; our formulation of docs/algorithms.md §9).

    A_i = (s_i - b_g) / (std_g + eps) for every rollout i of group g, with b_g = mean s over the group's skill-free
    half, std_g the unbiased std over the whole group. So skill-free rollouts are ranked among themselves and a
    skill-injected rollout is credited for what it achieves beyond the policy without the skill.

    Our reading of §9 ("b = mean success of the skill-free half"): the baseline is the free half's mean *score*
    (the score is the success indicator on 0/1-reward envs, and the baseline must share the score's units); the
    success indicator (`won`) drives the skill utility credit (paired_skill_credit). A group without a skill-free
    rollout, or without a skill rollout, has no pair: b_g = the group mean, i.e. GRPO. As GRPO, a singleton group
    gives A = s and an all-equal group exactly 0. Metric skill_credit_mean: mean success gap over paired groups.
    """
    plain, skill_used = _unpack(batch)
    lay = _layout(plain)
    h = _halves(plain, skill_used, lay, cfg)
    count, centered, std = _group_stats(h.scores, h.group)                                      # [T] each
    _, mean_free = _half_means(h.scores, h)                                                     # [G]
    paired = h.paired[h.group]                                                                  # [T]
    # an all-equal group (std exactly 0, centered exactly 0) keeps 0: s_i - b_g is 0 too, but not always in floats
    baseline_shift = torch.where(paired & (std > 0), h.scores - mean_free[h.group], centered)  # [T]
    traj_adv = torch.where(count == 1, h.scores, baseline_shift / (std + cfg.eps))              # [T]
    won_skill, won_free = _half_means(h.won, h)                                                 # [G] each
    metrics = _skill_metrics(h, won_skill - won_free)
    metrics["skill_credit_mean"] = metrics.pop("skill_delta_mean")
    return _row_result(traj_adv[lay.traj], plain, metrics)


def paired_skill_credit(batch: SkillStepBatch) -> dict[int, float]:
    """Success gap per paired group: {group_index: mean won(skill half) - mean won(skill-free half)}.

    Groups with an empty half are left out (no credit to give). The caller maps each group to the skill it tested
    and folds the credits into the skill's utility with update_skill_utility.
    """
    plain, skill_used = _unpack(batch)
    lay = _layout(plain)
    h = _halves(plain, skill_used, lay, AdvantageConfig())
    won_skill, won_free = _half_means(h.won, h)                                                 # [G] each
    group_ids = torch.unique(lay.traj_group)                                            # [G] sorted: the dense order
    return {int(g): float(won_skill[k] - won_free[k])
            for k, g in enumerate(group_ids.tolist()) if bool(h.paired[k])}


def update_skill_utility(utility: float, credit: float, beta: float = 0.5) -> float:
    """Skill utility EMA (D2Skill; docs/algorithms.md §9): U <- (1 - beta) * U + beta * credit, beta 0.5.

    §9 writes "U <- (1-b)U + b*credit, beta 0.5": we read the rate b there as beta (the EMA rate it names), not as
    the baseline b of the same paragraph, whose role is inside `credit` (= skill-half success - b).
    """
    if not 0.0 < beta <= 1.0:
        raise ValueError(f"beta = {beta} must be in (0, 1]")
    return (1.0 - beta) * utility + beta * credit


