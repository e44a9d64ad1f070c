"""vLLM logits processor for arlflow's constrained action decoding (harness.action_space: admissible).

Loaded inside vLLM's own venv by the servers arlflow manages (``--logits-processors
arlflow_action_trie:ActionTrieLogitsProcessor``, with this folder alone on PYTHONPATH; the servers
also get ``--logprobs-mode processed_logprobs``, so the returned log-probs are those of the masked, renormalized
distribution, the same as the local engine's and the trainer's). A request opts in with
``vllm_xargs={"arlflow_action_choices": "<JSON list of token-id lists>"}``; every sequence of that request (n > 1
included) then samples only along the prefix tree of those lists (action_trie.py here, shared with the local
engine and the trainer). Requests without the key are untouched.
"""
from __future__ import annotations

import json

import torch

from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from action_trie import ActionTrie, mask_logits, pad_allowed   # this folder is on the server's PYTHONPATH

XARG = "arlflow_action_choices"


def _parse_choices(params: SamplingParams) -> ActionTrie | None:
    raw = (params.extra_args or {}).get(XARG)
    if raw is None:
        return None
    choices = json.loads(raw) if isinstance(raw, str) else raw
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, list) and c and all(isinstance(t, int) for t in c) for c in choices)):
        raise ValueError(f"vllm_xargs.{XARG} must be a JSON list of non-empty token-id lists")
    return ActionTrie(choices)


class ActionTrieLogitsProcessor(LogitsProcessor):
    """Masks each opted-in request's logits to the children of its output's node in its action tree."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        _parse_choices(sampling_params)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.rows: dict[int, tuple[ActionTrie, list[int]]] = {}   # batch index -> (tree, live output ids)

    def is_argmax_invariant(self) -> bool:
        return False   # it changes what greedy picks

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update,
                             lambda params, _prompt, output: None if (t := _parse_choices(params)) is None
                             else (t, output))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        lists: list[list[int]] = [[] for _ in range(logits.shape[0])]
        for index, (trie, output) in self.rows.items():
            if index < len(lists):
                allowed = trie.allowed(output)
                lists[index] = allowed if allowed else []   # off the tree or complete: leave the row free
        return mask_logits(logits, pad_allowed(lists).to(logits.device))
