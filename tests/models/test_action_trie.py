"""Constrained action decoding (harness.action_space: admissible): the prefix tree, the local engine's masked
sampling, the trainer scoring under the same mask (PPO ratio and behaviour log-probs agree), the served engine's
request shape, and the rollout loop recording each step's mask source."""
from __future__ import annotations

import math

import pytest
import torch

from agents.rollout import action_choices, run_episodes
from envs.scenarios import make_scenarios
from models.batching import TrainRow, UpdateConfig, collate
from models.build import load_policy
from models.ds_engine import OptimizerConfig, make_ds_engine
from models.engine import SamplingParams
from models.forward import token_logprobs
from models.hf_engine import TransformersEngine
from models.losses import LossConfig
from models.openai_pool import UpstreamResponseError, UpstreamResult
from models.portable.action_trie import ActionTrie, allowed_positions, mask_logits, pad_allowed
from models.served_engine import ServedEngine, local_logprobs
from models.trainer import rl_update

ACTIONS = ["go north", "go east", "take key 7", "look", "take lamp"]


@pytest.fixture(scope="module")
def policy(tiny_policy_dir):
    return load_policy(tiny_policy_dir)


def choices_of(tokenizer, actions=ACTIONS):
    return action_choices(tokenizer, actions, cache={})


def test_trie_allows_exactly_the_children_and_rejects_off_tree_responses():
    trie = ActionTrie([[5, 6, 0], [5, 7, 0], [9, 0], [5, 6, 0]])
    assert sorted(trie.allowed([])) == [5, 9] and sorted(trie.allowed([5])) == [6, 7]
    assert trie.allowed([5, 6, 0]) == [] and trie.allowed([6]) is None
    assert allowed_positions([[5, 6, 0], [9, 0]], [5, 6, 0]) == [[5, 9], [6], [0]]
    with pytest.raises(ValueError, match="not allowed"):
        allowed_positions([[5, 6, 0], [9, 0]], [5, 9])
    with pytest.raises(ValueError, match="at least one admissible action"):
        ActionTrie([])


def test_mask_logits_keeps_allowed_ids_leaves_free_rows_and_has_finite_gradients():
    logits = torch.randn(3, 10, requires_grad=True)
    allowed = pad_allowed([[2, 7], [], [4]])                                # row 1 unconstrained
    masked = mask_logits(logits, allowed)
    assert torch.isfinite(masked[0, [2, 7]]).all() and torch.isinf(masked[0]).sum() == 8
    assert torch.equal(masked[1], logits[1]) and torch.isinf(masked[2]).sum() == 9
    logp = torch.log_softmax(masked, dim=-1)
    assert math.isclose(float(logp[2, 4].detach()), 0.0, abs_tol=1e-6)               # one choice: probability 1
    logp[:, [2, 4]].sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_local_engine_samples_only_admissible_actions_with_renormalized_logprobs(policy):
    model, tokenizer = policy
    engine = TransformersEngine(model, tokenizer, policy_version="p")
    choices = choices_of(tokenizer)
    prompt = tokenizer.encode("You are in the kitchen (room 3). Exits: north, east.\n>", add_special_tokens=False)
    generations = engine.generate([prompt] * 64, SamplingParams(max_new_tokens=12, temperature=1.0, seed=4),
                                  choices=[choices] * 64)
    free = engine.generate([prompt] * 64, SamplingParams(max_new_tokens=12, temperature=1.0, seed=4))
    texts = {tokenizer.decode(g.token_ids, skip_special_tokens=True).strip() for g in generations}
    assert texts <= set(ACTIONS) and len(texts) >= 3                         # random weights: several actions
    assert all(g.finish_reason == "stop" for g in generations)
    assert not {tokenizer.decode(g.token_ids, skip_special_tokens=True).strip() for g in free} <= set(ACTIONS)
    for g in generations[:8]:
        expected = local_logprobs(model, prompt, g.token_ids, choices)
        assert max(abs(a - b) for a, b in zip(g.logprobs, expected)) < 1e-5
        unmasked = local_logprobs(model, prompt, g.token_ids)
        assert sum(g.logprobs) > sum(unmasked) + 0.5                         # the mask renormalizes
    # the constrained distribution is a distribution over the actions: their probabilities sum to 1
    total = sum(math.exp(sum(local_logprobs(model, prompt, c, choices))) for c in choices)
    assert total == pytest.approx(1.0, abs=1e-5)
    greedy = engine.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0.0), choices=[choices])[0]
    best = max(choices, key=lambda c: sum(local_logprobs(model, prompt, c, choices)))
    assert greedy.token_ids == best or sum(greedy.logprobs) <= sum(local_logprobs(model, prompt, best, choices))
    mixed = engine.generate([prompt, prompt], SamplingParams(max_new_tokens=12, seed=1), choices=[choices, None])
    assert tokenizer.decode(mixed[0].token_ids, skip_special_tokens=True).strip() in ACTIONS
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate([prompt], SamplingParams(), choices=[choices, choices])


