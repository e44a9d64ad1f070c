"""Chat messages -> prompt token ids, and generated text -> an OpenAI assistant message with ``tool_calls``.

Rendering uses the tokenizer's chat template (tools passed through it), or, for tokenizers without one, a small
built-in template::

    [system: <tool instructions and JSON schemas><eos>\\n]
    <role>: <content and tool calls><eos>\\n      (one per message)
    assistant:                                    (the generation prompt)

Prefix consistency: a multi-turn agent resends the whole conversation every turn. Re-tokenizing it would change
the ids of earlier turns (BPE merges across the boundary, and the template's rendering of the assistant turn is
not what the model sampled), and the trainer would compute log-probs of tokens the policy never produced. So when
turn t+1's messages are turn t's messages + the reply the gateway returned + new messages, its prompt ids are
turn t's prompt ids + turn t's response ids + the ids of only the rendered suffix (the template's end-of-turn text
the model did not produce, then the new messages and the generation prompt). A step's ``anchor`` is a hash of its
canonical rendering, which is how a later turn finds the turn it extends (also after a gateway restart).

Control-token text in client strings (``<|im_end|>`` typed in a message) is tokenized as text, never as the control
id: every client string is marked before rendering and the rendering tokenized piecewise (``control_tokens``).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from datapool.gateway.control_tokens import ControlTokenError, ControlTokens
from datapool.records import StepRecord
from envs.tools import parse_tool_call, tool_call_text

_TOOL_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)
_SENTINEL = "\u2063arlflow-reply\u2063"
TOOLS_PREAMBLE = ("You can call these tools. To call one, answer "
                  '<tool_call>{"name": <tool name>, "arguments": {...}}</tool_call>. Tools: ')


class ChatInputError(ValueError):
    """The messages cannot be rendered (unsupported content, a template error); the request gets a 400."""


def message_text(content: Any) -> str:
    """Text of an OpenAI message ``content``: a string, None, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ChatInputError(f"content part {i} has type {part.get('type')!r}: only text parts are supported")
        texts.append(part["text"])
    return "".join(texts)


def _arguments(arguments: Any) -> dict:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) and arguments.strip() else {}
    except ValueError:
        return {"_raw": arguments}
    return parsed if isinstance(parsed, dict) else {"_raw": arguments}


