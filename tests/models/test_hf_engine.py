"""TransformersEngine: reproducibility, greedy = argmax, log-probs vs a full forward, padding invariance, stops."""
from __future__ import annotations

import pytest
import torch

from models.build import load_policy
from models.engine import SamplingParams
from models.hf_engine import TransformersEngine, sample_next


@pytest.fixture(scope="module")
def engine(tiny_policy_dir):
    model, tokenizer = load_policy(tiny_policy_dir)
    return TransformersEngine(model, tokenizer, policy_version="v0", max_batch_size=3)


@pytest.fixture(scope="module")
def prompts(engine):
    texts = ["You are in the kitchen.\n> ", "Exits: north", "> take key 14\nYou take the key. Score: 3/100.\n", "a"]
    return [engine.tokenizer(t)["input_ids"] for t in texts]


def full_forward_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)          # [P+R, V]
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[positions, torch.tensor(response)]                              # [R]


def test_same_seed_same_outputs_and_other_seed_differs(engine, prompts):
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)
    first = engine.generate(prompts, sampling)
    assert engine.generate(prompts, sampling) == first
    other = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, seed=8))
    assert [g.token_ids for g in other] != [g.token_ids for g in first]


def test_greedy_equals_argmax_of_full_forward(engine, prompts):
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0))
    for prompt, gen in zip(prompts, gens):
        ids = list(prompt)
        for token in gen.token_ids:
            with torch.no_grad():
                expected = int(engine.model(torch.tensor([ids])).logits[0, -1].argmax())
            assert token == expected
            ids.append(token)


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_new_tokens=10, temperature=1.0, seed=3),
    SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.9, seed=3),
])
def test_logprobs_match_full_forward_at_temperature_one(engine, prompts, sampling):
    gens = engine.generate(prompts, sampling)
    for prompt, gen in zip(prompts, gens):
        assert len(gen.logprobs) == len(gen.token_ids) > 0
        expected = full_forward_logprobs(engine.model, prompt, gen.token_ids)
        torch.testing.assert_close(torch.tensor(gen.logprobs), expected, atol=1e-4, rtol=0)


def test_left_padding_matches_batch_of_one(engine, prompts):
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0)
    batched = engine.generate(prompts, sampling)  # 4 prompts of different lengths, max_batch_size 3
    for prompt, gen in zip(prompts, batched):
        alone = engine.generate([prompt], sampling)[0]
        assert alone.token_ids == gen.token_ids
        torch.testing.assert_close(torch.tensor(alone.logprobs), torch.tensor(gen.logprobs), atol=1e-4, rtol=0)


def test_stops_at_eos_with_eos_included(engine, prompts):
    eos = engine.tokenizer.eos_token_id
    model = engine.model
    with torch.no_grad():  # make eos the only likely token: every row must stop after one step
        bias = torch.zeros(model.config.vocab_size)
        bias[eos] = 1e4
        hook = model.lm_head.register_forward_hook(lambda m, i, out: out + bias)
    try:
        gens = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=1.0, seed=0))
    finally:
        hook.remove()
    assert all(g.token_ids == [eos] and g.finish_reason == "stop" for g in gens)
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=3, temperature=0.0))
    assert all(g.finish_reason == "length" and len(g.token_ids) == 3 for g in gens if eos not in g.token_ids)


def test_generation_restores_training_mode_and_does_not_touch_global_rng(engine, prompts):
    engine.model.train()
    state = torch.random.get_rng_state()
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=2, seed=1))
    assert engine.model.training
    assert torch.equal(torch.random.get_rng_state(), state)
    engine.model.eval()


def test_rejects_empty_and_too_long_prompts(engine):
    assert engine.generate([], SamplingParams()) == []
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate([[1] * 250], SamplingParams(max_new_tokens=10))


def test_sampler_draws_from_the_tempered_top_p_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(20000, 1)     # [N, 4]
    generator = torch.Generator().manual_seed(0)
    ids = sample_next(logits, SamplingParams(temperature=1.0), generator)
    freq = torch.bincount(ids, minlength=4) / len(ids)
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015, rtol=0)
    # top_p 0.7 keeps {0.5, 0.3} (0.5 < 0.7 before the second): renormalized 0.625 / 0.375
    ids = sample_next(logits, SamplingParams(temperature=1.0, top_p=0.7), generator)
    freq = torch.bincount(ids, minlength=4) / len(ids)
    torch.testing.assert_close(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.015, rtol=0)
    # temperature 0.5 squares the odds: 0.25 : 0.09 : 0.0225 : 0.0025
    ids = sample_next(logits, SamplingParams(temperature=0.5), generator)
    expected = torch.tensor([0.25, 0.09, 0.0225, 0.0025])
    freq = torch.bincount(ids, minlength=4) / len(ids)
    torch.testing.assert_close(freq, expected / expected.sum(), atol=0.015, rtol=0)


def test_duplicate_prompts_are_prefilled_once_and_sample_independently(engine, prompts):
    """Three copies of one prompt and one other: one prefill row per distinct prompt, the same greedy answer and
    log-probs as alone, and (sampling) copies that may differ, each matching a full forward of what it sampled."""
    batch = [prompts[0], prompts[2], prompts[0], prompts[0]]
    calls = []
    handle = engine.model.register_forward_pre_hook(lambda _m, args, kwargs: calls.append(kwargs["input_ids"].shape),
                                                    with_kwargs=True)
    try:
        greedy = engine.generate(batch, SamplingParams(max_new_tokens=6, temperature=0.0))
    finally:
        handle.remove()
    # rows are sorted by length into chunks of max_batch_size=3: the three copies form the first chunk, whose
    # prefill runs one row; the other prompt is the second chunk
    assert calls[0][0] == 1 and calls[0][1] == len(prompts[0])
    alone = engine.generate([prompts[0]], SamplingParams(max_new_tokens=6, temperature=0.0))[0]
    for copy in (greedy[0], greedy[2], greedy[3]):
        assert copy.token_ids == alone.token_ids
        assert torch.allclose(torch.tensor(copy.logprobs), torch.tensor(alone.logprobs), atol=1e-5)
    sampled = engine.generate([prompts[0]] * 3, SamplingParams(max_new_tokens=12, temperature=1.0, seed=3))
    assert len({tuple(g.token_ids) for g in sampled}) > 1  # copies sample on their own
    for g in sampled:
        expected = full_forward_logprobs(engine.model, prompts[0], g.token_ids)
        assert torch.allclose(torch.tensor(g.logprobs), expected, atol=1e-4)
