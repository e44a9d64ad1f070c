"""Thompson sampling over skill versions (skills.versions): hand-computed discounted posteriors, the exact
P(theta_v > theta_best) against a closed form, the distinct-versions floor, convergence to the better version in a
seeded simulation, retirement, the skip pseudo-version and the serialized state."""
from __future__ import annotations

import math
import random

import pytest
import yaml

from skills.versions import (
    SKIP, VersionArm, VersionConfig, active, add_version, assign_group, best_version, from_dict, new_state,
    prob_better, retire, to_dict, update,
)


def closed_form_prob_better(a1: int, b1: int, a2: int, b2: int) -> float:
    """P(X > Y), X ~ Beta(a1, b1), Y ~ Beta(a2, b2), integer a1 (E. Miller's sum):
    sum_{i<a1} B(a2 + i, b1 + b2) / ((b1 + i) B(1 + i, b1) B(a2, b2))."""
    def log_b(x, y):
        return math.lgamma(x) + math.lgamma(y) - math.lgamma(x + y)
    return sum(math.exp(log_b(a2 + i, b1 + b2) - math.log(b1 + i) - log_b(1 + i, b1) - log_b(a2, b2))
               for i in range(a1))


def simulate(state, success, groups, seed, cfg, group_size=8, retiring=False):
    """Run `groups` groups of Bernoulli rollouts; returns the state and each group's assignment."""
    rng, env = random.Random(seed), random.Random(seed + 1000)
    history = []
    for _ in range(groups):
        picks = assign_group(state, group_size, rng, cfg)
        state = update(state, [(v, float(env.random() < success[v])) for v in picks], cfg)
        if retiring:
            state, _ = retire(state, cfg)
        history.append(picks)
    return state, history


def test_discounted_update_hand_computed():
    cfg = VersionConfig(gamma=0.9)
    state = update(new_state(["v1", "v2"]), [("v1", 1.0), ("v1", 0.0), ("v2", 1.0)], cfg)
    assert (state["v1"].a, state["v1"].b, state["v1"].uses) == (2.0, 2.0, 2)   # Beta(1 + 1, 1 + 1)
    assert (state["v2"].a, state["v2"].b, state["v2"].uses) == (2.0, 1.0, 1)
    state = update(state, [("v1", 1.0)], cfg)
    # v1: S = 0.9 * 1 + 1 = 1.9, F = 0.9 * 1 = 0.9 -> Beta(2.9, 1.9); v2 decays too: S = 0.9 -> Beta(1.9, 1)
    assert state["v1"].a == pytest.approx(2.9) and state["v1"].b == pytest.approx(1.9) and state["v1"].uses == 3
    assert state["v2"].a == pytest.approx(1.9) and state["v2"].b == pytest.approx(1.0) and state["v2"].uses == 1
    # without the discount the same data would give Beta(3, 2): the posterior mean differs (0.6 vs 2.9/4.8)
    assert state["v1"].mean == pytest.approx(2.9 / 4.8)
    partial = update(new_state(["v1"]), [("v1", 0.25)], cfg)                     # fractional rewards
    assert (partial["v1"].a, partial["v1"].b) == (1.25, 1.75)
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        update(state, [("v1", 1.5)], cfg)
    with pytest.raises(ValueError, match="unknown version"):
        update(state, [("v9", 1.0)], cfg)
    with pytest.raises(ValueError, match="gamma"):
        VersionConfig(gamma=0.5)


@pytest.mark.parametrize("params", [(1, 1, 1, 1), (2, 1, 1, 1), (3, 5, 5, 3), (1, 11, 8, 3), (40, 20, 30, 25)])
def test_prob_better_matches_closed_form(params):
    assert prob_better(*params) == pytest.approx(closed_form_prob_better(*params), abs=2e-5)


def test_prob_better_hand_computed():
    assert prob_better(2, 1, 1, 1) == pytest.approx(2 / 3, abs=1e-6)   # integral of 2x * x over [0, 1]
    assert prob_better(4.5, 2.5, 4.5, 2.5) == pytest.approx(0.5, abs=1e-12)  # equal posteriors: 1/2 by symmetry
    assert prob_better(101, 1, 100, 2) == pytest.approx(0.7512437811, abs=2e-5)  # the sharpest gamma-0.99 case


