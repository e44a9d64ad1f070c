"""Skill credit estimators (models.skill_advantages): hand-computed skillc / d2skill values, a plain-loop reference
against the vectorized code, the no-correction cases, the utility EMA and the batch wrapper's checks."""
from __future__ import annotations

import math
import random
from collections import defaultdict

import pytest
import torch

from models.advantages import ADVANTAGES, AdvantageConfig, StepBatch
from models.outcome_advantages import compute_grpo_advantages
from models.skill_advantages import (
    SKILL_ADVANTAGES, SkillStepBatch, compute_d2skill_advantages, compute_skillc_advantages,
    paired_skill_credit, update_skill_utility,
)

EPS = AdvantageConfig().eps


def make(trajs: list[tuple], dtype=torch.float64) -> SkillStepBatch:
    """trajs: (group, skill_used, won, [row rewards]); one row per reward, two mask tokens per row."""
    rewards, traj_index, group_index, step_index, won, skill = [], [], [], [], [], []
    for t, (group, used, success, row_rewards) in enumerate(trajs):
        for k, r in enumerate(row_rewards):
            rewards.append(r), traj_index.append(t), group_index.append(group), step_index.append(k)
            won.append(success), skill.append(used)
    rows = len(rewards)
    batch = StepBatch(
        rewards=torch.tensor(rewards, dtype=dtype), traj_index=torch.tensor(traj_index, dtype=torch.long),
        group_index=torch.tensor(group_index, dtype=torch.long), step_index=torch.tensor(step_index, dtype=torch.long),
        anchors=tuple("s" for _ in range(rows)), won=torch.tensor(won, dtype=torch.bool),
        action_valid=torch.ones(rows, dtype=torch.bool),
        response_mask=torch.tensor([[1.0, 0.0]] * rows).reshape(rows, 2))
    return SkillStepBatch(batch, torch.tensor(skill, dtype=torch.bool))


def per_traj(result, batch: SkillStepBatch) -> list[float]:
    """Advantage of each trajectory (its first row), after checking all its rows agree."""
    out = {}
    for row, t in enumerate(batch.batch.traj_index.tolist()):
        value = float(result.row_advantages[row])
        assert out.setdefault(t, value) == value
    return [out[t] for t in sorted(out)]


# Group 10: skill [1, 1 (two rows 0.5 + 0.5)], free [1, 0]; group 20: skill only [1, 0];
# group 30: skill [0, 0], free [1, 0] (skill hurts); group 40: all equal, both halves.
HAND = [
    (10, True, True, [1.0]), (10, True, True, [0.5, 0.5]), (10, False, True, [1.0]), (10, False, False, [0.0]),
    (20, True, True, [1.0]), (20, True, False, [0.0]),
    (30, True, False, [0.0]), (30, True, False, [0.0]), (30, False, True, [1.0]), (30, False, False, [0.0]),
    (40, True, True, [0.3]), (40, False, True, [0.3]), (40, False, True, [0.3]),
]


