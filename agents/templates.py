"""Prompt templates, one per env (registry ``TEMPLATES``; envs without an entry use ``DEFAULT_TEMPLATE``).

Every template renders the same compact layout, which the embedded tokenizer is trained on::

    [skills text]
    Task: <task>
    [Plan: [x] subgoal; [ ] subgoal]          (fold context only)
    [Done: summary. summary.]                 (fold context only)
    State:
    <observation of an earlier turn>
    Action: <its action>
    ...
    State:
    <current observation>
    [Actions: a | b | c]                      (templates that list admissible actions)
    Action:

The prompt ends with ``Action:`` (no trailing space); a response is ``" " + action + eos``. Templates differ in
whether they list the admissible actions (ALFWorld-style envs do; envs with a tiny fixed action set or free-form
actions do not) and, for tool envs, in how an OpenAI-format tool call maps to the env's action grammar and back.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from agents.context import ContextView
from envs.tools import tool_call_text

ToolToAction = Callable[[str, dict], "str | None"]   # (tool name, arguments) -> env action, None if unknown
ActionToTool = Callable[[str], "tuple[str, dict] | None"]


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    show_admissible: bool = False
    """List ``info["admissible_actions"]`` under the current observation."""
    max_admissible: int = 40
    """At most this many admissible actions are listed (the rest are still accepted)."""
    tool_to_action: ToolToAction | None = None
    """Tool envs: an OpenAI-format call -> the env's action string."""
    action_to_tool: ActionToTool | None = None
    """Tool envs: an env action -> (tool name, arguments), for demonstrations in the OpenAI format."""


def render_prompt(template: PromptTemplate, task: str, view: ContextView, observation: str, *,
                  admissible: Sequence[str] = (), skills_text: str = "") -> str:
    """The prompt of one turn (see the module docstring for the layout)."""
    parts = [skills_text + "\n" if skills_text else "", f"Task: {task}\n"]
    if view.plan:
        parts.append("Plan: " + "; ".join(f"[{'x' if status == 'done' else ' '}] {name}"
                                          for name, status in view.plan) + "\n")
    if view.summaries:
        parts.append("Done: " + " ".join(s if s.endswith(".") else s + "." for s in view.summaries) + "\n")
    parts.extend(f"State:\n{obs}\nAction: {action}\n" for obs, action in view.history)
    parts.append(f"State:\n{observation}\n")
    if template.show_admissible and admissible:
        parts.append("Actions: " + " | ".join(list(admissible)[: template.max_admissible]) + "\n")
    parts.append("Action:")
    return "".join(parts)


# ------------------------------------------------------------------------------------ tool grammars
_BRACKETED = re.compile(r"^\s*(\w+)\[(.*)\]\s*$", re.DOTALL)


def _bracket_tool_to_action(argument_names: dict[str, str]) -> ToolToAction:
    """``name[value]`` grammar (search_qa): tool ``name`` with its one argument ``argument_names[name]``."""

    def convert(name: str, arguments: dict) -> str | None:
        key = argument_names.get(name)
        if key is None or not isinstance(arguments.get(key), (str, int, float)):
            return None
        return f"{name}[{arguments[key]}]"

    return convert


def _bracket_action_to_tool(argument_names: dict[str, str]) -> ActionToTool:
    def convert(action: str) -> tuple[str, dict] | None:
        match = _BRACKETED.match(action)
        if not match or match.group(1) not in argument_names:
            return None
        return match.group(1), {argument_names[match.group(1)]: match.group(2)}

    return convert


def _shell_tool_to_action(name: str, arguments: dict) -> str | None:
    if name == "submit":
        return "submit"
    if name == "bash" and isinstance(arguments.get("command"), str):
        return arguments["command"]
    return None


def _shell_action_to_tool(action: str) -> tuple[str, dict] | None:
    return ("submit", {}) if action.strip() == "submit" else ("bash", {"command": action})


DEFAULT_TEMPLATE = PromptTemplate("default")
SEARCH_ARGUMENTS = {"search": "query", "answer": "answer"}
TEMPLATES: dict[str, PromptTemplate] = {
    "frozenlake": PromptTemplate("frozenlake"),
    "household": PromptTemplate("household", show_admissible=True),
    "textworld_cooking": PromptTemplate("textworld_cooking", show_admissible=True),
    "holdem": PromptTemplate("holdem", show_admissible=True),
    "countdown": PromptTemplate("countdown", show_admissible=True, max_admissible=24),
    "sokoban": PromptTemplate("sokoban"),
    "tree_search": PromptTemplate("tree_search", show_admissible=True),
    "rps": PromptTemplate("rps"),
    "search_qa": PromptTemplate("search_qa", tool_to_action=_bracket_tool_to_action(SEARCH_ARGUMENTS),
                                action_to_tool=_bracket_action_to_tool(SEARCH_ARGUMENTS)),
    "terminal": PromptTemplate("terminal", tool_to_action=_shell_tool_to_action,
                               action_to_tool=_shell_action_to_tool),
}


def template_for(env_name: str) -> PromptTemplate:
    return TEMPLATES.get(env_name, DEFAULT_TEMPLATE)


def response_text(action: str, *, tool_format: str = "text", template: PromptTemplate | None = None) -> str:
    """What a response that takes ``action`` says, before eos: ``" " + action``.

    ``tool_format="openai"`` writes a tool env's action as an OpenAI-style JSON tool call instead (``template``
    says how the env's action grammar maps to its tools). Fold tags, when used, go before the action.
    """
    if tool_format not in TOOL_FORMATS:
        raise ValueError(f"unknown tool_format {tool_format!r}; valid: {list(TOOL_FORMATS)}")
    if tool_format == "openai" and template is not None and template.action_to_tool is not None:
        call = template.action_to_tool(action)
        if call is not None:
            return " " + tool_call_text(*call)
    return " " + action


TOOL_FORMATS = ("text", "openai")


def encode_prompt(tokenizer: Any, text: str, *, chat: bool = False) -> list[int]:
    """The ids of a rendered prompt: the text itself, or with ``chat`` the tokenizer's chat template around it (one
    user message, the assistant's generation prompt appended), as a pretrained chat model expects."""
    if not chat:
        return list(tokenizer.encode(text, add_special_tokens=False))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("harness.chat_template is set but the policy's tokenizer has no chat template: set it to "
                         "false, or use a chat model (e.g. bootstrap.model: smollm2-135m-instruct)")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(t) for t in ids]