def anchor_of(canonical_prompt: str) -> str:
    return hashlib.sha256(canonical_prompt.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class ChatPrompt:
    prompt_ids: list[int]
    prompt_text: str          # the text of prompt_ids (reused turns keep the model's own response text)
    anchor: str               # hash of the canonical rendering of the messages
    observation: str          # the messages after the last assistant turn (what this step responds to)
    extends_step: int | None  # the step whose prompt + response this prompt starts with, if any


class ChatRenderer:
    """Renders OpenAI chat messages with a tokenizer's chat template (or the built-in one) and tokenizes them."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.eos_text = tokenizer.eos_token or ""
        self.special_ids = set(tokenizer.all_special_ids)
        self.control = ControlTokens(tokenizer, tokenizer.chat_template if self.has_template else None)

    # -- text

    def render(self, messages: Sequence[dict], tools: list[dict] | None, *, add_generation_prompt: bool) -> str:
        """The text the template renders for ``messages`` (and ``tools``)."""
        control = self.control
        return control.unmark(self._render(control.mark(list(messages)), control.mark(tools) if tools else None,
                                           add_generation_prompt=add_generation_prompt))

    def _render(self, messages: Sequence[dict], tools: list[dict] | None, *, add_generation_prompt: bool) -> str:
        """The rendering of marked messages and tools (control-token text they hold stays marked)."""
        if self.has_template:
            try:
                return self.tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=False,
                                                          add_generation_prompt=add_generation_prompt)
            except Exception as exc:  # jinja raises its own error types (e.g. "roles must alternate")
                raise ChatInputError(f"the model's chat template rejected the messages: {exc}") from exc
        # JSON is dumped from the unmarked values and marked again: json.dumps would escape the markers
        control = self.control
        parts = []
        if tools:
            schemas = [tool.get("function", tool) for tool in control.unmark_value(tools)]
            parts.append(f"system: {TOOLS_PREAMBLE}{control.mark(json.dumps(schemas, separators=(',', ':')))}"
                         f"{self.eos_text}\n")
        for message in messages:
            text = message_text(message.get("content"))
            for call in control.unmark_value(message.get("tool_calls") or ()):
                function = call.get("function", {})
                text += control.mark(tool_call_text(function.get("name", ""),
                                                    _arguments(function.get("arguments", {}))))
            parts.append(f"{message['role']}: {text}{self.eos_text}\n")
        if add_generation_prompt:
            parts.append("assistant:")
        return "".join(parts)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` with its control-token text as control ids (a completion prompt is the model's input)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _encode_marked(self, rendered: str) -> list[int]:
        try:
            return self.control.encode(rendered)
        except ControlTokenError as exc:
            raise ChatInputError(str(exc)) from exc

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- prompts

    def build_prompt(self, messages: list[dict], tools: list[dict] | None,
                     previous_steps: Sequence[StepRecord] = (), *, parse_tools: bool = True) -> ChatPrompt:
        """Prompt ids of ``messages``; prefix-consistent with the step they extend, if one of ``previous_steps``
        rendered exactly ``messages`` up to their last assistant message and that message is its reply. Rendering
        and extension run on the marked messages (``ControlTokens.mark``); ``prompt_text`` is unmarked."""
        last_reply = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        observation = "\n".join(message_text(m.get("content")) for m in messages[(last_reply or -1) + 1:])
        messages, tools = self.control.mark(list(messages)), self.control.mark(tools) if tools else None
        canonical = self._render(messages, tools, add_generation_prompt=True)  # marked: anchors tell typed control text
        if last_reply is not None and previous_steps:
            extended = self._extend(messages, tools, last_reply, canonical, previous_steps, parse_tools)
            if extended is not None:
                step, suffix = extended
                return ChatPrompt(
                    prompt_ids=list(step.prompt_ids) + list(step.response_ids) + self._encode_marked(suffix),
                    prompt_text=(step.prompt_text + self.decode(step.response_ids, skip_special_tokens=False)
                                 + self.control.unmark(suffix)),
                    anchor=anchor_of(canonical), observation=observation, extends_step=step.step_index)
        return ChatPrompt(self._encode_marked(canonical), self.control.unmark(canonical), anchor_of(canonical),
                          observation, None)

    def _extend(self, messages, tools, j: int, canonical: str, previous_steps, parse_tools: bool):
        head_anchor = anchor_of(self._render(messages[:j], tools, add_generation_prompt=True))
        step = next((s for s in reversed(previous_steps) if s.anchor == head_anchor), None)
        if step is None:
            return None
        with_reply = self._render(messages[: j + 1], tools, add_generation_prompt=False)
        content, calls = assistant_reply(step.response_text, head_anchor, parse_tools=parse_tools and bool(tools))
        returned = self.control.mark({"role": "assistant", "content": content,
                                      **({"tool_calls": calls} if calls else {})})
        if self._render([*messages[:j], returned], tools, add_generation_prompt=False) != with_reply:
            return None  # the client changed the reply: the model did not produce this conversation
        if not canonical.startswith(with_reply):
            return None
        closing = self._closing(messages[:j], tools)
        if step.response_ids and step.response_ids[-1] in self.special_ids:
            produced = self.decode(step.response_ids[-1:], skip_special_tokens=False)
            if closing.startswith(produced):  # the model already sampled the end-of-turn token
                closing = closing[len(produced):]
        return step, closing + canonical[len(with_reply):]

    def _closing(self, head: list[dict], tools) -> str:
        """The text a template writes after an assistant message's content (e.g. ``<|im_end|>\\n``)."""
        rendered = self._render([*head, {"role": "assistant", "content": _SENTINEL}], tools,
                                add_generation_prompt=False)
        at = rendered.rfind(_SENTINEL)
        return rendered[at + len(_SENTINEL):] if at >= 0 else ""


def tool_call_id(anchor: str, text: str, index: int) -> str:
    """Deterministic, so the reply the gateway returned can be re-derived to check a later turn's history."""
    return "call_" + hashlib.sha256(f"{anchor}\0{text}\0{index}".encode()).hexdigest()[:24]


def assistant_reply(text: str, anchor: str, *, parse_tools: bool) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of the assistant message for generated ``text``.

    With tools enabled, every ``<tool_call>{...}</tool_call>`` block (or one bare JSON call) that
    ``envs.tools.parse_tool_call`` accepts becomes an OpenAI tool call and is cut from the content.
    """
    if not parse_tools:
        return text, []
    calls, content = [], text
    blocks = list(_TOOL_BLOCK.finditer(text))
    if blocks:
        parsed = [(m, parse_tool_call(m.group(0))) for m in blocks]
        found = [(m, call) for m, call in parsed if call is not None]
        for m, _ in reversed(found):
            content = content[: m.start()] + content[m.end():]
        calls = [call for _, call in found]
    else:
        call = parse_tool_call(text)
        if call is not None:
            calls, content = [call], text[: text.find("{")]
    tool_calls = [{"id": tool_call_id(anchor, text, i), "type": "function",
                   "function": {"name": name, "arguments": json.dumps(arguments, sort_keys=True)}}
                  for i, (name, arguments) in enumerate(calls)]
    if tool_calls:
        content = content.strip() or None
    return content, tool_calls
