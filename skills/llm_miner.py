"""The LLM skill miner: a model writes text skills from successful trajectories, and revises a skill from failures.

This module is the part that talks to no model: trajectories rendered into prompts, the prompt templates, answer
parsing, the miner's config and the mine/revise orchestration. The writer is any ``SkillWriter``
(``complete(prompt) -> str``, skills/llm_writers.py): a teacher model behind an OpenAI-compatible endpoint
(``ChatEndpointWriter``; our gateway is one, so the policy served there works too), or the policy itself in-process
(``EngineWriter``). The prompts are template files (``skills/prompts/*.md``, ``$placeholders``) and the model must
answer::

    NAME: <lowercase-hyphenated name>
    WHEN_TO_USE: <one sentence>
    PROCEDURE:
    <numbered steps>

``parse_skill_answer`` turns that answer into a ``Skill`` or raises ``SkillAnswerError`` saying what is wrong. The
miner never drops an answer silently: ``mine_llm_skills`` and ``revise_skill`` return the reason for every answer
they could not use. A writer that cannot be reached (HTTP error, timeout, a body that is not an OpenAI response)
raises ``SkillWriterError`` (skills/llm_writers.py): that is a configuration problem for the caller, not a bad
answer. The skills returned here are candidates: they go through the same pre-storage validation as mined macros
(skills/validation.py).
"""
from __future__ import annotations

import dataclasses
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from models.checks import ConfigValueError
from skills.bank import Skill, validate_skill_name
from skills.llm_writers import SkillWriter

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
MINE_TEMPLATE = PROMPTS_DIR / "mine_skill.md"
REVISE_TEMPLATE = PROMPTS_DIR / "revise_skill.md"
MAX_NAME_LENGTH = 64


@dataclass(frozen=True)
class LLMMinerConfig:
    """params.yaml ``skills.llm``: the LLM skill miner and reviser (off by default)."""

    miner: str = ""
    """"" (off), "policy" (the round's policy writes skills), or the base URL of any OpenAI-compatible endpoint
    (e.g. the gateway, http://127.0.0.1:8000/v1)."""
    model: str = ""
    """Model name sent to the endpoint."""
    api_key_env: str = ""
    """Name of the environment variable holding the endpoint's API key (the key itself never goes in params)."""

    def __post_init__(self) -> None:
        if self.miner and self.miner != "policy" and not re.match(r"^https?://[^/\s]+", self.miner):
            raise ConfigValueError("miner", self.miner, "'', 'policy' or an http(s) base URL")
        if self.api_key_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env):
            raise ConfigValueError("api_key_env", self.api_key_env, "the NAME of an environment variable (the key "
                                   "itself never goes in params.yaml)")


MAX_OBSERVATION_CHARS = 400
"""One observation longer than this is cut (with a marker) when rendered into a prompt."""


class SkillAnswerError(ValueError):
    """A model's answer that is not a skill in the NAME / WHEN_TO_USE / PROCEDURE format; the message says why."""


# ----------------------------------------------------------------------------------------------- trajectories

@dataclass(frozen=True)
class TrajectoryText:
    """One episode as the miner shows it to a model: the task, then (observation, action) per step."""

    trajectory_id: str
    task: str
    steps: Sequence[tuple[str, str]]
    """(observation, action) per step, in order; stored as a tuple of tuples."""
    won: bool
    episode_return: float

    def __post_init__(self) -> None:
        if not isinstance(self.trajectory_id, str) or not self.trajectory_id:
            raise ValueError(f"trajectory_id must be a non-empty str, got {self.trajectory_id!r}")
        steps = tuple(tuple(step) for step in self.steps)
        for i, step in enumerate(steps):
            if len(step) != 2 or not all(isinstance(part, str) for part in step):
                raise TypeError(f"trajectory {self.trajectory_id!r}: step {i} must be (observation: str, action: str), "
                                f"got {step!r}")
        object.__setattr__(self, "steps", steps)


def _clip(text: str, limit: int) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit].rstrip() + " [...]"


