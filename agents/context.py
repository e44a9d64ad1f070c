"""Context managers: what of an episode's history goes into the next prompt (docs/algorithms.md section 10).

A context manager is a pure function ``(turns, history_turns) -> ContextView``, registered by name in
``CONTEXT_MANAGERS`` (the names params.yaml's ``rollout.context`` takes):

- ``full``: every earlier turn, raw.
- ``window``: the last ``history_turns`` turns, raw (``history_turns = 0``: the current observation only).
- ``fold`` (HIPIF): the plan (subgoals opened so far and their status), one-line summaries of closed subgoals, and
  the raw turns of the current subgoal only (at most ``history_turns`` of them when it is > 0). The agent opens a
  subgoal with ``<subgoal>name</subgoal>`` and closes the open one with ``<done>summary</done>``; on close its raw
  turns leave the context. ``fold_process_rewards`` scores each close against the env's own subgoal progress
  (``info["subgoals_done"]``): +alpha if progress was made while the subgoal was open, -alpha if not.

Pure module: no I/O, no engine; every rollout step records the manager's name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

OPEN_TAG = re.compile(r"<subgoal>(.*?)</subgoal>", re.DOTALL)
CLOSE_TAG = re.compile(r"<done>(.*?)</done>", re.DOTALL)
MAX_TAG_CHARS = 120  # a subgoal name or summary longer than this is cut (it would crowd out the raw turns)


@dataclass(frozen=True)
class Turn:
    """One finished turn, as a context manager sees it."""

    observation: str
    """The observation the agent acted on."""
    response: str
    """The agent's whole response text (fold tags included)."""
    action: str
    """What the turn shows as the agent's action: the parsed action, or the stripped response when invalid."""
    subgoals_done: int | None = None
    """The env's ``info["subgoals_done"]`` *before* this turn's action (None: the env has no subgoals)."""


@dataclass(frozen=True)
class ContextView:
    """What a prompt template renders besides the task and the current observation."""

    history: tuple[tuple[str, str], ...] = ()
    """Raw earlier turns shown, oldest first: (observation, action)."""
    plan: tuple[tuple[str, str], ...] = ()
    """fold: (subgoal, status) for every subgoal opened so far; status is "done" or "open"."""
    summaries: tuple[str, ...] = ()
    """fold: the summaries of the closed subgoals, oldest first."""


@dataclass(frozen=True)
class FoldTags:
    """The fold tags of one response: what it closes and opens, and the response without them."""

    closed: str | None
    opened: str | None
    rest: str


def parse_fold_tags(response: str) -> FoldTags:
    """Find ``<done>summary</done>`` and ``<subgoal>name</subgoal>`` in a response (the first of each counts).

    ``rest`` is the response with every tag removed: the text the action parser reads. Never raises.
    """
    text = response if isinstance(response, str) else ""
    closed = CLOSE_TAG.search(text)
    opened = OPEN_TAG.search(text)
    rest = OPEN_TAG.sub(" ", CLOSE_TAG.sub(" ", text))
    return FoldTags(closed=_clean(closed.group(1)) if closed else None,
                    opened=_clean(opened.group(1)) if opened else None, rest=rest)


def _clean(tag_text: str) -> str:
    return " ".join(tag_text.split())[:MAX_TAG_CHARS]


@dataclass(frozen=True)
class _Segment:
    """A subgoal's life: the turn that opened it, the turn that closed it (None while open), its summary."""

    name: str
    opened_at: int
    closed_at: int | None = None
    summary: str = ""


def fold_segments(turns: Sequence[Turn]) -> list[_Segment]:
    """Subgoal segments of an episode so far. Opening a subgoal while one is open closes that one (no summary);
    a close with nothing open is ignored."""
    segments: list[_Segment] = []
    for index, turn in enumerate(turns):
        tags = parse_fold_tags(turn.response)
        open_now = segments and segments[-1].closed_at is None
        if open_now and (tags.closed is not None or tags.opened is not None):
            last = segments[-1]
            segments[-1] = _Segment(last.name, last.opened_at, index, tags.closed or "")
        if tags.opened is not None:
            segments.append(_Segment(tags.opened, index))
    return segments


def full_context(turns: Sequence[Turn], history_turns: int = 0) -> ContextView:
    return ContextView(history=tuple((t.observation, t.action) for t in turns))


def window_context(turns: Sequence[Turn], history_turns: int = 0) -> ContextView:
    shown = turns[-history_turns:] if history_turns > 0 else ()
    return ContextView(history=tuple((t.observation, t.action) for t in shown))


def fold_context(turns: Sequence[Turn], history_turns: int = 0) -> ContextView:
    """Plan + summaries of closed subgoals + raw turns of the open subgoal (or since the last close).

    A turn whose response opens a subgoal belongs to that subgoal (its action is the subgoal's first step); a turn
    that only closes one starts the unassigned stretch after it.
    """
    segments = fold_segments(turns)
    start = 0
    if segments:
        last = segments[-1]
        start = last.opened_at if last.closed_at is None else last.closed_at
    raw = turns[start:]
    if history_turns > 0:
        raw = raw[-history_turns:]
    return ContextView(history=tuple((t.observation, t.action) for t in raw),
                       plan=tuple((s.name, "open" if s.closed_at is None else "done") for s in segments),
                       summaries=tuple(s.summary for s in segments if s.closed_at is not None and s.summary))


def fold_process_rewards(turns: Sequence[Turn], alpha: float) -> list[float]:
    """Per-turn HIPIF process reward: at the turn that closes a subgoal, +alpha if the env's ``subgoals_done`` grew
    while it was open (from before its opening turn to before the closing turn), else -alpha; 0 elsewhere.

    The closing turn's action already belongs to what comes next, so its own step is not counted. A subgoal still
    open when the episode ends is not scored (it never closed). Envs without subgoals (``subgoals_done`` None)
    give 0 everywhere.
    """
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    rewards = [0.0] * len(turns)
    for segment in fold_segments(turns):
        if segment.closed_at is None:
            continue
        before = turns[segment.opened_at].subgoals_done
        after = turns[segment.closed_at].subgoals_done
        if before is None or after is None:
            continue
        rewards[segment.closed_at] += alpha if after > before else -alpha
    return rewards


ContextManager = Callable[[Sequence[Turn], int], ContextView]
CONTEXT_MANAGERS: dict[str, ContextManager] = {"full": full_context, "window": window_context, "fold": fold_context}


def get_context_manager(name: str) -> ContextManager:
    if name not in CONTEXT_MANAGERS:
        raise KeyError(f"unknown context manager {name!r}; valid: {sorted(CONTEXT_MANAGERS)}")
    return CONTEXT_MANAGERS[name]


def expert_fold_response(action: str, subgoal_names: Sequence[str], done_before: int, open_index: int | None
                         ) -> tuple[str, int | None]:
    """The fold-tagged response an expert gives: close the open subgoal once the env's progress passed it, open the
    next unfinished one, then act. Returns (response body without the leading space, index of the open subgoal).

    ``open_index`` is the subgoal the expert has open (None at the start); ``done_before`` is the env's
    ``subgoals_done`` before this action. Subgoals are assumed to complete in order (as household and
    textworld_cooking report them).
    """
    parts: list[str] = []
    if open_index is not None and done_before > open_index:
        parts.append(f"<done>{subgoal_names[open_index]}</done>")
        open_index = None
    if open_index is None and done_before < len(subgoal_names):
        open_index = done_before
        parts.append(f"<subgoal>{subgoal_names[open_index]}</subgoal>")
    parts.append(action)
    return " ".join(parts), open_index
