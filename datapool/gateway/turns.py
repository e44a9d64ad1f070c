"""One turn at a time per trajectory, and whether a step extends the one before it.

A request on a trajectory that another request is still being served on is refused with 409 ``turn_in_progress``
before anything is rendered or sampled (``TurnGuard``, per gateway process), and a step is appended only if the
trajectory still has the steps its prompt was built on (``DataPool.append_step(expected_index=...)``: the same 409
when another gateway process appended meanwhile).

Refused rather than queued behind a per-trajectory lock: turn t+1 of a conversation cannot be written before turn
t's reply is known, so a concurrent turn is a client bug (a fork of the conversation) that the client should hear
about at once, not a second branch appended to the same trajectory after a wait; a refusal holds no worker thread
(N turns waiting on one lock would hold N of the thread pool's workers, so one client could stall every other);
and OpenAI SDKs retry a 409 with backoff, which under an Idempotency-Key then gets the stored response.

A step that still does not extend its predecessor (its prompt ids do not start with the previous step's prompt +
response ids: a re-sent first turn, an edited reply, a client-side context window) is recorded with
``prefix_break=True``, so layouts and curation can tell it from a prefix-consistent turn.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from datapool.gateway.errors import GatewayError
from datapool.records import StepRecord


def turn_in_progress(trajectory_id: str) -> GatewayError:
    return GatewayError(409, f"another request on trajectory {trajectory_id!r} is still being served: send a "
                             "trajectory's turns one at a time (wait for each response before the next turn); a retry "
                             "of the same request with its Idempotency-Key gets the stored response once it is done",
                        param="trajectory_id", code="turn_in_progress")


class TurnGuard:
    """The trajectory ids this gateway process is serving a request on (at most one request each)."""

    def __init__(self) -> None:
        self._busy: set[str] = set()
        self._lock = threading.Lock()

    @contextmanager
    def turn(self, trajectory_id: str | None) -> Iterator[None]:
        """Hold ``trajectory_id`` for the request; 409 turn_in_progress if another request holds it."""
        if trajectory_id is None:  # a new one-step trajectory per request (or per idempotency key)
            yield
            return
        with self._lock:
            if trajectory_id in self._busy:
                raise turn_in_progress(trajectory_id)
            self._busy.add(trajectory_id)
        try:
            yield
        finally:
            with self._lock:
                self._busy.discard(trajectory_id)


def breaks_prefix(previous: Sequence[StepRecord], prompt_ids: Sequence[int]) -> bool:
    """True when ``prompt_ids`` does not start with the last previous step's prompt_ids + response_ids (a step
    with no predecessor extends nothing and breaks nothing)."""
    if not previous:
        return False
    last = max(previous, key=lambda s: s.step_index)
    head = list(last.prompt_ids) + list(last.response_ids)
    return list(prompt_ids[: len(head)]) != head


def text_chars(value: Any) -> int:
    """Characters in the strings of a request's messages / tools / prompt (what would be rendered and tokenized)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_chars(v) for v in value)
    return 0
