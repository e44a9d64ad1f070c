"""Pre-storage validation of candidate skills (docs/algorithms.md §9; the paired skill-free / skill-augmented rollouts
of SIRI and D2Skill, arXiv:2603.28716): a candidate enters the bank only if it measurably helps.

In the rollout stage, the G rollouts of a scenario that has a candidate c are split into a base half (the currently
retrieved skills R) and an augmented half (R + c) with `split_group`. The halves are paired: ``base[k]`` and
``aug[k]`` are episodes ``i`` and ``i + G//2`` of the group, and the rollout stage must run both with the same env
seed (`seed_slots` gives each episode's seed slot), so the difference between a pair is the candidate, not the
start state. Both halves still train the policy: no extra rollouts.

Then u(c) = mean R(aug) - mean R(base) with Welch's t (`utility`); c is promoted only if u > tau (0) and, when both
halves have a variance (two or more episodes each), Welch t > t_min (1). `decide` turns the results of a round into
promoted / rejected / pending lists, one evidence dict per candidate (for the skill's stats, or the rejected/
folder) and one changelog line.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Any, Mapping, NamedTuple, Sequence

from models.checks import check_config
from skills.bank import Skill

TAU = 0.0
"""Promotion threshold on u(c) (docs/algorithms.md §9)."""
T_MIN = 1.0
"""Welch t a candidate must exceed when both halves have a variance."""


@dataclass(frozen=True)
class ValidationConfig:
    """params.yaml ``skills.validation``: when a tested candidate is promoted (`utility`)."""

    tau: float = TAU
    """Promotion threshold on u(c) = mean R(aug) - mean R(base)."""
    t_min: float = T_MIN
    """Welch t a candidate must exceed (when both halves have a variance)."""

    def __post_init__(self) -> None:
        check_config(self)


def seed_slots(group_size: int) -> list[int]:
    """Env seed slot of each episode position 0..G-1 of a group: positions k and k + G//2 share slot k.

    With an odd G the last position has no partner and gets its own slot G//2 (it goes to the base half).
    """
    if group_size < 0:
        raise ValueError(f"group_size = {group_size} must be >= 0")
    half = group_size // 2
    return [k % half if half and k < 2 * half else half for k in range(group_size)]


def split_group(episode_indices: Sequence[int], seed: int) -> tuple[list[int], list[int]]:
    """Split one group's episodes into paired (base, aug) halves; ``base[k]`` and ``aug[k]`` share an env seed.

    Pair k is (episode_indices[k], episode_indices[k + G//2]); which member of a pair is augmented is a coin flip
    from ``random.Random(seed)``, so the augmented half is not always the later one (position effects, e.g. a
    scheduler that starts the first half sooner, then cannot bias u). With an odd G the last episode joins the base
    half unpaired. G < 2 gives (all, []): nothing to compare, the candidate waits for a larger group.
    """
    episodes = list(episode_indices)
    if len(set(episodes)) != len(episodes):
        raise ValueError(f"episode_indices must be distinct, got {episodes}")
    half = len(episodes) // 2
    coin = random.Random(seed)
    base, aug = [], []
    for k in range(half):
        first, second = episodes[k], episodes[k + half]
        if coin.random() < 0.5:
            first, second = second, first
        base.append(first)
        aug.append(second)
    return base + episodes[2 * half:], aug


class ValidationResult(NamedTuple):
    u: float | None
    """mean R(aug) - mean R(base); None when a half is empty."""
    welch_t: float | None
    """u / sqrt(var_aug/n_aug + var_base/n_base) with unbiased variances; None when a half has fewer than two
    episodes; +-inf (0 when u = 0) when both variances are 0 (every episode of each half scored the same)."""
    n_base: int
    n_aug: int
    promote: bool
    reason: str
    """One line saying why, with the numbers."""
    mean_base: float | None = None
    mean_aug: float | None = None


def _mean_var(values: Sequence[float]) -> tuple[float, float | None]:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, sum((v - mean) ** 2 for v in values) / (len(values) - 1)


def utility(base_returns: Sequence[float], aug_returns: Sequence[float], tau: float = TAU,
            t_min: float = T_MIN) -> ValidationResult:
    """u(c) and Welch's t of the augmented half against the base half, and whether to promote c.

    Cases, each stated in ``reason``: an empty half -> no decision possible, not promoted; u <= tau -> rejected
    (does not help); a half with one episode -> no variance, decided on u alone (docs/algorithms.md §9: Welch only "when a
    variance is available"); both variances 0 -> t = +-inf, so a deterministic improvement is promoted; otherwise
    promoted iff t > t_min, rejected as noisy when not.
    """
    base = [float(v) for v in base_returns]
    aug = [float(v) for v in aug_returns]
    n_base, n_aug = len(base), len(aug)
    if not base or not aug:
        missing = "base" if not base else "augmented"
        return ValidationResult(None, None, n_base, n_aug, False,
                                f"no {missing} rollouts: cannot measure u (needs a group of 2 or more)")
    mean_base, var_base = _mean_var(base)
    mean_aug, var_aug = _mean_var(aug)
    u = mean_aug - mean_base
    record = dict(n_base=n_base, n_aug=n_aug, mean_base=mean_base, mean_aug=mean_aug)
    if var_base is None or var_aug is None:
        welch_t = None
    else:
        se = math.sqrt(var_aug / n_aug + var_base / n_base)
        welch_t = u / se if se > 0 else (math.copysign(math.inf, u) if u != 0 else 0.0)
    if u <= tau:
        return ValidationResult(u, welch_t, promote=False, reason=f"u = {u:+.4g} <= tau {tau:g}: does not help",
                                **record)
    if welch_t is None:
        return ValidationResult(u, None, promote=True, reason=f"u = {u:+.4g} > tau {tau:g}; no variance (a half "
                                f"has one episode: n_base {n_base}, n_aug {n_aug}), decided on u alone", **record)
    if math.isinf(welch_t):
        return ValidationResult(u, welch_t, promote=True, reason=f"u = {u:+.4g} > tau {tau:g} with zero variance "
                                "in both halves (Welch t infinite)", **record)
    if welch_t > t_min:
        return ValidationResult(u, welch_t, promote=True,
                                reason=f"u = {u:+.4g} > tau {tau:g}, Welch t = {welch_t:.3g} > {t_min:g}", **record)
    return ValidationResult(u, welch_t, promote=False,
                            reason=f"u = {u:+.4g} > tau {tau:g} but Welch t = {welch_t:.3g} <= {t_min:g}: too noisy",
                            **record)


def evidence(skill: Skill, result: ValidationResult, decision: str) -> dict[str, Any]:
    """YAML-safe record of a validation (floats rounded to 6 digits; an infinite t stays a float, written .inf)."""
    def num(value: float | None) -> float | None:
        return None if value is None else (value if math.isinf(value) else round(value, 6))

    return {"skill": skill.name, "version": skill.version, "decision": decision, "u": num(result.u),
            "welch_t": num(result.welch_t), "n_base": result.n_base, "n_aug": result.n_aug,
            "mean_base": num(result.mean_base), "mean_aug": num(result.mean_aug), "reason": result.reason}


def with_evidence(skill: Skill, record: Mapping[str, Any]) -> Skill:
    """The skill with ``record`` under stats["validation"] (for bank/ or rejected/, written with write_skill)."""
    return replace(skill, stats={**skill.stats, "validation": dict(record)})


@dataclass(frozen=True)
class Decision:
    promoted: list[Skill]
    """Candidates that pass: store them (with_evidence) in the bank."""
    rejected: list[Skill]
    """Candidates that fail: keep them, with evidence, in the rejected/ folder."""
    pending: list[Skill]
    """Candidates without a result this round (no group ran them): keep them as candidates."""
    evidence: dict[str, dict[str, Any]]
    """Skill name -> evidence record, for promoted and rejected skills."""
    changelog_line: str
    """One line for write_bank, e.g. "validation: promoted a (u=+0.5, t=2.1); rejected b (u=-0.25, t=-1.3)"."""


def _short(record: Mapping[str, Any]) -> str:
    u, t = record["u"], record["welch_t"]
    u_text = "n/a" if u is None else f"{u:+.3g}"
    t_text = "n/a" if t is None else f"{t:.3g}"
    return f"{record['skill']} v{record['version']} (u={u_text}, t={t_text})"


def decide(candidates: Sequence[Skill], results: Mapping[str, ValidationResult]) -> Decision:
    """Split candidates by their ValidationResult (keyed by skill name) into promoted, rejected and pending."""
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate candidate names {sorted({n for n in names if names.count(n) > 1})}")
    unknown = sorted(set(results) - set(names))
    if unknown:
        raise ValueError(f"results for skills that are not candidates: {unknown}; candidates: {names}")
    promoted, rejected, pending, records = [], [], [], {}
    for skill in candidates:
        result = results.get(skill.name)
        if result is None:
            pending.append(skill)
            continue
        decision = "promoted" if result.promote else "rejected"
        records[skill.name] = evidence(skill, result, decision)
        (promoted if result.promote else rejected).append(skill)
    parts = [f"{kind} " + ", ".join(_short(records[s.name]) for s in group)
             for kind, group in (("promoted", promoted), ("rejected", rejected)) if group]
    if pending:
        parts.append(f"pending {len(pending)}")
    line = "validation: " + ("; ".join(parts) if parts else "no candidates")
    return Decision(promoted, rejected, pending, records, line)
