"""Tool calls in OpenAI's function-call format: parse them out of a response, and build them.

A tool env (``terminal``, ``search_qa``) lists its tools as OpenAI function schemas in the class attribute
``tools`` and records each call it executes in ``info["tool_call"]`` as ``{"type": "function", "function":
{"name": ..., "arguments": <JSON string>}}`` (the contract in envs/base.py). A policy may answer either in the env's
own short action grammar (``search[alps]``) or with a JSON tool call, optionally wrapped in
``<tool_call>...</tool_call>`` (the Hermes/Qwen convention); ``parse_tool_call`` reads the latter in all the shapes
OpenAI-style runtimes emit. Pure (no Prefect, MLflow, DVC or file paths); never raises.

It lives in envs/, the lowest layer, because the format belongs to the env contract and every layer above reads it:
the harness (agents/rollout.py), the prompt templates (agents/templates.py) and the gateway (datapool/gateway/chat.py).
"""
from __future__ import annotations

import json
import re
from typing import Any

_WRAPPED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def openai_tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """``{"type": "function", "function": {"name": name, "arguments": "<JSON>"}}`` (arguments as a JSON string)."""
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments, sort_keys=True)}}


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as a policy writes it: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, sort_keys=True) + "</tool_call>"


def tool_names(tools: Any) -> list[str]:
    """Names of OpenAI function schemas (``[{"type": "function", "function": {"name": ...}}]``)."""
    names = []
    for tool in tools or ():
        function = tool.get("function", {}) if isinstance(tool, dict) else {}
        if isinstance(function.get("name"), str):
            names.append(function["name"])
    return names


def parse_tool_call(text: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of the first JSON tool call in ``text``, or None when there is none.

    Accepted shapes: ``{"name": N, "arguments": {...}}``, arguments as a JSON string, and the full OpenAI form
    ``{"type": "function", "function": {"name": N, "arguments": "..."}}``; bare or inside ``<tool_call>`` tags.
    Arguments that are not a JSON object make it no tool call.
    """
    if not isinstance(text, str) or "{" not in text:
        return None
    wrapped = _WRAPPED.search(text)
    candidate = wrapped.group(1) if wrapped else text
    start = candidate.find("{")
    if start < 0:
        return None
    try:
        obj, _ = json.JSONDecoder().raw_decode(candidate[start:])
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name, arguments = obj.get("name"), obj.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return name, arguments
