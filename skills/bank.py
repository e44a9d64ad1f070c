"""The skill bank: one ``<bank>/<name>/SKILL.md`` file per skill, readable by people, versioned by DVC.

A SKILL.md file is YAML front matter between ``---`` lines, then the procedure as Markdown::

    ---
    name: seq-right-right-down
    when_to_use: When the goal is down and to the right.
    version: 1
    parent: null
    provenance: [traj-0001, traj-0007]
    stats: {support: 0.4, count: 8, length: 3}
    macro: [right, right, down]
    ---
    Move right, then right, then down.

``name``, ``when_to_use`` and ``version`` are required; the others default to empty. Reading never guesses: a
malformed file raises ``SkillFormatError`` with its path and line, and ``load_bank`` never skips one.
"""
from __future__ import annotations

import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

SKILL_FILE = "SKILL.md"
CHANGELOG_FILE = "CHANGELOG.md"
REJECTED_DIR = "rejected"  # candidates that failed validation, kept with their evidence (skills/lifecycle.py)
CANDIDATES_DIR = "candidates"  # mined candidates waiting for validation (skills/lifecycle.py)
RESERVED_DIRS = (REJECTED_DIR, CANDIDATES_DIR)
FRONT_MATTER_DELIMITER = "---"
REQUIRED_KEYS: tuple[str, ...] = ("name", "when_to_use", "version")
OPTIONAL_KEYS: tuple[str, ...] = ("parent", "provenance", "stats", "macro")
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")


class SkillFormatError(ValueError):
    """A SKILL.md file (or bank folder) that cannot be read; names the path and, where known, the line."""

    def __init__(self, path: str | Path, line: int | None, message: str) -> None:
        self.path, self.line, self.message = Path(path), line, message
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")


def validate_skill_name(name: str) -> str:
    """Return ``name`` if it is a safe folder name (``[a-z0-9][a-z0-9-_]{0,63}``), else raise ValueError."""
    if name in RESERVED_DIRS:
        raise ValueError(f"invalid skill name {name!r}: it is reserved for a bank folder ({', '.join(RESERVED_DIRS)})")
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"invalid skill name {name!r}: use 1-64 characters of a-z, 0-9, '-' and '_', "
                         f"starting with a letter or digit (no path separators, dots or spaces)")
    return name


