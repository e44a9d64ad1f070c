"""Thompson sampling over the versions of one skill (ReSkill; docs/algorithms.md §9 "Versions by Thompson sampling").

A skill revised from failures gets a new version; which version a rollout sees is chosen within its group, so the
versions are compared on the same scenario and policy. Each version v keeps discounted evidence (S_v, F_v) and the
posterior Beta(a_v, b_v) = Beta(1 + S_v, 1 + F_v) (prior Beta(1, 1)):

- **assign** (`assign_group`): per rollout draw theta_v ~ Beta(a_v, b_v) for every active version and take the
  argmax; a group of G >= 2 must see at least 2 distinct versions (when 2 are active): while it does not, the last
  rollout holding a repeated version is redrawn among the versions the group has not seen.
- **update** (`update`): one call per group; every version's evidence is first discounted, S <- gamma S and
  F <- gamma F (gamma in [0.8, 0.99]), then each rollout adds r to S and 1 - r to F (r in [0, 1]). This is the
  discounted Thompson sampling of Raj & Kalyani 2017 ("Taming Non-stationary Bandits: A Bayesian Approach",
  arXiv:1707.09727): only the evidence decays, the Beta(1, 1) prior stays, so a, b >= 1 always and a version the
  policy has outgrown drifts back toward the prior and gets re-explored.
- **retire** (`retire`): an active version v with at least N_min uses retires when P(theta_v > theta_best) < 0.05,
  theta_best the active version (other than v) with the highest posterior mean. The probability is exact up to
  quadrature: prob_better integrates f_v(x) F_best(x) over [0, 1] with the midpoint rule (8192 cells; a, b >= 1
  keep the densities bounded), deterministic, no sampling. The version with the highest mean never retires.
- **skip** (SelSkill, "selective skill invocation"): with ``skip=True`` the pseudo-version ``"skip"`` (no skill in
  the prompt) competes like a version, so the policy also learns when not to invoke the skill; it never retires
  (it is the control arm). If every real version retires against it, the skill is a pruning candidate.

The state is a plain mapping, stored in SKILL.md stats under "versions" with to_dict / from_dict.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import numpy as np

SKIP = "skip"
"""Label of the pseudo-version "no skill in the prompt"."""
PRIOR_A = PRIOR_B = 1.0
QUADRATURE_CELLS = 8192


@dataclass(frozen=True)
class VersionConfig:
    """params.yaml ``skills.versions``: Thompson sampling over a skill's versions, and their retirement."""

    gamma: float = 0.9
    """Discount of every version's evidence at each update, in [0.8, 0.99]."""
    min_uses: int = 10
    """N_min: rollouts a version must have had before it can retire."""
    retire_below: float = 0.05
    """Retire v when P(theta_v > theta_best) is below this."""
    min_distinct: int = 2
    """Distinct versions every group must see (capped by the active versions and the group size)."""

    def __post_init__(self) -> None:
        if not 0.8 <= self.gamma <= 0.99:
            raise ValueError(f"gamma = {self.gamma} must be in [0.8, 0.99] (docs/algorithms.md §9); 0.9 forgets in ~10 groups")
        if self.min_uses < 1 or self.min_distinct < 1:
            raise ValueError(f"min_uses ({self.min_uses}) and min_distinct ({self.min_distinct}) must be >= 1")
        if not 0.0 < self.retire_below < 0.5:
            raise ValueError(f"retire_below = {self.retire_below} must be in (0, 0.5); 0.05 is the reference")


@dataclass(frozen=True)
class VersionArm:
    successes: float = 0.0
    """S: discounted sum of rewards."""
    failures: float = 0.0
    """F: discounted sum of 1 - reward."""
    uses: int = 0
    """Rollouts assigned to the version so far (not discounted)."""
    retired: bool = False

    @property
    def a(self) -> float:
        return PRIOR_A + self.successes

    @property
    def b(self) -> float:
        return PRIOR_B + self.failures

    @property
    def mean(self) -> float:
        return self.a / (self.a + self.b)


VersionState = Mapping[str, VersionArm]
"""Version label (e.g. "v1", "v2", SKIP) -> its arm; labels are the caller's."""


def new_state(labels: Sequence[str], skip: bool = False) -> dict[str, VersionArm]:
    """Fresh arms at the Beta(1, 1) prior for ``labels``, plus the SKIP pseudo-version when ``skip``."""
    state: dict[str, VersionArm] = {}
    for label in labels:
        state = add_version(state, label)
    return {**state, SKIP: VersionArm()} if skip else state


def add_version(state: VersionState, label: str) -> dict[str, VersionArm]:
    """The state with a new version (a revision) at the prior."""
    if not isinstance(label, str) or not label or label == SKIP:
        raise ValueError(f"version label {label!r} must be a non-empty str other than {SKIP!r} (reserved)")
    if label in state:
        raise ValueError(f"version {label!r} already exists; versions: {sorted(state)}")
    return {**state, label: VersionArm()}


def active(state: VersionState) -> list[str]:
    """Labels of the versions not retired, sorted (ties in a draw go to the first)."""
    return sorted(label for label, arm in state.items() if not arm.retired)


def _draw(state: VersionState, labels: Sequence[str], rng: random.Random) -> str:
    thetas = [rng.betavariate(state[label].a, state[label].b) for label in labels]
    return labels[max(range(len(labels)), key=thetas.__getitem__)]