def _render_one(traj: TrajectoryText, max_steps_each: int) -> str:
    """Header, task, then the steps; a long episode keeps its first and last steps (where it starts and how it ends)."""
    outcome = "won" if traj.won else "lost"
    lines = [f"### Trajectory {traj.trajectory_id} ({outcome}, return {traj.episode_return:g})", f"Task: {traj.task}"]
    indexed = list(enumerate(traj.steps, start=1))
    if len(indexed) > max_steps_each:
        head = (max_steps_each + 1) // 2
        tail = max_steps_each - head
        omitted = len(indexed) - max_steps_each
        indexed = indexed[:head] + [(0, ("", ""))] + (indexed[-tail:] if tail else [])
    else:
        omitted = 0
    for number, (observation, action) in indexed:
        if number == 0:
            lines.append(f"[... {omitted} steps omitted ...]")
            continue
        lines.append(f"Step {number}\nObservation: {_clip(observation, MAX_OBSERVATION_CHARS)}\nAction: {action}")
    return "\n".join(lines)


def _render_included(trajs: Sequence[TrajectoryText], max_steps_each: int,
                     max_chars: int) -> tuple[str, list[str]]:
    """(text, ids of the trajectories in it): whole trajectories while they fit in ``max_chars``; the first one is
    always included (cut to ``max_chars`` if it alone is longer), so a prompt never shows no evidence."""
    if max_steps_each < 1 or max_chars < 200:
        raise ValueError(f"need max_steps_each >= 1 and max_chars >= 200, got {max_steps_each} and {max_chars}")
    blocks: list[str] = []
    ids: list[str] = []
    used = 0
    for traj in trajs:
        block = _render_one(traj, max_steps_each)
        cost = len(block) + (2 if blocks else 0)
        if used + cost > max_chars:
            if blocks:
                break
            block = block[: max_chars - 12].rstrip() + "\n[... cut]"
            cost = len(block)
        blocks.append(block)
        ids.append(traj.trajectory_id)
        used += cost
    return "\n\n".join(blocks), ids


def render_trajectories(trajs: Sequence[TrajectoryText], max_steps_each: int = 12, max_chars: int = 4000) -> str:
    """Trajectories as prompt text, in the given order, at most ``max_chars`` characters (whole trajectories while
    they fit; the first is cut if it alone is too long). Episodes over ``max_steps_each`` steps keep their first and
    last steps with an ``[... n steps omitted ...]`` marker; observations are cut at MAX_OBSERVATION_CHARS."""
    return _render_included(trajs, max_steps_each, max_chars)[0]


# ----------------------------------------------------------------------------------------------- templates

_LEADING_COMMENT = re.compile(r"\A\s*<!--.*?-->\s*\n", re.DOTALL)