def test_every_group_sees_two_distinct_versions():
    # v1 is overwhelmingly better: pure Thompson sampling would give it all 8 rollouts
    state = {"v1": VersionArm(successes=90.0, failures=0.0), "v2": VersionArm(successes=0.0, failures=90.0),
             "v3": VersionArm(successes=0.0, failures=90.0)}
    rng = random.Random(3)
    for _ in range(50):
        picks = assign_group(state, 8, rng)
        assert len(set(picks)) == 2 and picks.count("v1") == 7
    assert set(assign_group(state, 8, rng, VersionConfig(min_distinct=3))) == {"v1", "v2", "v3"}
    assert len(assign_group(state, 1, rng)) == 1                          # a group of one cannot hold two
    assert set(assign_group(new_state(["only"]), 4, rng)) == {"only"}     # nor can one version
    with pytest.raises(ValueError, match="every version is retired"):
        assign_group({"v1": VersionArm(retired=True)}, 4, rng)


def test_thompson_sampling_converges_to_the_better_version():
    cfg = VersionConfig(gamma=0.9)
    state, history = simulate(new_state(["v1", "v2"]), {"v1": 0.4, "v2": 0.7}, groups=150, seed=0, cfg=cfg)
    late = [v for picks in history[-50:] for v in picks]
    assert late.count("v2") / len(late) >= 0.75          # 7 of 8 is the most the floor allows
    assert state["v2"].uses > 4 * state["v1"].uses
    assert state["v2"].mean > state["v1"].mean and best_version(state) == "v2"
    assert all(len(set(picks)) == 2 for picks in history)


def test_retirement_fires_for_a_clearly_worse_version_only_after_min_uses():
    cfg = VersionConfig(gamma=0.9, min_uses=10)
    state, history = simulate(new_state(["good", "bad"]), {"good": 0.9, "bad": 0.1}, groups=40, seed=1, cfg=cfg,
                              retiring=True)
    assert state["bad"].retired and not state["good"].retired and active(state) == ["good"]
    assert state["bad"].uses >= cfg.min_uses
    assert set(history[-1]) == {"good"}                  # one active version: the floor no longer applies
    # the same evidence below min_uses retires nothing; a version on top never retires
    few = {"good": VersionArm(successes=9.0, failures=1.0, uses=10), "bad": VersionArm(failures=9.0, uses=9)}
    assert retire(few, cfg)[1] == []
    assert retire({**few, "bad": VersionArm(failures=9.0, uses=10)}, cfg)[1] == ["bad"]
    assert prob_better(1.0, 10.0, 10.0, 2.0) < 0.05      # the probability that triggered it
    close = {"a": VersionArm(successes=6.0, failures=4.0, uses=50), "b": VersionArm(5.0, 5.0, uses=50)}
    assert retire(close, cfg)[1] == []                   # P(b > a) ~ 0.33: too close to call


def test_skip_pseudo_version_competes_and_never_retires():
    cfg = VersionConfig(gamma=0.9, min_uses=5)
    state = new_state(["v1"], skip=True)
    assert set(state) == {"v1", SKIP}
    state, history = simulate(state, {"v1": 0.1, SKIP: 0.8}, groups=60, seed=2, cfg=cfg, retiring=True)
    assert state["v1"].retired and not state[SKIP].retired   # the skill hurts: only "skip" is left
    assert best_version(state) is None and best_version(state, include_skip=True) == SKIP
    weak_skip = {"v1": VersionArm(9.0, 1.0, uses=10), SKIP: VersionArm(0.0, 9.0, uses=10)}
    assert retire(weak_skip, cfg)[1] == []                   # skip is the control arm
    assert SKIP not in new_state(["v1"])
    with pytest.raises(ValueError, match="reserved"):
        add_version(state, SKIP)
    with pytest.raises(ValueError, match="already exists"):
        add_version(state, "v1")


def test_state_round_trips_through_yaml_and_rejects_bad_entries():
    cfg = VersionConfig(gamma=0.85)
    state = update(add_version(new_state(["v1"], skip=True), "v2"), [("v1", 1.0), ("v2", 0.5), (SKIP, 0.0)], cfg)
    state, _ = retire({**state, "v0": VersionArm(0.0, 20.0, uses=30)}, cfg)
    text = yaml.safe_dump({"versions": to_dict(state)})
    assert from_dict(yaml.safe_load(text)["versions"]) == state
    assert state["v0"].retired
    with pytest.raises(ValueError, match="need exactly the keys"):
        from_dict({"v1": {"successes": 1.0}})
    with pytest.raises(ValueError, match=">= 0"):
        from_dict({"v1": {"successes": -1.0, "failures": 0.0, "uses": 0, "retired": False}})