def test_skillc_hand_computed():
    # group 10: s = [1, 1, 1, 0], mean 0.75, unbiased std 0.5 -> GRPO [0.5, 0.5, 0.5, -1.5] (/(0.5+eps)*0.5);
    #   Delta = mean(1, 1) - mean(1, 0) = 0.5 > 0; only trajectory 2 is skill-free and above the mean: +lambda*0.5
    # group 20: no free half -> GRPO [+-0.5/sqrt(0.5)]; group 30: Delta = 0 - 0.5 < 0 -> GRPO;
    # group 30 GRPO: s = [0, 0, 1, 0], mean 0.25, std 0.5 -> [-0.5, -0.5, 1.5, -0.5]; group 40: all equal -> 0
    batch = make(HAND)
    g = 0.25 / (0.5 + EPS)
    r = 0.5 / (math.sqrt(0.5) + EPS)
    grpo = [g, g, g, -3 * g, r, -r, -g, -g, 3 * g, -g, 0.0, 0.0, 0.0]
    result = compute_skillc_advantages(batch, AdvantageConfig(skillc_lambda=2.0))
    expected = list(grpo)
    expected[2] += 2.0 * 0.5
    assert per_traj(result, batch) == pytest.approx(expected, abs=1e-9)
    assert result.metrics["skill_paired_group_share"] == 0.75
    assert result.metrics["skill_delta_mean"] == pytest.approx((0.5 - 0.5 + 0.0) / 3)
    assert result.metrics["skillc_corrected_share"] == pytest.approx(1 / 13)
    assert torch.equal(result.token_advantages[:, 1], torch.zeros(14, dtype=torch.float64))  # masked token
    # a plain AdvantageConfig uses the default lambda 1.0
    plain = per_traj(compute_skillc_advantages(batch, AdvantageConfig()), batch)
    assert plain[2] == pytest.approx(grpo[2] + 0.5)


def test_d2skill_hand_computed():
    # group 10: b = mean free (1, 0) = 0.5, std 0.5 -> (s - 0.5) / 0.5 = [1, 1, 1, -1]
    # group 20: unpaired -> GRPO; group 30: b = 0.5, std 0.5 -> [-1, -1, 1, -1]; group 40: all equal -> 0
    batch = make(HAND)
    one = 0.5 / (0.5 + EPS)
    r = 0.5 / (math.sqrt(0.5) + EPS)
    result = compute_d2skill_advantages(batch, AdvantageConfig())
    expected = [one, one, one, -one, r, -r, -one, -one, one, -one, 0.0, 0.0, 0.0]
    assert per_traj(result, batch) == pytest.approx(expected, abs=1e-9)
    assert all(v == 0.0 for v in per_traj(result, batch)[10:])  # exactly 0, although 0.3 * 3 / 3 != 0.3
    # success gaps: group 10: 1 - 0.5; group 30: 0 - 0.5; group 40: 1 - 1
    assert result.metrics["skill_credit_mean"] == pytest.approx(0.0)
    assert paired_skill_credit(batch) == pytest.approx({10: 0.5, 30: -0.5, 40: 0.0})


def test_no_skill_flags_or_no_pairs_give_grpo_exactly():
    batch = make(HAND)
    grpo = compute_grpo_advantages(batch.batch, AdvantageConfig())
    for fn in (compute_skillc_advantages, compute_d2skill_advantages):
        bare = fn(batch.batch, AdvantageConfig())  # a bare StepBatch: nobody used a skill
        torch.testing.assert_close(bare.row_advantages, grpo.row_advantages, rtol=0, atol=0)
        assert bare.metrics["skill_traj_share"] == 0.0 and bare.metrics["skill_paired_group_share"] == 0.0
        everyone = fn(batch._replace(skill_used=torch.ones(14, dtype=torch.bool)), AdvantageConfig())
        torch.testing.assert_close(everyone.row_advantages, grpo.row_advantages, rtol=0, atol=0)
    off = compute_skillc_advantages(batch, AdvantageConfig(skillc_lambda=0.0))
    torch.testing.assert_close(off.row_advantages, grpo.row_advantages, rtol=0, atol=0)
    assert paired_skill_credit(batch._replace(skill_used=torch.zeros(14, dtype=torch.bool))) == {}


# ---------------------------------------------------------------------------------------------------------------
# Plain-loop reference
# ---------------------------------------------------------------------------------------------------------------

