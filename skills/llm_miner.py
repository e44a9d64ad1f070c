"""The LLM skill miner: a model writes text skills from successful trajectories, and revises a skill from failures.

The writer is any ``SkillWriter`` (``complete(prompt) -> str``): a teacher model behind an OpenAI-compatible
endpoint (``ChatEndpointWriter``; our gateway is one, so the policy served there works too), or the policy itself
in-process (``EngineWriter``). The prompts are template files (``skills/prompts/*.md``, ``$placeholders``) and the
model must answer::

    NAME: <lowercase-hyphenated name>
    WHEN_TO_USE: <one sentence>
    PROCEDURE:
    <numbered steps>

``parse_skill_answer`` turns that answer into a ``Skill`` or raises ``SkillAnswerError`` saying what is wrong. The
miner never drops an answer silently: ``mine_llm_skills`` and ``revise_skill`` return the reason for every answer
they could not use. A writer that cannot be reached (HTTP error, timeout, a body that is not an OpenAI response)
raises ``SkillWriterError``: that is a configuration problem for the caller, not a bad answer. The skills returned
here are candidates: they go through the same pre-storage validation as mined macros (skills/validation.py).
"""
from __future__ import annotations

import dataclasses
import os
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import httpx

from models.engine import SamplingParams
from skills.bank import Skill, validate_skill_name

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
MINE_TEMPLATE = PROMPTS_DIR / "mine_skill.md"
REVISE_TEMPLATE = PROMPTS_DIR / "revise_skill.md"
MAX_NAME_LENGTH = 64
MAX_OBSERVATION_CHARS = 400
"""One observation longer than this is cut (with a marker) when rendered into a prompt."""


class SkillAnswerError(ValueError):
    """A model's answer that is not a skill in the NAME / WHEN_TO_USE / PROCEDURE format; the message says why."""


class SkillWriterError(RuntimeError):
    """The writer could not get an answer at all (endpoint down, HTTP error, malformed response, prompt too long)."""


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


# ----------------------------------------------------------------------------------------------- writers

class SkillWriter(Protocol):
    """Anything that answers a prompt with text; raises SkillWriterError when it cannot answer at all."""

    def complete(self, prompt: str) -> str: ...


class ChatEndpointWriter:
    """A model behind an OpenAI-compatible ``{base_url}/chat/completions`` (our gateway, vLLM, a hosted teacher).

    The API key is read from the environment variable ``api_key_env`` at every call and never stored ("" = no key).
    ``headers`` are sent with every request, e.g. ``{"X-Env": "skill-miner", "X-Round": "3"}`` so the gateway
    records the miner's calls apart from rollouts.
    """

    def __init__(self, base_url: str, model: str, api_key_env: str = "", timeout_s: float = 60,
                 max_tokens: int = 512, temperature: float = 0.0, headers: Mapping[str, str] | None = None) -> None:
        if not re.match(r"^https?://[^/\s]+", base_url or ""):
            raise ValueError(f"base_url {base_url!r} must be an http(s) URL of an OpenAI-compatible API, e.g. "
                             "http://127.0.0.1:8000/v1")
        if timeout_s <= 0 or max_tokens < 1 or not 0.0 <= temperature <= 2.0:
            raise ValueError(f"need timeout_s > 0, max_tokens >= 1 and temperature in [0, 2], got {timeout_s}, "
                             f"{max_tokens}, {temperature}")
        if any(key.lower() == "authorization" for key in (headers or {})):
            raise ValueError("do not pass Authorization in headers: name the environment variable holding the key "
                             "in api_key_env")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key_env = api_key_env
        self.timeout_s = timeout_s
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.headers = dict(headers or {})
        self._api_key()  # fail at construction, not mid-round, when the variable is missing

    def _api_key(self) -> str | None:
        if not self.api_key_env:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise SkillWriterError(f"environment variable {self.api_key_env} (api_key_env) is not set: export the "
                                   f"key of {self.url} in it, or set api_key_env='' for an endpoint without a key")
        return key

    def complete(self, prompt: str) -> str:
        """The text of the first choice for a one-message user conversation ``prompt``."""
        headers = dict(self.headers)
        key = self._api_key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": self.max_tokens, "temperature": self.temperature}
        try:
            response = httpx.post(self.url, json=body, headers=headers, timeout=self.timeout_s)
        except httpx.TimeoutException:
            raise SkillWriterError(f"no answer from {self.url} within {self.timeout_s} s: check that the server is "
                                   "up and not overloaded, or raise timeout_s") from None
        except httpx.HTTPError as exc:
            raise SkillWriterError(f"could not reach {self.url} ({type(exc).__name__}: {exc}): start the server or "
                                   "fix base_url") from None
        if response.status_code >= 400:
            hint = (f"check the key in ${self.api_key_env or '<api_key_env unset>'}"
                    if response.status_code in (401, 403) else
                    "check the model name and request size" if response.status_code < 500 else
                    "see the server's log")
            raise SkillWriterError(f"{self.url} answered HTTP {response.status_code}: "
                                   f"{_error_message(response)}: {hint}")
        try:
            payload = response.json()
        except ValueError:
            raise SkillWriterError(f"{self.url} answered HTTP {response.status_code} with a body that is not JSON "
                                   f"({response.text[:120]!r}): is base_url an OpenAI-compatible API (ending in "
                                   "/v1)?") from None
        return _first_choice_text(payload, self.url)


def _error_message(response: httpx.Response) -> str:
    """The ``error.message`` of an OpenAI-shaped error body, else the start of the body."""
    try:
        error = response.json().get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"][:300]
        if isinstance(error, str):
            return error[:300]
    except (ValueError, AttributeError):
        pass
    return repr(response.text[:200]) if response.text else "(empty body)"


def _first_choice_text(payload: Any, url: str) -> str:
    try:
        content = payload["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise SkillWriterError(f"{url} answered JSON without choices[0].message.content ({str(payload)[:160]}): is "
                               "base_url an OpenAI-compatible chat-completions API?") from None
    if not isinstance(content, str):
        raise SkillWriterError(f"{url} answered choices[0].message.content={content!r}, not text: the model must "
                               "answer in text (no tool calls)")
    return content


class EngineWriter:
    """The policy itself writes the skill: greedy decoding on a local engine (``models.engine.Engine``).

    The prompt is one user message in the tokenizer's chat template; a tokenizer without one gets the gateway's
    built-in layout (``user: <prompt><eos>\\nassistant:``), so the policy sees the same text either way.
    """

    def __init__(self, engine: Any, tokenizer: Any, max_new_tokens: int = 128, seed: int = 0) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.seed = seed

    def prompt_ids(self, prompt: str) -> list[int]:
        message = [{"role": "user", "content": prompt}]
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
        else:
            text = f"user: {prompt}{self.tokenizer.eos_token or ''}\nassistant:"
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def complete(self, prompt: str) -> str:
        ids = self.prompt_ids(prompt)
        limit = getattr(self.engine, "max_positions", None)
        if limit is not None and len(ids) + self.max_new_tokens > limit:
            raise SkillWriterError(f"the miner's prompt has {len(ids)} tokens + max_new_tokens {self.max_new_tokens} "
                                   f"> the policy's context of {limit} tokens: lower max_chars or "
                                   "trajectories_per_prompt, or use a teacher endpoint (ChatEndpointWriter)")
        sampling = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0, seed=self.seed)
        generation = self.engine.generate([ids], sampling)[0]
        return self.tokenizer.decode(generation.token_ids, skip_special_tokens=True)


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