def assign_group(state: VersionState, group_size: int, rng: random.Random,
                 cfg: VersionConfig = VersionConfig()) -> list[str]:
    """The version label of each of the group's rollouts, by Thompson sampling with the distinct-versions floor."""
    labels = active(state)
    if not labels:
        raise ValueError("every version is retired: add a revision (add_version) or prune the skill")
    picks = [_draw(state, labels, rng) for _ in range(group_size)]                  # [G]
    needed = min(cfg.min_distinct, len(labels), group_size)
    position = group_size - 1
    while len(set(picks)) < needed:
        if picks.count(picks[position]) > 1:
            picks[position] = _draw(state, [v for v in labels if v not in picks], rng)
        position -= 1
    return picks


def update(state: VersionState, outcomes: Sequence[tuple[str, float]],
           cfg: VersionConfig = VersionConfig()) -> dict[str, VersionArm]:
    """One group's outcomes [(label, reward in [0, 1])]: discount every arm's evidence once, then add them."""
    for label, reward in outcomes:
        if label not in state:
            raise ValueError(f"outcome for unknown version {label!r}; versions: {sorted(state)}")
        if not 0.0 <= reward <= 1.0:
            raise ValueError(f"reward {reward} of version {label!r} must be in [0, 1]: map returns to success "
                             "or to a [0, 1] score before updating")
    new = {label: replace(arm, successes=cfg.gamma * arm.successes, failures=cfg.gamma * arm.failures)
           for label, arm in state.items()}
    for label, reward in outcomes:
        arm = new[label]
        new[label] = replace(arm, successes=arm.successes + reward, failures=arm.failures + 1.0 - reward,
                             uses=arm.uses + 1)
    return new


def _beta_density(a: float, b: float, x: np.ndarray) -> np.ndarray:
    log_norm = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    return np.exp((a - 1.0) * np.log(x) + (b - 1.0) * np.log1p(-x) - log_norm)     # [N]


def prob_better(a1: float, b1: float, a2: float, b2: float, cells: int = QUADRATURE_CELLS) -> float:
    """P(X > Y) for independent X ~ Beta(a1, b1), Y ~ Beta(a2, b2): the integral of f_X(x) F_Y(x) over [0, 1].

    Midpoint rule on ``cells`` cells; each density is renormalized to sum to 1 on the grid, and F_Y at a midpoint
    counts half its own cell, so equal distributions give 0.5 up to rounding. For a, b in [1, 101] (gamma <= 0.99 keeps
    them there) the error is below 2e-5, far under the 0.05 retirement threshold.
    """
    if min(a1, b1, a2, b2) <= 0:
        raise ValueError(f"Beta parameters must be > 0, got ({a1}, {b1}) and ({a2}, {b2})")
    x = (np.arange(cells) + 0.5) / cells                                            # [N] midpoints
    mass_x = _beta_density(a1, b1, x)                                               # [N]
    mass_y = _beta_density(a2, b2, x)                                               # [N]
    mass_x, mass_y = mass_x / mass_x.sum(), mass_y / mass_y.sum()                   # [N] probability per cell
    cdf_y = np.cumsum(mass_y) - 0.5 * mass_y                                        # [N] F_Y at each midpoint
    return float(np.dot(mass_x, cdf_y))


def retire(state: VersionState, cfg: VersionConfig = VersionConfig()) -> tuple[dict[str, VersionArm], list[str]]:
    """Retire every active version with >= min_uses uses and P(theta_v > theta_best) < retire_below.

    All versions are judged against the same (pre-retirement) posteriors; SKIP and the version with the highest
    posterior mean never retire. Returns the new state and the labels retired now (for the changelog).
    """
    labels = active(state)
    if len(labels) < 2:
        return dict(state), []
    top = max(labels, key=lambda label: (state[label].mean, label == SKIP))
    retired = []
    for label in labels:
        arm = state[label]
        if label in (SKIP, top) or arm.uses < cfg.min_uses:
            continue
        best = state[max((v for v in labels if v != label), key=lambda v: state[v].mean)]
        if prob_better(arm.a, arm.b, best.a, best.b) < cfg.retire_below:
            retired.append(label)
    return {label: replace(arm, retired=True) if label in retired else arm for label, arm in state.items()}, retired


def best_version(state: VersionState, include_skip: bool = False) -> str | None:
    """The active version with the highest posterior mean (for evaluation without sampling); None if none."""
    labels = [v for v in active(state) if include_skip or v != SKIP]
    return max(labels, key=lambda v: state[v].mean) if labels else None


_ARM_KEYS = ("successes", "failures", "uses", "retired")


def to_dict(state: VersionState) -> dict[str, dict[str, Any]]:
    """YAML-safe copy for SKILL.md stats["versions"]; a and b are derived (1 + S, 1 + F) and not stored."""
    return {label: {"successes": float(arm.successes), "failures": float(arm.failures), "uses": int(arm.uses),
                    "retired": bool(arm.retired)} for label, arm in sorted(state.items())}


def from_dict(data: Mapping[str, Mapping[str, Any]]) -> dict[str, VersionArm]:
    """Inverse of to_dict; raises ValueError naming the version and key on a malformed entry."""
    state = {}
    for label, entry in data.items():
        if not isinstance(entry, Mapping) or set(entry) != set(_ARM_KEYS):
            raise ValueError(f"version {label!r}: need exactly the keys {list(_ARM_KEYS)}, got {entry!r}")
        arm = VersionArm(float(entry["successes"]), float(entry["failures"]), int(entry["uses"]),
                         bool(entry["retired"]))
        if arm.successes < 0 or arm.failures < 0 or arm.uses < 0:
            raise ValueError(f"version {label!r}: successes, failures and uses must be >= 0, got {entry!r}")
        state[str(label)] = arm
    return state
