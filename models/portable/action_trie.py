"""Constrained action decoding: a prefix tree over the token sequences of the admissible actions.

With ``harness.action_space: admissible`` a response may only be one of the admissible actions, each as the token
sequence the policy is trained on (``tokenizer.encode(" " + action) + [eos]``, see agents/templates.response_text).
At every decode step the sampler keeps only the children of the response's node in the tree, renormalizes, and
records the log-prob under that renormalized distribution:

    log pi_c(y_t | x, y_<t) = z[y_t] - logsumexp_{v in A(y_<t)} z[v]        (A = allowed next ids, z = logits)

The trainer scores the same tokens under the same mask (``allowed_positions`` -> ``mask_logits``), so the PPO
ratio compares like with like. One module serves the local engine, the vLLM logits processor
(arlflow_action_trie.py next to it, which imports it inside vLLM's own venv: so only the standard library and
torch here) and the trainer.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

Choices = Sequence[Sequence[int]]
"""Token-id sequences, one per admissible action, each ending with eos."""


class ActionTrie:
    """The prefix tree of ``choices`` (duplicates merged). ``allowed(prefix)`` is the list of ids that may follow
    ``prefix``: [] once a whole choice was produced, None when ``prefix`` is not on any choice. Every choice ends
    with eos, so none is a proper prefix of another and a leaf is exactly the end of a choice."""

    def __init__(self, choices: Choices) -> None:
        if not choices:
            raise ValueError("constrained decoding needs at least one admissible action; this state has none "
                             "(use harness.action_space: free for envs without admissible actions)")
        self.root: dict[int, dict] = {}
        self.depth = 0
        for index, choice in enumerate(choices):
            if not choice:
                raise ValueError(f"admissible action {index} has no tokens")
            node = self.root
            for token in choice:
                node = node.setdefault(int(token), {})
            self.depth = max(self.depth, len(choice))

    def node(self, prefix: Sequence[int]) -> dict[int, dict] | None:
        node = self.root
        for token in prefix:
            node = node.get(int(token))
            if node is None:
                return None
        return node

    def allowed(self, prefix: Sequence[int]) -> list[int] | None:
        node = self.node(prefix)
        return None if node is None else list(node)


def allowed_positions(choices: Choices, response_ids: Sequence[int]) -> list[list[int]]:
    """For each response token, the ids the sampler allowed at its position (the children of the prefix before it).

    Raises ValueError when the response leaves the tree: such a step was not sampled under this constraint, and
    scoring it under the mask would give -inf."""
    trie = ActionTrie(choices)
    node = trie.root
    out: list[list[int]] = []
    for position, token in enumerate(response_ids):
        if int(token) not in node:
            raise ValueError(f"response token {position} ({int(token)}) is not allowed by the step's admissible "
                             f"actions (allowed: {sorted(node)[:8]}): the step was not sampled under this "
                             "constraint")
        out.append(list(node))
        node = node[int(token)]
    return out


def mask_logits(logits: Tensor, allowed: Tensor) -> Tensor:
    """``logits`` [..., V] with every id outside ``allowed`` [..., K] set to -inf, where a position is constrained
    (``allowed[..., 0] >= 0``; -1 pads a row's list and marks an unconstrained position). Differentiable."""
    vocab = logits.shape[-1]
    allowed = allowed.to(logits.device)
    constrained = allowed[..., 0] >= 0                                       # [...]
    if not bool(constrained.any()):
        return logits
    slots = torch.where(allowed >= 0, allowed, torch.full_like(allowed, vocab))  # [..., K] pad -> column V
    keep = torch.zeros(*logits.shape[:-1], vocab + 1, dtype=torch.bool, device=logits.device)  # [..., V + 1]
    keep.scatter_(-1, slots, True)
    keep = keep[..., :vocab] | ~constrained[..., None]                       # [..., V]
    return logits.masked_fill(~keep, float("-inf"))


def pad_allowed(lists: Sequence[Sequence[int]], width: int | None = None) -> Tensor:
    """[N, K] long tensor of N allowed-id lists, -1 padded (an empty list = an unconstrained position); K = the
    longest list unless ``width`` is given."""
    width = width or max((len(ids) for ids in lists), default=0) or 1
    out = torch.full((len(lists), width), -1, dtype=torch.long)
    for row, ids in enumerate(lists):
        if ids:
            out[row, :len(ids)] = torch.tensor(list(ids), dtype=torch.long)
    return out
