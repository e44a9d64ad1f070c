"""The default prompt layout as two small functions (see agents/templates.py for the per-env templates).

``build_prompt(task, observation, history, skills_text)`` renders the default template with a raw history, which
is what the window/full context managers show; ``response_text(action)`` is ``" " + action``.
"""
from __future__ import annotations

from typing import Sequence

from agents.context import ContextView
from agents.templates import DEFAULT_TEMPLATE, render_prompt, response_text

HISTORY_TURNS_DEFAULT = 0

__all__ = ["HISTORY_TURNS_DEFAULT", "build_prompt", "response_text"]


def build_prompt(task: str, observation: str, history: Sequence[tuple[str, str]] = (), skills_text: str = "") -> str:
    """The policy's prompt for one turn; ``history`` holds earlier (observation, action) pairs, oldest first."""
    return render_prompt(DEFAULT_TEMPLATE, task, ContextView(history=tuple(history)), observation,
                         skills_text=skills_text)
