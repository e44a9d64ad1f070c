"""Pre-storage validation (skills.validation): paired halves, hand-computed u and Welch t, every decision case, the
round's promote / reject / pending split with evidence, and a seeded paired-rollout simulation."""
from __future__ import annotations

import math
import random

import pytest

from skills.bank import Skill, read_skill, write_skill
from skills.validation import (
    Decision, ValidationResult, decide, evidence, seed_slots, split_group, utility, with_evidence,
)


def skill(name: str, version: int = 1) -> Skill:
    return Skill(name=name, when_to_use="When testing.", procedure="Do it.", version=version)


# ---------------------------------------------------------------------------------------------------------------
# split_group / seed_slots
# ---------------------------------------------------------------------------------------------------------------

def test_seed_slots_pair_i_with_i_plus_half():
    assert seed_slots(4) == [0, 1, 0, 1]
    assert seed_slots(5) == [0, 1, 0, 1, 2]  # the odd one out has its own slot
    assert seed_slots(1) == [0] and seed_slots(0) == []


@pytest.mark.parametrize("size", [2, 3, 4, 7, 8])
def test_split_group_makes_paired_halves(size):
    episodes = [100 + 3 * k for k in range(size)]  # arbitrary episode ids, in group order
    slot = dict(zip(episodes, seed_slots(size)))
    base, aug = split_group(episodes, seed=11)
    assert sorted(base + aug) == episodes and len(aug) == size // 2
    assert len(base) == size - size // 2
    assert all(slot[b] == slot[a] for b, a in zip(base, aug))  # base[k] and aug[k] share an env seed
    assert split_group(episodes, seed=11) == (base, aug)       # deterministic in the seed


def test_split_group_coin_flips_which_member_is_augmented_and_tiny_groups():
    later = {tuple(split_group([0, 1], seed)[1]) for seed in range(20)}
    assert later == {(0,), (1,)}  # over seeds, both members of a pair get the candidate
    assert split_group([5], seed=0) == ([5], []) and split_group([], seed=0) == ([], [])
    with pytest.raises(ValueError, match="distinct"):
        split_group([1, 1], seed=0)


# ---------------------------------------------------------------------------------------------------------------
# utility: hand-computed Welch t and each decision case
# ---------------------------------------------------------------------------------------------------------------

def test_helpful_candidate_is_promoted():
    # base [0, 0, 1, 0]: mean 0.25, var 0.25; aug [1, 1, 1, 0]: mean 0.75, var 0.25
    # u = 0.5; se = sqrt(0.25/4 + 0.25/4) = sqrt(0.125); t = 0.5 / 0.353553 = 1.414214 > 1
    result = utility([0, 0, 1, 0], [1, 1, 1, 0])
    assert result.u == pytest.approx(0.5) and result.welch_t == pytest.approx(math.sqrt(2))
    assert result.promote and (result.n_base, result.n_aug) == (4, 4)
    assert (result.mean_base, result.mean_aug) == (0.25, 0.75)


def test_noisy_and_harmful_candidates_are_rejected():
    # noisy: base [0, 1, 0, 1] mean 0.5 var 1/3; aug [1, 0, 1, 1] mean 0.75 var 0.25
    # se = sqrt(0.25/4 + (1/3)/4) = 0.381881; t = 0.25 / 0.381881 = 0.654654 <= 1
    noisy = utility([0, 1, 0, 1], [1, 0, 1, 1])
    assert noisy.u == pytest.approx(0.25) and noisy.welch_t == pytest.approx(0.654654, abs=1e-6)
    assert not noisy.promote and "too noisy" in noisy.reason
    harmful = utility([1, 1, 0, 1], [0, 0, 1, 0])
    assert harmful.u == pytest.approx(-0.5) and harmful.welch_t == pytest.approx(-math.sqrt(2))
    assert not harmful.promote and "does not help" in harmful.reason
    # the thresholds are parameters: the noisy candidate passes t_min 0.5, the helpful one fails tau 0.6
    assert utility([0, 1, 0, 1], [1, 0, 1, 1], t_min=0.5).promote
    assert not utility([0, 0, 1, 0], [1, 1, 1, 0], tau=0.6).promote


