"""Server-sent events for ``stream: true``, built from a response that is already committed.

The engine is not incremental, so a stream starts after the whole response is sampled and recorded (the
gateway's rule: nothing reaches a client before its step is durable). Chunks follow OpenAI's and vLLM's shapes:
a role chunk, one chunk per sampled token (its text delta, and its id in ``token_ids`` with ``return_token_ids``;
``prompt_token_ids`` rides on the first chunk), tool calls in one chunk, a finish chunk, an optional usage chunk,
then ``data: [DONE]``.
"""
from __future__ import annotations

import json
from typing import Iterator

from datapool.gateway.chat import ChatRenderer


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def token_deltas(renderer: ChatRenderer, token_ids: list[int], text: str) -> list[tuple[str, list[int]]]:
    """(text delta, ids) pieces whose texts concatenate to ``text``: one per token, except that tokens holding
    part of a multi-byte character wait for the rest of it. One piece with everything if they would not add up."""
    pieces: list[tuple[str, list[int]]] = []
    pending: list[int] = []
    for token_id in token_ids:
        pending.append(token_id)
        piece = renderer.decode(pending)
        if piece.endswith("\ufffd"):
            continue
        pieces.append((piece, pending))
        pending = []
    if pending:
        pieces.append((renderer.decode(pending), pending))
    if "".join(p for p, _ in pieces) != text:
        return [(text, list(token_ids))]
    return pieces


def sse_events(response: dict, renderer: ChatRenderer, *, chat: bool, return_token_ids: bool,
               include_usage: bool) -> Iterator[bytes]:
    base = {"id": response["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": response["created"], "model": response["model"]}
    first = True
    for choice in response["choices"]:
        index = choice["index"]
        ids = choice.get("token_ids", [])
        extra = {"trajectory_id": choice["trajectory_id"]} if "trajectory_id" in choice else {}

        def chunk(delta_or_text, *, finish=None, token_ids=None):
            nonlocal first
            body = ({"index": index, "delta": delta_or_text, "logprobs": None, "finish_reason": finish, **extra}
                    if chat else
                    {"index": index, "text": delta_or_text, "logprobs": None, "finish_reason": finish, **extra})
            if return_token_ids and token_ids is not None:
                body["token_ids"] = token_ids
            payload = {**base, "choices": [body]}
            if first and return_token_ids:
                payload["prompt_token_ids"] = response["prompt_token_ids"]
            first = False
            return _event(payload)

        if chat:
            message = choice["message"]
            yield chunk({"role": "assistant", "content": ""}, token_ids=[])
            calls = message.get("tool_calls") or []
            content = message.get("content") or ""
            if calls:
                if content:
                    yield chunk({"content": content}, token_ids=[])
                yield chunk({"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}, token_ids=ids)
            else:
                for piece, piece_ids in token_deltas(renderer, ids, content):
                    yield chunk({"content": piece}, token_ids=piece_ids)
            yield chunk({}, finish=choice["finish_reason"], token_ids=[])
        else:
            for piece, piece_ids in token_deltas(renderer, ids, choice["text"]):
                yield chunk(piece, token_ids=piece_ids)
            yield chunk("", finish=choice["finish_reason"], token_ids=[])
    if include_usage:
        yield _event({**base, "choices": [], "usage": response["usage"]})
    yield b"data: [DONE]\n\n"