def test_a_budget_shorter_than_an_action_truncates_inside_the_tree(policy):
    model, tokenizer = policy
    engine = TransformersEngine(model, tokenizer, policy_version="p")
    choices = choices_of(tokenizer, ["take key 7"])
    prompt = tokenizer.encode("> ", add_special_tokens=False)
    g = engine.generate([prompt], SamplingParams(max_new_tokens=2, seed=0), choices=[choices])[0]
    assert g.finish_reason == "length" and g.token_ids == choices[0][:2]
    assert max(abs(x) for x in g.logprobs) < 1e-6                           # a single path: log 1 = 0


def test_trainer_scores_constrained_steps_under_the_same_mask(policy):
    """The PPO ratio's denominator is the recorded behaviour log-prob: scored without the mask the trainer would
    see a mismatch of whole nats; with it, float rounding."""
    model, tokenizer = policy
    engine = TransformersEngine(model, tokenizer, policy_version="p")
    choices = choices_of(tokenizer)
    prompts = [tokenizer.encode(f"room {i}. Exits: north.\n>", add_special_tokens=False) for i in range(12)]
    generations = engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=7), choices=[choices] * 12)
    rows = [TrainRow(p, g.token_ids, g.logprobs, 1.0 if i % 2 else -1.0, choices)
            for i, (p, g) in enumerate(zip(prompts, generations))]
    batch = collate(rows, pad_id=0)
    assert batch["allowed_ids"].shape[:2] == batch["input_ids"].shape
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        masked = token_logprobs(model, batch)[mask]
        free = token_logprobs(model, {k: v for k, v in batch.items() if k != "allowed_ids"})[mask]
    recorded = batch["old_logprobs"][mask]
    assert float((masked - recorded).abs().max()) < 1e-5
    assert float((free - recorded).abs().max()) > 0.5
    ds = make_ds_engine(model, OptimizerConfig(lr=1e-3), micro_batch_size=12)
    metrics = rl_update(ds, rows, pad_id=0, loss=LossConfig(), update=UpdateConfig(epochs=1, micro_batch_size=12))
    assert metrics["logp_mismatch_max"] < 1e-5, metrics
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    free_rows = [r._replace(choices=None) for r in rows]
    ds_free = make_ds_engine(load_policy_copy(policy), OptimizerConfig(lr=1e-3), micro_batch_size=12)
    unmasked = rl_update(ds_free, free_rows, pad_id=0, loss=LossConfig(),
                         update=UpdateConfig(epochs=1, micro_batch_size=12))
    assert unmasked["logp_mismatch_max"] > 0.5                              # the check can fail
    with pytest.raises(ValueError, match="not allowed"):
        collate([TrainRow(prompts[0], [choices[0][0], choices[1][-1] + 1], None, 0.0, choices)], pad_id=0)


def load_policy_copy(policy):
    import copy
    return copy.deepcopy(policy[0])


