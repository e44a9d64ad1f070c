"""Prompt templates of the agent harness.

The embedded tokenizer is trained on these strings, so the layout is stable and compact::

    [skills text]
    Task: <task>
    State:
    <observation of an earlier turn>
    Action: <its action>
    ...
    State:
    <current observation>
    Action:

The prompt ends with ``Action:`` (no trailing space); a response is ``" " + action word + eos``.
"""
from __future__ import annotations

from typing import Sequence

HISTORY_TURNS_DEFAULT = 0


def build_prompt(task: str, observation: str, history: Sequence[tuple[str, str]] = (), skills_text: str = "") -> str:
    """The policy's prompt for one turn; ``history`` holds earlier (observation, action) pairs, oldest first."""
    parts = [skills_text + "\n" if skills_text else "", f"Task: {task}\n"]
    parts.extend(f"State:\n{obs}\nAction: {action}\n" for obs, action in history)
    parts.append(f"State:\n{observation}\nAction:")
    return "".join(parts)


def response_text(action: str) -> str:
    """The text of a response that takes ``action`` (what expert demonstrations train on, before eos)."""
    return " " + action