def test_zero_variance_tiny_and_empty_halves():
    sure = utility([0, 0], [1, 1])  # both halves constant: t = +inf, a deterministic gain
    assert sure.promote and sure.welch_t == math.inf and "zero variance" in sure.reason
    same = utility([1, 1], [1, 1])
    assert not same.promote and same.u == 0.0 and same.welch_t == 0.0
    worse = utility([1, 1], [0, 0])
    assert not worse.promote and worse.welch_t == -math.inf
    tiny = utility([0.0], [1.0, 0.5])  # one base episode: no variance, decided on u alone
    assert tiny.promote and tiny.welch_t is None and tiny.u == 0.75 and "u alone" in tiny.reason
    assert not utility([1.0], [0.0]).promote
    empty = utility([], [1, 1])
    assert not empty.promote and empty.u is None and empty.welch_t is None and "no base" in empty.reason
    assert "no augmented" in utility([1], []).reason


def test_paired_rollout_simulation_promotes_help_and_rejects_harm():
    """Seeded pairs: each pair shares a start difficulty (the env seed); the candidate changes success odds."""
    def run(effect: float, seed: int) -> ValidationResult:
        rng = random.Random(seed)
        episodes = list(range(16))
        base, aug = split_group(episodes, seed)
        returns_base, returns_aug = [], []
        for _ in base[:len(aug)]:
            easy = rng.random() < 0.5  # the shared seed: both members of a pair get the same start
            p = 0.6 if easy else 0.2
            returns_base.append(float(rng.random() < p))
            returns_aug.append(float(rng.random() < min(max(p + effect, 0.0), 1.0)))
        return utility(returns_base, returns_aug)

    helps = [run(+0.5, seed) for seed in range(20)]
    hurts = [run(-0.3, seed) for seed in range(20)]
    assert sum(r.promote for r in helps) >= 16
    assert not any(r.promote for r in hurts)


# ---------------------------------------------------------------------------------------------------------------
# decide, evidence
# ---------------------------------------------------------------------------------------------------------------

def test_decide_splits_candidates_with_evidence_and_one_changelog_line():
    a, b, c = skill("open-drawer"), skill("go-north", version=2), skill("wait")
    results = {"open-drawer": utility([0, 0, 1, 0], [1, 1, 1, 0]), "go-north": utility([1, 1, 0, 1], [0, 0, 1, 0])}
    decision = decide([a, b, c], results)
    assert isinstance(decision, Decision)
    assert decision.promoted == [a] and decision.rejected == [b] and decision.pending == [c]
    assert decision.changelog_line == ("validation: promoted open-drawer v1 (u=+0.5, t=1.41); "
                                       "rejected go-north v2 (u=-0.5, t=-1.41); pending 1")
    record = decision.evidence["go-north"]
    assert record == {"skill": "go-north", "version": 2, "decision": "rejected", "u": -0.5,
                      "welch_t": round(-math.sqrt(2), 6), "n_base": 4, "n_aug": 4, "mean_base": 0.75,
                      "mean_aug": 0.25, "reason": results["go-north"].reason}
    assert decide([], {}).changelog_line == "validation: no candidates"
    with pytest.raises(ValueError, match="not candidates"):
        decide([a], {"ghost": results["open-drawer"]})


def test_evidence_round_trips_through_a_skill_file(tmp_path):
    candidate = skill("sure-thing")
    record = evidence(candidate, utility([0, 0], [1, 1]), "promoted")
    path = write_skill(tmp_path / "rejected", with_evidence(candidate, record))
    stored = read_skill(path).stats["validation"]
    assert stored == record and stored["welch_t"] == math.inf
    tiny = evidence(candidate, utility([], [1]), "rejected")
    assert tiny["u"] is None and tiny["welch_t"] is None
