"""Where the gateway's generations come from: the in-process engine, or a pool of OpenAI-compatible servers.

`LocalEngineUpstream` calls the local `TransformersEngine` directly. `OpenAIUpstreamPool` (models/openai_pool.py, the
same token-in-token-out client the stages use for `engine.kind: vllm | openai`) sends each request to one of several
OpenAI-compatible servers and returns the exact ids they sampled, so the pool records the same data as the local
engine would.
"""
from __future__ import annotations

import threading

from models.engine import SamplingParams
from models.openai_pool import (STRATEGIES, TOKEN_ID_PREFIX, OpenAIUpstreamPool, Upstream, UpstreamError,  # noqa: F401
                                UpstreamRejectedError, UpstreamResponseError, UpstreamResult, UpstreamState,
                                UpstreamUnavailableError, completion_request_body, parse_completion_choice,
                                parse_completion_response)


class LocalEngineUpstream:
    """The in-process engine (models.hf_engine.TransformersEngine) behind a lock: the model is not thread-safe."""

    def __init__(self, engine, *, name: str = "local") -> None:
        self.engine = engine
        self.name = name
        self._lock = threading.Lock()

    def generate(self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1) -> list[UpstreamResult]:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        with self._lock:
            generations = self.engine.generate([list(prompt_ids)] * n, sampling)
        return [UpstreamResult(list(prompt_ids), list(g.token_ids), list(g.logprobs), g.finish_reason,
                               upstream=self.name) for g in generations]

    def health(self) -> bool:
        return True