def load_template(path: str | Path, required: Sequence[str]) -> string.Template:
    """The prompt template in ``path`` (its leading ``<!-- ... -->`` comment removed), checked to use every
    placeholder in ``required``. ``$name`` placeholders, so braces in trajectories never matter."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"prompt template {path} missing: reinstall arlflow (skills/prompts/*.md is package "
                                "data) or point the miner at an existing template file") from None
    template = string.Template(_LEADING_COMMENT.sub("", text, count=1))
    found = {m.group("named") or m.group("braced") for m in template.pattern.finditer(template.template)}
    missing = [name for name in required if name not in found]
    if missing:
        raise ValueError(f"prompt template {path} lacks the placeholders {['$' + n for n in missing]}: the miner "
                         f"fills {['$' + n for n in required]}")
    return template


def _fill(template: string.Template, path: Path, **values: str) -> str:
    try:
        return template.substitute(values)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"prompt template {path}: {exc}: the placeholders it may use are "
                         f"{['$' + n for n in values]}; write a literal dollar sign as $$") from None


# ----------------------------------------------------------------------------------------------- parsing

_FIELD = re.compile(r"^[\s>#*_`]*(NAME|WHEN[ _-]TO[ _-]USE|PROCEDURE)[\s*_`]*:[\s*_`]*(.*)$", re.IGNORECASE)
_FENCE = re.compile(r"^\s*```")
_PLACEHOLDER = re.compile(r"^<[^<>]*>$")


def normalize_skill_name(raw: str) -> str:
    """``"Find The Key!"`` -> ``find-the-key``: lowercase, whitespace to ``-``, other invalid characters dropped,
    runs of ``-`` merged, at most MAX_NAME_LENGTH characters. May return "" (then no valid name was given)."""
    name = re.sub(r"\s+", "-", raw.strip().lower())
    name = re.sub(r"[^a-z0-9_-]", "", name)
    name = re.sub(r"-{2,}", "-", name).strip("-_")
    return name[:MAX_NAME_LENGTH].rstrip("-_")


def _fields(text: str) -> dict[str, list[str]]:
    """Lines of each field: the rest of its label line, then following lines until the next label."""
    fields: dict[str, list[str]] = {}
    current: str | None = None
    for line in text.replace("\r\n", "\n").split("\n"):
        if _FENCE.match(line):
            continue  # models like to wrap the answer in a code block
        match = _FIELD.match(line)
        key = re.sub(r"[ _-]", "_", match.group(1).upper()) if match else None
        if key is not None and key not in fields:
            current = key
            fields[key] = [match.group(2)]
        elif current is not None:
            fields[current].append(line)
    return fields


def parse_skill_answer(text: str, *, round_index: int, provenance: Sequence[str], parent: str | None = None,
                       version: int = 1) -> Skill:
    """The ``Skill`` in a model's answer (format in the module docstring); raise SkillAnswerError with the reason.

    Text before ``NAME:`` and code fences are ignored; the name is normalized (normalize_skill_name) and then must
    pass validate_skill_name. Stats are ``{"source": "llm", "round": round_index}``.
    """
    fields = _fields(text)
    missing = [label for label in ("NAME", "WHEN_TO_USE", "PROCEDURE") if label not in fields]
    if missing:
        raise SkillAnswerError(f"the answer has no {', '.join(m + ':' for m in missing)} line(s); expected "
                               "'NAME: ...', 'WHEN_TO_USE: ...', 'PROCEDURE:' then numbered steps")
    raw_name = " ".join(line.strip() for line in fields["NAME"]).strip()
    when_to_use = " ".join(" ".join(fields["WHEN_TO_USE"]).split())
    procedure = "\n".join(line.rstrip() for line in fields["PROCEDURE"]).strip()
    for label, value in (("NAME", raw_name), ("WHEN_TO_USE", when_to_use), ("PROCEDURE", procedure)):
        if not value:
            raise SkillAnswerError(f"{label} is empty")
        if _PLACEHOLDER.match(value):
            raise SkillAnswerError(f"{label} repeats the template's placeholder {value!r} instead of filling it")
    name = normalize_skill_name(raw_name)
    try:
        validate_skill_name(name)
    except ValueError as exc:
        raise SkillAnswerError(f"NAME {raw_name[:80]!r} gives no valid skill name: {exc}") from None
    return Skill(name=name, when_to_use=when_to_use, procedure=procedure, version=version, parent=parent,
                 provenance=tuple(provenance), stats={"source": "llm", "round": round_index})


# ----------------------------------------------------------------------------------------------- mining

def _unique_name(name: str, taken: set[str]) -> str:
    """``name``, or ``name-2``, ``name-3``... (cut to fit MAX_NAME_LENGTH) if it is taken."""
    if name not in taken:
        return name
    suffix = 2
    while True:
        candidate = f"{name[:MAX_NAME_LENGTH - len(str(suffix)) - 1].rstrip('-_')}-{suffix}"
        if candidate not in taken:
            return candidate
        suffix += 1


def _check_ids(trajs: Sequence[TrajectoryText], won: bool, what: str) -> None:
    ids = [t.trajectory_id for t in trajs]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValueError(f"{what}: duplicate trajectory ids {duplicates[:5]}")
    wrong = [t.trajectory_id for t in trajs if t.won != won]
    if wrong:
        raise ValueError(f"{what}: trajectories {wrong[:5]} have won={not won}; pass only "
                         f"{'won' if won else 'failed'} episodes here")


def _answer_excerpt(answer: str) -> str:
    return repr(answer[:160] + ("..." if len(answer) > 160 else ""))


def mine_llm_skills(writer: SkillWriter, successful: Sequence[TrajectoryText], *, round_index: int,
                    max_skills: int = 1, trajectories_per_prompt: int = 4, existing_names: Sequence[str] = (),
                    max_steps_each: int = 12, max_chars: int = 4000, template_path: str | Path = MINE_TEMPLATE,
                    ) -> tuple[list[Skill], list[str]]:
    """Ask ``writer`` for up to ``max_skills`` skills, one prompt per group of successful trajectories.

    Groups are deterministic whatever the input order: trajectories sorted by (highest return, fewest steps, id),
    the clearest demonstrations first, cut into consecutive groups of ``trajectories_per_prompt``. A skill's
    provenance is the ids its prompt showed (``max_chars`` may leave some of a group out). A name already in
    ``existing_names`` or mined earlier in this call gets ``-2``, ``-3``... Returns (skills, failure reasons): an
    answer that is not a skill becomes a reason, never an exception; SkillWriterError propagates.
    """
    if max_skills < 1 or trajectories_per_prompt < 1:
        raise ValueError(f"need max_skills >= 1 and trajectories_per_prompt >= 1, got {max_skills} and "
                         f"{trajectories_per_prompt}")
    _check_ids(successful, True, "mine_llm_skills")
    if not successful:
        return [], ["no successful trajectories to mine from"]
    template = load_template(template_path, ("trajectories",))
    ordered = sorted(successful, key=lambda t: (-t.episode_return, len(t.steps), t.trajectory_id))
    groups = [ordered[i:i + trajectories_per_prompt] for i in range(0, len(ordered), trajectories_per_prompt)]
    taken = set(existing_names)
    skills: list[Skill] = []
    failures: list[str] = []
    for index, group in enumerate(groups[:max_skills]):
        text, shown = _render_included(group, max_steps_each, max_chars)
        answer = writer.complete(_fill(template, Path(template_path), trajectories=text))
        try:
            skill = parse_skill_answer(answer, round_index=round_index, provenance=shown)
        except SkillAnswerError as exc:
            failures.append(f"prompt {index} (trajectories {', '.join(shown)}): unusable answer: {exc}; the answer "
                            f"began {_answer_excerpt(answer)}")
            continue
        skill = dataclasses.replace(skill, name=_unique_name(skill.name, taken))
        taken.add(skill.name)
        skills.append(skill)
    return skills, failures


def _same_text(a: str, b: str) -> bool:
    return " ".join(a.split()) == " ".join(b.split())


def revise_skill(writer: SkillWriter, skill: Skill, failing: Sequence[TrajectoryText], *, round_index: int,
                 max_steps_each: int = 12, max_chars: int = 4000,
                 template_path: str | Path = REVISE_TEMPLATE) -> tuple[Skill | None, str]:
    """A new version of ``skill`` written from ``failing`` trajectories where it was used.

    The revision keeps the name (whatever NAME the model wrote), has version ``skill.version + 1``, parent
    ``skill.name``, provenance = the failing ids the prompt showed, and stats ``{"source": "llm-revision",
    "round": round_index}``. It is a text skill: the parent's macro is not carried over, since the new procedure
    may no longer match it. Returns (revision, what was done), or (None, why not) when the answer is not a skill or
    its procedure is unchanged (whitespace aside). SkillWriterError propagates.
    """
    _check_ids(failing, False, "revise_skill")
    if not failing:
        return None, f"no failing trajectories to revise {skill.name!r} from"
    template = load_template(template_path, ("name", "when_to_use", "procedure", "trajectories"))
    text, shown = _render_included(failing, max_steps_each, max_chars)
    prompt = _fill(template, Path(template_path), name=skill.name, when_to_use=skill.when_to_use,
                   procedure=skill.procedure, trajectories=text)
    answer = writer.complete(prompt)
    try:
        parsed = parse_skill_answer(answer, round_index=round_index, provenance=shown, parent=skill.name,
                                    version=skill.version + 1)
    except SkillAnswerError as exc:
        return None, (f"revision of {skill.name!r} from trajectories {', '.join(shown)}: unusable answer: {exc}; "
                      f"the answer began {_answer_excerpt(answer)}")
    if _same_text(parsed.procedure, skill.procedure):
        return None, f"revision of {skill.name!r} from trajectories {', '.join(shown)}: the procedure is unchanged"
    revised = dataclasses.replace(parsed, name=skill.name, stats={"source": "llm-revision", "round": round_index})
    renamed = f" (the answer named it {parsed.name!r})" if parsed.name != skill.name else ""
    return revised, (f"revised {skill.name!r} v{skill.version} -> v{revised.version} from {len(shown)} failing "
                     f"trajectories{renamed}")
