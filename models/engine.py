"""Inference-engine contract: batched generation that returns the sampled token ids and their log-probs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 8
    temperature: float = 1.0   # 0.0 means greedy
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Generation:
    token_ids: list[int]       # sampled ids, eos included if generated, no padding
    logprobs: list[float]      # log pi(token | prefix) under the served policy at temperature 1, one per token
    finish_reason: str         # "stop" (eos) or "length"


class Engine(Protocol):
    policy_version: str

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Generation]: ...