def test_rollout_records_each_steps_mask_source_and_samples_inside_it(policy):
    model, tokenizer = policy
    engine = TransformersEngine(model, tokenizer, policy_version="p")
    scenarios = make_scenarios("frozenlake", "train", 3, seed=0)
    free = run_episodes(engine, tokenizer, scenarios, group_size=2, sampling=SamplingParams(max_new_tokens=8),
                        progress=False, env_kwargs={"frozenlake": {"max_steps": 4}})
    constrained = run_episodes(engine, tokenizer, scenarios, group_size=2, sampling=SamplingParams(max_new_tokens=8),
                               progress=False, env_kwargs={"frozenlake": {"max_steps": 4}}, action_space="admissible")
    steps = [s for t in constrained for s in t.steps]
    assert steps and all(s.action_valid for s in steps)                     # every response is an action
    for s in steps:
        assert s.response_ids in s.action_choices
        assert {tokenizer.decode(c, skip_special_tokens=True).strip() for c in s.action_choices} == \
            {"up", "down", "left", "right"}
    assert all(s.action_choices == [] for t in free for s in t.steps)
    assert sum(not s.action_valid for t in free for s in t.steps) > 0       # random weights write junk freely
    with pytest.raises(ValueError, match="action_space"):
        run_episodes(engine, tokenizer, scenarios, group_size=2, sampling=SamplingParams(), progress=False,
                     action_space="grammar")


class RecordingPool:
    """An upstream pool that answers every prompt with the first choice of its request's vllm_xargs (or a fixed
    off-tree answer), recording the request bodies."""

    def __init__(self, answer_off_tree: bool = False):
        self.bodies: list[dict] = []
        self.off = answer_off_tree

    def generate_many(self, prompts, sampling, n=1, extra_body=None):
        import json
        self.bodies.append({"prompts": prompts, "n": n, **(extra_body or {})})
        choice = json.loads(extra_body["vllm_xargs"]["arlflow_action_choices"])[0] if extra_body else [1, 2]
        ids = [99, 98] if self.off else choice
        return [[UpstreamResult(p, ids, [-0.5] * len(ids), "stop")] * n for p in prompts]

    def close(self):
        pass


def test_served_engine_sends_each_choice_list_in_its_own_requests_and_refuses_off_tree_answers(policy):
    _, tokenizer = policy
    pool = RecordingPool()
    engine = ServedEngine(pool, tokenizer, policy_version="p")
    a, b = [[5, 0], [6, 0]], [[7, 0]]
    out = engine.generate([[1], [1], [2], [3]], SamplingParams(max_new_tokens=4, seed=0), choices=[a, a, a, b])
    assert [g.token_ids for g in out] == [[5, 0], [5, 0], [5, 0], [7, 0]]
    by_choices = sorted((body["vllm_xargs"]["arlflow_action_choices"], body["n"], body["prompts"])
                        for body in pool.bodies)
    assert by_choices == [("[[5, 0], [6, 0]]", 1, [[2]]), ("[[5, 0], [6, 0]]", 2, [[1]]), ("[[7, 0]]", 1, [[3]])]
    with pytest.raises(ValueError, match="temperature 0 or 1"):
        engine.generate([[1]], SamplingParams(temperature=0.7), choices=[a])
    off = ServedEngine(RecordingPool(answer_off_tree=True), tokenizer, policy_version="p")
    with pytest.raises(UpstreamResponseError, match="logits-processors"):
        off.generate([[1]], SamplingParams(seed=0), choices=[a])
    engine.close()
    off.close()


def test_the_pool_refuses_a_constrained_step_whose_response_is_not_one_of_its_choices(tmp_path):
    from datapool.store import DataPool
    from tests.datapool.records_helpers import full_trajectory

    good = full_trajectory("good")
    bad = full_trajectory("bad")
    bad.steps[1].action_choices = [[1, 0], [2, 0]]                          # response [7, -8] is on neither
    with DataPool(str(tmp_path / "pool.db")) as pool:
        assert pool.add_trajectories([good]) == 1
        with pytest.raises(ValueError, match="action_choices"):
            pool.add_trajectories([bad])
        assert pool.counts() == {"trajectories": 1, "steps": 2}             # nothing of the bad one stored
        assert pool.get_trajectory("good").steps[0].action_choices == [[7, -8, 0], [5, 0]]