def _plain(value: Any) -> Any:
    """Builtin YAML-safe copy of a stats value (numpy scalars and tuples become int/float/list)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalar
        return _plain(value.item())
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    raise TypeError(f"skill stats value {value!r} of type {type(value).__name__} is not YAML-safe")


@dataclass(frozen=True)
class Skill:
    name: str
    """Folder name in the bank; ``validate_skill_name`` rules."""
    when_to_use: str
    """One or two sentences: the situations the skill helps with (what retrieval matches a query against)."""
    procedure: str
    """Markdown body of SKILL.md: how to do it. Leading and trailing blank lines are dropped."""
    version: int = 1
    parent: str | None = None
    """Name of the skill this one was derived from, if any."""
    provenance: tuple[str, ...] = ()
    """Trajectory ids the skill was mined from."""
    stats: dict[str, Any] = field(default_factory=dict, hash=False)
    """Statistics, e.g. support, success_rate, uses."""
    macro: tuple[str, ...] = ()
    """Optional executable action sequence."""

    def __post_init__(self) -> None:
        validate_skill_name(self.name)
        if not isinstance(self.when_to_use, str) or not isinstance(self.procedure, str):
            raise TypeError(f"skill {self.name!r}: when_to_use and procedure must be str")
        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 1:
            raise ValueError(f"skill {self.name!r}: version must be an int >= 1, got {self.version!r}")
        if self.parent is not None:
            validate_skill_name(self.parent)
        object.__setattr__(self, "procedure", self.procedure.strip("\n"))
        object.__setattr__(self, "provenance", tuple(self.provenance))
        object.__setattr__(self, "macro", tuple(self.macro))
        object.__setattr__(self, "stats", dict(self.stats))
        for name in ("provenance", "macro"):
            if not all(isinstance(item, str) for item in getattr(self, name)):
                raise TypeError(f"skill {self.name!r}: {name} must hold only str")


# ----------------------------------------------------------------------------------------------- one file

def skill_to_text(skill: Skill) -> str:
    """The SKILL.md text of ``skill``."""
    front = {
        "name": skill.name,
        "when_to_use": skill.when_to_use,
        "version": skill.version,
        "parent": skill.parent,
        "provenance": list(skill.provenance),
        "stats": _plain(skill.stats),
        "macro": list(skill.macro),
    }
    yaml_text = yaml.safe_dump(front, sort_keys=False, allow_unicode=True, default_flow_style=None, width=120)
    if yaml.safe_load(yaml_text) != front:  # raw NEL/LS/PS characters read back as line breaks: escape all
        yaml_text = yaml.safe_dump(front, sort_keys=False, allow_unicode=False, default_flow_style=None, width=120)
    return f"{FRONT_MATTER_DELIMITER}\n{yaml_text}{FRONT_MATTER_DELIMITER}\n{skill.procedure}\n"


def _key_line(front_lines: list[str], key: str) -> int:
    """1-based file line of ``key:`` in the front matter (which starts on file line 2), else line 1."""
    for offset, line in enumerate(front_lines):
        if line.startswith(f"{key}:"):
            return offset + 2
    return 1


def _type_ok(key: str, value: Any) -> bool:
    if key in ("name", "when_to_use"):
        return isinstance(value, str)
    if key == "version":
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if key == "parent":
        return value is None or isinstance(value, str)
    if key in ("provenance", "macro"):
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if key == "stats":
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    return False


_EXPECTED_TYPE = {"name": "str", "when_to_use": "str", "version": "int >= 1", "parent": "str or null",
                  "provenance": "list of str", "macro": "list of str", "stats": "mapping with str keys"}


def skill_from_text(text: str, path: str | Path = "<string>") -> Skill:
    """Parse SKILL.md text; raise SkillFormatError naming ``path`` and the line."""
    lines = text.split("\n")
    if not lines or lines[0].rstrip("\r") != FRONT_MATTER_DELIMITER:
        raise SkillFormatError(path, 1, f"missing YAML front matter: the file must start with a "
                                        f"'{FRONT_MATTER_DELIMITER}' line")
    try:
        close = next(i for i in range(1, len(lines)) if lines[i].rstrip("\r") == FRONT_MATTER_DELIMITER)
    except StopIteration:
        raise SkillFormatError(path, 1, f"front matter opened on line 1 is never closed by a "
                                        f"'{FRONT_MATTER_DELIMITER}' line") from None
    front_lines = lines[1:close]
    try:
        front = yaml.safe_load("\n".join(front_lines))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 2 if mark is not None else 2
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SkillFormatError(path, line, f"bad YAML in front matter: {problem}") from None
    if not isinstance(front, dict):
        raise SkillFormatError(path, 2, "front matter must be a YAML mapping of keys to values")
    unknown = sorted(str(k) for k in front if k not in REQUIRED_KEYS + OPTIONAL_KEYS)
    if unknown:
        raise SkillFormatError(path, _key_line(front_lines, unknown[0]),
                               f"unknown keys {unknown}; valid keys: {', '.join(REQUIRED_KEYS + OPTIONAL_KEYS)}")
    for key in REQUIRED_KEYS:
        if key not in front:
            raise SkillFormatError(path, close + 1, f"missing required key {key!r} in front matter "
                                                    f"(required: {', '.join(REQUIRED_KEYS)})")
    for key, value in front.items():
        if not _type_ok(key, value):
            raise SkillFormatError(path, _key_line(front_lines, key),
                                   f"key {key!r} must be {_EXPECTED_TYPE[key]}, got {value!r}")
    try:
        return Skill(
            name=front["name"], when_to_use=front["when_to_use"], procedure="\n".join(lines[close + 1:]),
            version=front["version"], parent=front.get("parent"), provenance=tuple(front.get("provenance") or ()),
            stats=dict(front.get("stats") or {}), macro=tuple(front.get("macro") or ()),
        )
    except (TypeError, ValueError) as exc:
        raise SkillFormatError(path, _key_line(front_lines, "name"), str(exc)) from None


def read_skill(path: str | Path) -> Skill:
    path = Path(path)
    try:
        with open(path, encoding="utf-8", newline="") as handle:
            text = handle.read()
    except UnicodeDecodeError as exc:
        raise SkillFormatError(path, None, f"not UTF-8 text ({exc.reason})") from None
    return skill_from_text(text, path)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_skill(bank_dir: str | Path, skill: Skill) -> Path:
    """Write ``bank_dir/<name>/SKILL.md`` atomically (temporary file, then rename); return its path."""
    validate_skill_name(skill.name)
    text = skill_to_text(skill)
    folder = Path(bank_dir) / skill.name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / SKILL_FILE
    _atomic_write_text(path, text)
    return path


# ----------------------------------------------------------------------------------------------- the bank

def _skill_folders(bank: Path) -> list[Path]:
    """Skill folders of a bank; raises on anything that looks like a skill but is not readable as one."""
    folders = []
    for entry in sorted(bank.iterdir()):
        if entry.name.startswith("."):
            continue  # .gitignore, .dvc files, our own temporary files
        if not entry.is_dir() or entry.name in RESERVED_DIRS:
            continue  # CHANGELOG.md, README.md, rejected/ and candidates/ (skills.lifecycle reads them)
        try:
            validate_skill_name(entry.name)
        except ValueError as exc:
            raise SkillFormatError(entry, None, str(exc)) from None
        if not (entry / SKILL_FILE).is_file():
            raise SkillFormatError(entry, None, f"skill folder has no {SKILL_FILE}")
        folders.append(entry)
    return folders


def load_bank(bank_dir: str | Path) -> list[Skill]:
    """Every skill of the bank, sorted by name. Raises SkillFormatError on any malformed file or folder."""
    bank = Path(bank_dir)
    if not bank.is_dir():
        raise FileNotFoundError(f"skill bank {bank} missing: create it (write_bank) or point at an existing bank")
    skills = []
    for folder in _skill_folders(bank):
        skill = read_skill(folder / SKILL_FILE)
        if skill.name != folder.name:
            raise SkillFormatError(folder / SKILL_FILE, 2,
                                   f"name {skill.name!r} differs from its folder name {folder.name!r}")
        skills.append(skill)
    return sorted(skills, key=lambda s: s.name)


def write_bank(bank_dir: str | Path, skills: Iterable[Skill], changelog_line: str) -> list[Path]:
    """Make the bank hold exactly ``skills``: write their SKILL.md files, remove the folders of skills no longer
    in it, and append ``changelog_line`` to ``CHANGELOG.md``. Every file is rendered before anything changes."""
    skills = list(skills)
    if "\n" in changelog_line or "\r" in changelog_line or not changelog_line.strip():
        raise ValueError(f"changelog_line must be one non-empty line, got {changelog_line!r}")
    names = [s.name for s in skills]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"write_bank: duplicate skill names {duplicates}")
    for skill in skills:
        skill_to_text(skill)  # fails (TypeError on stats) before the bank is touched

    bank = Path(bank_dir)
    bank.mkdir(parents=True, exist_ok=True)
    stale = [f for f in _skill_folders(bank) if f.name not in set(names)]
    paths = [write_skill(bank, skill) for skill in sorted(skills, key=lambda s: s.name)]
    for folder in stale:
        shutil.rmtree(folder)
    with open(bank / CHANGELOG_FILE, "a", encoding="utf-8") as handle:
        handle.write(changelog_line.strip() + "\n")
    return paths