def loop_reference(name: str, trajs: list[tuple], lam: float) -> list[float]:
    groups = defaultdict(list)
    for t, (group, used, _, rewards) in enumerate(trajs):
        groups[group].append((t, used, sum(rewards)))
    out = [0.0] * len(trajs)
    for members in groups.values():
        scores = [s for _, _, s in members]
        n = len(scores)
        mean = sum(scores) / n
        std = math.sqrt(sum((s - mean) ** 2 for s in scores) / (n - 1)) if n > 1 else 1.0
        skill = [s for _, used, s in members if used]
        free = [s for _, used, s in members if not used]
        paired = bool(skill) and bool(free)
        for t, used, s in members:
            if n == 1:
                out[t] = s / (1.0 + EPS) if name == "skillc" else s  # GRPO: mean 0, std 1; d2skill: A = s
            elif len(set(scores)) == 1:
                out[t] = 0.0
            elif name == "skillc":
                delta = sum(skill) / len(skill) - sum(free) / len(free) if paired else 0.0
                bonus = lam * max(delta, 0.0) if paired and not used and s > mean else 0.0
                out[t] = (s - mean) / (std + EPS) + bonus
            else:
                baseline = sum(free) / len(free) if paired else mean
                out[t] = (s - baseline) / (std + EPS)
    return out


def random_trajs(rng: random.Random) -> list[tuple]:
    trajs = []
    for group in rng.sample(range(100), rng.randint(1, 4)):
        for _ in range(rng.randint(1, 6)):
            rewards = [rng.choice([0.0, 0.5, 1.0, -0.25]) for _ in range(rng.randint(1, 3))]
            trajs.append((group, rng.random() < 0.5, rng.random() < 0.5, rewards))
    rng.shuffle(trajs)
    return trajs


@pytest.mark.parametrize("name", SKILL_ADVANTAGES)
def test_vectorized_matches_loop(name):
    rng = random.Random(7)
    for _ in range(60):
        trajs = random_trajs(rng)
        lam = rng.choice([0.0, 0.5, 1.0, 3.0])
        batch = make(trajs)
        result = ADVANTAGES[name](batch, AdvantageConfig(skillc_lambda=lam))
        assert per_traj(result, batch) == pytest.approx(loop_reference(name, trajs, lam), abs=1e-9)


# ---------------------------------------------------------------------------------------------------------------
# Utility EMA, wrapper checks, registry
# ---------------------------------------------------------------------------------------------------------------

def test_utility_ema_hand_computed():
    u = update_skill_utility(0.0, 0.5)            # 0.5 * 0 + 0.5 * 0.5
    assert u == 0.25
    assert update_skill_utility(u, -0.5) == -0.125  # 0.5 * 0.25 + 0.5 * -0.5
    assert update_skill_utility(1.0, 0.0, beta=0.1) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="beta"):
        update_skill_utility(0.0, 1.0, beta=0.0)


def test_bad_inputs_are_rejected_with_a_message():
    batch = make(HAND)
    with pytest.raises(ValueError, match="skill_used must be"):
        compute_skillc_advantages(batch._replace(skill_used=torch.ones(3, dtype=torch.bool)), AdvantageConfig())
    mixed = batch.skill_used.clone()
    mixed[1] = ~mixed[1]  # rows 1 and 2 are the same trajectory
    with pytest.raises(ValueError, match="disagree on skill_used"):
        compute_d2skill_advantages(batch._replace(skill_used=mixed), AdvantageConfig())
    with pytest.raises(ValueError, match="skillc_lambda"):
        AdvantageConfig(skillc_lambda=-1.0)


def test_registered_dtype_kept_and_empty_batch():
    assert set(SKILL_ADVANTAGES) <= set(ADVANTAGES.names())
    assert ADVANTAGES["skillc"] is compute_skillc_advantages and ADVANTAGES["d2skill"] is compute_d2skill_advantages
    batch = make(HAND, dtype=torch.float32)
    for name in SKILL_ADVANTAGES:
        result = ADVANTAGES[name](batch, AdvantageConfig())
        assert result.token_advantages.dtype == torch.float32 and result.row_advantages.dtype == torch.float32
        empty = ADVANTAGES[name](make([]), AdvantageConfig())
        assert empty.row_advantages.shape == (0,)
        assert all(math.isfinite(v) for v in empty.metrics.values())
