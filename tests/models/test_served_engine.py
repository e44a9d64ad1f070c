"""ServedEngine without a server: how a turn's prompts become requests, and what comes back where (the live
behaviour is tests/tasks/test_vllm_engine.py)."""
from __future__ import annotations

import pytest

from models.engine import SamplingParams
from models.openai_pool import UpstreamResponseError, UpstreamResult
from models.served_engine import EngineConfig, ServedEngine, request_seed


class FakePool:
    """Answers each prompt with ids [first id, sample index] and records the requests."""

    def __init__(self, retokenized: bool = False) -> None:
        self.requests: list[tuple[list[list[int]], int, int | None]] = []
        self.retokenized = retokenized

    def generate_many(self, prompts, sampling, n=1, extra_body=None):
        self.requests.append(([list(p) for p in prompts], n, sampling.seed))
        return [[UpstreamResult(list(p), [p[0], k], [-0.5, -0.25], "length", retokenized=self.retokenized)
                 for k in range(n)] for p in prompts]

    def generate(self, prompt_ids, sampling, n=1):
        return self.generate_many([prompt_ids], sampling, n)[0]

    def close(self) -> None:
        pass


def test_identical_prompts_go_once_with_n_and_answers_come_back_in_order():
    pool = FakePool()
    engine = ServedEngine(pool, tokenizer=None, policy_version="v", prompts_per_request=2)
    prompts = [[1], [2], [1], [3], [1], [4], [2]]                 # 1 x3, 2 x2, 3 and 4 once
    out = engine.generate(prompts, SamplingParams(max_new_tokens=2, seed=9))
    assert [g.token_ids[0] for g in out] == [1, 2, 1, 3, 1, 4, 2]
    assert sorted(g.token_ids[1] for g, p in zip(out, prompts) if p == [1]) == [0, 1, 2]   # distinct samples
    shapes = sorted((n, sorted(map(tuple, ps))) for ps, n, _ in pool.requests)
    assert shapes == [(1, [(3,), (4,)]), (2, [(2,)]), (3, [(1,)])]
    seeds = [seed for _, _, seed in pool.requests]
    assert len(set(seeds)) == len(seeds) and None not in seeds
    assert engine.requests == 7 and engine.sampled_tokens == 14


def test_greedy_duplicates_are_sent_once_with_n_1_and_copied():
    pool = FakePool()
    engine = ServedEngine(pool, tokenizer=None, policy_version="v")
    out = engine.generate([[1], [2], [1]], SamplingParams(max_new_tokens=2, temperature=0.0))
    assert [(sorted(map(tuple, ps)), n) for ps, n, _ in pool.requests] == [([(1,), (2,)], 1)]  # vLLM: greedy n == 1
    assert out[0].token_ids == out[2].token_ids == [1, 0]


def test_one_request_per_prompt_gives_each_its_own_seed():
    pool = FakePool()
    engine = ServedEngine(pool, tokenizer=None, policy_version="v", prompts_per_request=1)
    engine.generate([[5], [5], [6]], SamplingParams(max_new_tokens=2, seed=3))
    assert [(ps, n) for ps, n, _ in pool.requests] == [([[5]], 1)] * 2 + [([[6]], 1)]
    assert sorted(seed for *_, seed in pool.requests) == sorted(request_seed(3, i) for i in range(3))


def test_retokenized_answers_and_empty_prompts_are_refused():
    engine = ServedEngine(FakePool(retokenized=True), tokenizer=None, policy_version="v")
    with pytest.raises(UpstreamResponseError, match="without token ids"):
        engine.generate([[1]], SamplingParams())
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], SamplingParams())


@pytest.mark.parametrize("values, message", [
    ({"kind": "vllm2"}, "kind"), ({"kind": "openai"}, "urls"), ({"urls": ("gpu1:8000",)}, "http"),
    ({"verify_tolerance": 0.0}, "verify_tolerance"), ({"prompts_per_request": 0}, "prompts_per_request"),
    ({"reload": "hot"}, "reload"), ({"dtype": "int4"}, "dtype"), ({"gpu_memory_utilization": 1.5}, "gpu_memory"),
])
def test_engine_config_rejects_bad_values(values, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**values)


class BrokenPool(FakePool):
    """Answers every prompt with an id no 100-token vocabulary has."""

    def generate_many(self, prompts, sampling, n=1, extra_body=None):
        return [[UpstreamResult(list(p), [100_000], [-0.5], "length") for _ in range(n)] for p in prompts]


class Vocab:
    def __len__(self) -> int:
        return 100


def test_invalid_upstream_output_fails_the_turn_naming_the_problem():
    engine = ServedEngine(BrokenPool(), tokenizer=Vocab(), policy_version="v")
    with pytest.raises(UpstreamResponseError, match="token id 100000 is outside the policy's vocabulary"):
        engine.generate([[1], [2]], SamplingParams(max_new_tokens=2, seed=0))
    assert engine.sampled_tokens == 0
