"""Bank changes with evidence: promote, reject, revise, retire and prune skills, one changelog line per change.

A bank folder holds the live skills (``<bank>/<name>/SKILL.md``), ``CHANGELOG.md`` and ``rejected/`` (candidates
that failed validation, kept with their evidence in ``stats["evidence"]`` so nobody re-mines them blindly). Each
round's bank is its own DVC-tracked folder, so every change is a new versioned state; ``CHANGELOG.md`` says what
changed and why::

    round 3: 2 live skill(s); promoted 1, rejected 1, pruned 1
    promoted macro-go-to-a-open-a v1 {"u": 0.25, "welch_t": 2.1}
    rejected seq-left-left v1 {"u": -0.12, "welch_t": -1.4}
    pruned seq-up-right v2 {"reason": "utility 0.01 < 0.05"}

Pruning (``prune_skills``) is pure: by utility (``stats["utility"]``), by disuse (``stats["last_used_round"]``) and by
a bank size limit (lowest utility first). Nothing here decides *whether* a candidate helps: skills/validation.py does.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import os
import shutil

from models.checks import check_config
from skills.bank import (CANDIDATES_DIR, CHANGELOG_FILE, REJECTED_DIR, Skill, SkillFormatError, _atomic_write_text, load_bank, read_skill,
                         skill_to_text, write_bank, write_skill)

CHANGE_VERBS: tuple[str, ...] = ("added", "promoted", "rejected", "revised", "retired", "pruned")


@dataclass(frozen=True)
class BankChange:
    """One change to a bank: what happened to which skill (version), and the evidence for it."""

    verb: str
    skill: Skill
    evidence: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.verb not in CHANGE_VERBS:
            raise ValueError(f"unknown bank change {self.verb!r}; valid: {list(CHANGE_VERBS)}")

    def line(self) -> str:
        """The changelog line: ``<verb> <name> v<version> <evidence as compact JSON>``."""
        evidence = json.dumps(self.evidence, sort_keys=True, separators=(", ", ": "), default=float)
        return f"{self.verb} {self.skill.name} v{self.skill.version} {evidence}"


def apply_changes(bank_dir: str | Path, live: Iterable[Skill], changes: Sequence[BankChange], *,
                  header: str) -> list[Path]:
    """Make ``bank_dir`` hold exactly ``live``, file every rejected skill under ``rejected/`` with its evidence, and
    append ``header`` and one line per change to the changelog. Returns the live SKILL.md paths.

    A skill cannot be both live and rejected/retired/pruned in one call (ValueError before anything is written).
    """
    live = list(live)
    live_names = {s.name for s in live}
    gone = [c for c in changes if c.verb in ("rejected", "retired", "pruned")]
    clash = sorted(c.skill.name for c in gone if c.skill.name in live_names)
    if clash:
        raise ValueError(f"skills {clash} are both kept and rejected/retired/pruned: pass each skill once")
    lines = [c.line() for c in changes]
    if any("\n" in line for line in lines):
        raise ValueError("a change's evidence renders on more than one line")
    paths = write_bank(bank_dir, live, header)
    rejected_dir = Path(bank_dir) / REJECTED_DIR
    for change in changes:
        if change.verb == "rejected":
            write_skill(rejected_dir, replace(change.skill, stats={**change.skill.stats,
                                                                   "evidence": dict(change.evidence)}))
    if lines:
        with open(Path(bank_dir) / CHANGELOG_FILE, "a", encoding="utf-8") as handle:
            handle.write("".join(line + "\n" for line in lines))
    return paths


def load_rejected(bank_dir: str | Path) -> list[Skill]:
    """The rejected candidates of a bank (with ``stats["evidence"]``); empty if there are none."""
    folder = Path(bank_dir) / REJECTED_DIR
    return load_bank(folder) if folder.is_dir() else []


@dataclass(frozen=True)
class PruneConfig:
    """params.yaml ``skills.prune``: when live skills leave the bank (`prune_skills`)."""

    min_utility: float = -0.05
    """Prune live skills whose utility estimate falls below this."""
    max_idle_rounds: int = 2
    """Prune live skills not shown in a rollout for more than this many rounds."""
    max_bank_size: int = 8
    """Most live skills; the lowest-utility ones beyond it are pruned."""

    def __post_init__(self) -> None:
        check_config(self, max_idle_rounds="non_negative", max_bank_size="non_negative")


def prune_skills(skills: Sequence[Skill], *, current_round: int, min_utility: float | None = None,
                 max_idle_rounds: int | None = None, max_size: int | None = None
                 ) -> tuple[list[Skill], list[BankChange]]:
    """(kept skills, "pruned" changes with their reason). Rules, in order: utility below ``min_utility`` (skills
    without a utility estimate are never pruned by it), unused for more than ``max_idle_rounds`` rounds (counted from
    ``stats["last_used_round"]``, else ``stats["round"]``, else never), then the lowest-utility skills beyond
    ``max_size`` (ties: the older version, then the name)."""
    if max_size is not None and max_size < 0:
        raise ValueError(f"max_size must be >= 0, got {max_size}")
    kept: list[Skill] = []
    pruned: list[BankChange] = []
    for skill in skills:
        utility = skill.stats.get("utility")
        last_used = skill.stats.get("last_used_round", skill.stats.get("round"))
        if min_utility is not None and utility is not None and float(utility) < min_utility:
            pruned.append(BankChange("pruned", skill, {"reason": f"utility {float(utility):.3g} < {min_utility:g}"}))
        elif max_idle_rounds is not None and last_used is not None and current_round - int(last_used) > max_idle_rounds:
            pruned.append(BankChange("pruned", skill, {"reason": f"unused since round {int(last_used)}"}))
        else:
            kept.append(skill)
    if max_size is not None and len(kept) > max_size:
        ranked = sorted(kept, key=lambda s: (-float(s.stats.get("utility", 0.0)), -int(s.version), s.name))
        for skill in ranked[max_size:]:
            pruned.append(BankChange("pruned", skill, {"reason": f"bank size limit {max_size}"}))
        kept = [s for s in kept if s in ranked[:max_size]]
    return kept, pruned


# ------------------------------------------------------------------------------------------- a round's bank

VERSION_PREFIX = "v"
"""Other active versions of a live skill sit next to its SKILL.md as ``v<version>.md`` (same format)."""


@dataclass
class RoundBank:
    """Everything a round's bank folder holds: live skills, their other active versions, candidates waiting for
    validation (``candidates/``), rejected candidates with their evidence (``rejected/``) and the changelog."""

    live: list[Skill] = field(default_factory=list)
    candidates: list[Skill] = field(default_factory=list)
    rejected: list[Skill] = field(default_factory=list)
    versions: dict[str, list[Skill]] = field(default_factory=dict)
    """Live skill name -> its other active versions (not the one in SKILL.md)."""
    changelog: str = ""

    def all_versions(self, name: str) -> list[Skill]:
        """Every active version of a live skill, SKILL.md's first."""
        main = [s for s in self.live if s.name == name]
        return main + list(self.versions.get(name, []))

    def known_names(self) -> set[str]:
        return {s.name for s in self.live + self.candidates + self.rejected}


