"""Inference-engine contract: batched generation that returns the sampled token ids and their log-probs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from models.checks import check_config


@dataclass(frozen=True)
class SamplingParams:
    """How an engine samples (params.yaml ``rollout.sampling``, ``evaluate.sampling``)."""

    max_new_tokens: int = 8
    """Most tokens sampled per turn (eos included); a response that hits it is flagged truncated."""
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest set of tokens whose probability reaches top_p; 1 = off."""
    seed: int | None = field(default=None, metadata={"params": False})
    """Sampling seed; the stages derive it from pipeline.seed and the round, so params.yaml cannot set it."""

    def __post_init__(self) -> None:
        check_config(self, max_new_tokens="positive", temperature="non_negative", top_p="open_probability")


@dataclass
class Generation:
    token_ids: list[int]       # sampled ids, eos included if generated, no padding
    logprobs: list[float]      # log pi(token | prefix) under the served policy at temperature 1, one per token
    finish_reason: str         # "stop" (eos) or "length"


class Engine(Protocol):
    policy_version: str

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Generation]: ...