def load_round_bank(bank_dir: str | Path | None) -> RoundBank:
    """The bank at ``bank_dir`` (an empty one when it is None or missing). Malformed files raise SkillFormatError."""
    if bank_dir is None or not Path(bank_dir).is_dir():
        return RoundBank()
    bank = Path(bank_dir)
    live = load_bank(bank)
    versions = {}
    for skill in live:
        files = sorted((bank / skill.name).glob(f"{VERSION_PREFIX}*.md"))
        others = [read_skill(path) for path in files]
        for path, other in zip(files, others):
            if other.name != skill.name:
                raise SkillFormatError(path, 2, f"version file of {skill.name!r} names {other.name!r}")
        if others:
            versions[skill.name] = sorted(others, key=lambda v: v.version)
    candidates = load_bank(bank / CANDIDATES_DIR) if (bank / CANDIDATES_DIR).is_dir() else []
    changelog = (bank / CHANGELOG_FILE).read_text(encoding="utf-8") if (bank / CHANGELOG_FILE).is_file() else ""
    return RoundBank(live, candidates, load_rejected(bank), versions, changelog)


def save_round_bank(bank_dir: str | Path, bank: RoundBank, changes: Sequence[BankChange], *, header: str) -> Path:
    """Write ``bank`` as a fresh folder at ``bank_dir`` (built beside it, then swapped in: a crash leaves the old
    folder or the new one, never a mix). The changelog is the previous one plus ``header`` and one line per change;
    rejected skills of ``changes`` join ``bank.rejected`` with their evidence."""
    target = Path(bank_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if bank.changelog:
        _atomic_write_text(tmp / CHANGELOG_FILE, bank.changelog if bank.changelog.endswith("\n")
                           else bank.changelog + "\n")
    for skill in bank.rejected:
        write_skill(tmp / REJECTED_DIR, skill)
    apply_changes(tmp, bank.live, changes, header=header)
    for skill in bank.candidates:
        write_skill(tmp / CANDIDATES_DIR, skill)
    live_names = {s.name for s in bank.live}
    for name, others in bank.versions.items():
        if name not in live_names:
            raise ValueError(f"versions given for {name!r}, which is not a live skill")
        for other in others:
            _atomic_write_text(tmp / name / f"{VERSION_PREFIX}{other.version}.md", skill_to_text(other))
    if target.exists():
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)
    return target
