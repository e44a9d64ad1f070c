"""SIRI internalization: token selection and weights, the weighted SFT loss, and sft_update(weights=..., update=UpdateConfig())."""
from __future__ import annotations

import math

import pytest
import torch

from models.build import load_policy
from models.ds_engine import OptimizerConfig, make_ds_engine
from models.internalize import (
    GuidedStep,
    InternalizeConfig,
    check_token_weights,
    internalization_pairs,
    weighted_sft_loss,
)
from models.losses import sft_loss
from models.batching import TrainRow, UpdateConfig, collate
from models.forward import token_logprobs
from models.sft import sft_update

PAD = 0


# --- selection and weights ------------------------------------------------------------------------------------------

def test_config_and_step_reject_bad_values():
    with pytest.raises(ValueError, match="coef"):
        InternalizeConfig(coef=-0.1)
    with pytest.raises(ValueError, match="coef"):
        InternalizeConfig(coef=math.nan)
    with pytest.raises(ValueError, match="w_max"):
        InternalizeConfig(w_max=0.0)
    with pytest.raises(ValueError, match="w_max"):
        InternalizeConfig(w_max=math.inf)
    with pytest.raises(ValueError, match="empty plain prompt"):
        GuidedStep([], [1], 1.0, 0.5)
    with pytest.raises(ValueError, match="no response tokens"):
        GuidedStep([1], [], 1.0, 0.5)
    with pytest.raises(ValueError, match="2 advantages for 3"):
        GuidedStep([1], [2, 3, 4], [1.0, 2.0], 0.5)
    with pytest.raises(ValueError, match="finite"):
        GuidedStep([1], [2], [math.nan], 0.5)
    with pytest.raises(ValueError, match="utility"):
        GuidedStep([1], [2], 1.0, math.inf)


STEPS = [
    GuidedStep([1, 2], [3], 1.0, None),                        # unknown utility: dropped
    GuidedStep([1, 2], [3], 1.0, 0.0),                         # skill did not help: dropped
    GuidedStep([1, 2], [3], 1.0, -0.5),                        # skill hurt: dropped
    GuidedStep([4], [5, 6, 7, 8], [0.4, -1.0, 0.0, 3.0], 0.5),  # only tokens with A > 0 are selected
    GuidedStep([4], [9], -2.0, 0.5),                           # no token with A > 0: dropped
    GuidedStep([10, 11], [12, 13], 0.25, 2.0),                 # scalar advantage: every token
]


def test_selection_keeps_positive_tokens_of_helpful_skills():
    pairs, weights, metrics = internalization_pairs(STEPS, InternalizeConfig())
    assert pairs == [([4], [5, 6, 7, 8]), ([10, 11], [12, 13])]
    # w = min(u * A, 1): 0.5 * 0.4, 0, 0, min(0.5 * 3, 1); 2 * 0.25 on both tokens
    assert weights == [pytest.approx([0.2, 0.0, 0.0, 1.0]), pytest.approx([0.5, 0.5])]
    assert metrics == pytest.approx({"guided_steps": 6.0, "selected_steps": 2.0, "selected_tokens": 4.0,
                                     "mean_weight": (0.2 + 1.0 + 0.5 + 0.5) / 4})


def test_w_max_clamps_before_coef_scales():
    _, weights, metrics = internalization_pairs(STEPS, InternalizeConfig(coef=2.0, w_max=0.4))
    # coef * min(u * A, 0.4): 2 * 0.2, 0, 0, 2 * 0.4; 2 * min(0.5, 0.4) twice
    assert weights == [pytest.approx([0.4, 0.0, 0.0, 0.8]), pytest.approx([0.8, 0.8])]
    assert metrics["mean_weight"] == pytest.approx((0.4 + 0.8 * 3) / 4)


def test_coef_zero_turns_internalization_off():
    pairs, weights, metrics = internalization_pairs(STEPS, InternalizeConfig(coef=0.0))
    assert pairs == [] and weights == []
    assert metrics == {"guided_steps": 6.0, "selected_steps": 0.0, "selected_tokens": 0.0, "mean_weight": 0.0}


def test_check_token_weights_rejects_bad_weights():
    pairs = [([1], [2, 3]), ([4], [5])]
    assert check_token_weights([[0.5, 0], 1], pairs) == [[0.5, 0.0], 1.0]
    with pytest.raises(ValueError, match="1 weights for 2 pairs"):
        check_token_weights([1.0], pairs)
    with pytest.raises(ValueError, match="pair 0: 3 weights for 2 response tokens"):
        check_token_weights([[1.0, 1.0, 1.0], 1.0], pairs)
    for bad in (-0.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="pair 1: weights must be finite and >= 0"):
            check_token_weights([1.0, [bad]], pairs)


# --- the weighted loss ----------------------------------------------------------------------------------------------

def test_weighted_sft_loss_matches_hand_computation():
    """Position 0: p(label 1) = 1/2; position 1: p(label 0) = 3/4; position 2 is masked (its weight 7 is ignored).
    loss = -(2 * log 1/2 + 0.5 * log 3/4) / 2 valid tokens."""
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [5.0, -5.0]]])    # [1, 3, 2]
    labels = torch.tensor([[1, 0, 1]])                                          # [1, 3]
    mask = torch.tensor([[1.0, 1.0, 0.0]])                                      # [1, 3]
    weights = torch.tensor([[2.0, 0.5, 7.0]])                                   # [1, 3]
    expected = -(2.0 * math.log(0.5) + 0.5 * math.log(0.75)) / 2
    assert float(weighted_sft_loss(logits, labels, mask, weights)) == pytest.approx(expected, abs=1e-6)


def test_unit_weights_give_sft_loss_value_and_gradient_exactly():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, requires_grad=True)                          # [B, L, V]
    labels = torch.randint(0, 11, (2, 5))                                       # [B, L]
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.float32)
    plain = sft_loss(logits, labels, mask)
    (plain_grad,) = torch.autograd.grad(plain, logits)
    weighted = weighted_sft_loss(logits, labels, mask, torch.ones(2, 5))
    (weighted_grad,) = torch.autograd.grad(weighted, logits)
    assert torch.equal(plain, weighted) and torch.equal(plain_grad, weighted_grad)


# --- sft_update(weights=..., update=UpdateConfig()) on the tiny policy ---------------------------------------------------------------------

def _pairs(tokenizer) -> list[tuple[list[int], list[int]]]:
    return [(tokenizer(f"room {i}. Exits: north.\n> ")["input_ids"], tokenizer(f"take key {i}")["input_ids"])
            for i in range(4)]


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_sft_update_loss_is_weighted_token_mean(tiny_policy_dir):
    model, tokenizer = load_policy(tiny_policy_dir)
    pairs = _pairs(tokenizer)[:3]
    weights = [[0.0] + [1.5] * (len(pairs[0][1]) - 1), 0.5, 0.0]
    batch = collate([TrainRow(p, r, None, w) for (p, r), w in zip(pairs, weights)], PAD)
    with torch.no_grad():
        logp = token_logprobs(model, batch)                                     # [B, L]
    mask = batch["response_mask"]                                               # [B, L]
    expected = float(-(batch["advantages"] * logp * mask).sum() / mask.sum())   # -sum w log p / n, before training
    engine = make_ds_engine(model, OptimizerConfig(lr=1e-3), micro_batch_size=3)
    metrics = sft_update(engine, pairs, pad_id=PAD, progress=False, weights=weights, update=UpdateConfig(epochs=1, micro_batch_size=3))
    assert metrics["loss_first"] == pytest.approx(expected, abs=1e-5)          # one micro-batch: the whole batch
    assert metrics["weighted_tokens"] == len(pairs[0][1]) - 1 + len(pairs[1][1])
    with pytest.raises(ValueError, match="2 weights for 3 pairs"):
        sft_update(engine, pairs, pad_id=PAD, progress=False, weights=[1.0, 1.0], update=UpdateConfig(epochs=1, micro_batch_size=3))
    with pytest.raises(ValueError, match="pair 2: weights must be finite and >= 0"):
        sft_update(engine, pairs, pad_id=PAD, progress=False, weights=[1.0, 1.0, -1.0], update=UpdateConfig(epochs=1, micro_batch_size=3))


def _train(tiny_policy_dir, pairs, weights) -> list[torch.Tensor]:
    """Parameters of a fresh tiny policy after two epochs of sft_update (two micro-batches per optimizer step)."""
    model, _ = load_policy(tiny_policy_dir)
    engine = make_ds_engine(model, OptimizerConfig(lr=1e-3), micro_batch_size=2, grad_accum=2)
    sft_update(engine, pairs, pad_id=PAD, progress=False, weights=weights, update=UpdateConfig(epochs=2, micro_batch_size=2))
    return _params(model)


def test_unit_weights_train_exactly_like_no_weights(tiny_policy_dir):
    _, tokenizer = load_policy(tiny_policy_dir)
    pairs = _pairs(tokenizer)
    before = _params(load_policy(tiny_policy_dir)[0])
    plain = _train(tiny_policy_dir, pairs, None)
    unit = _train(tiny_policy_dir, pairs, [1.0, [1.0] * len(pairs[1][1]), 1, 1.0])
    assert any(not torch.equal(a, b) for a, b in zip(before, plain))
    assert all(torch.equal(a, b) for a, b in zip(plain, unit))


def test_zero_weight_pair_does_not_change_the_update(tiny_policy_dir):
    """A pair of weight 0 still counts in the token normalization, but what it says is never trained: replacing its
    response by another of the same length gives the same parameters."""
    _, tokenizer = load_policy(tiny_policy_dir)
    pairs = _pairs(tokenizer)
    other = list(reversed(pairs[3][1]))
    assert other != pairs[3][1]
    weights = [1.0, 0.5, 2.0, 0.0]
    first = _train(tiny_policy_dir, pairs, weights)
    second = _train(tiny_policy_dir, pairs[:3] + [(pairs[3][0], other)], weights)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_internalized_action_becomes_likely_under_the_plain_prompt(tiny_policy_dir):
    """Skill-guided action with u > 0 and A > 0, trained on the prompt without the skill, gains log-probability
    there; the action of a skill with u < 0 is not selected at all."""
    model, tokenizer = load_policy(tiny_policy_dir)
    plain = tokenizer("You are in the kitchen.\n> ")["input_ids"]
    target, unhelpful = tokenizer("take key 7")["input_ids"], tokenizer("go north")["input_ids"]
    steps = [GuidedStep(plain, target, 1.0, 0.6), GuidedStep(plain, unhelpful, 1.0, -0.3)]
    pairs, weights, metrics = internalization_pairs(steps, InternalizeConfig(w_max=1.0))
    assert pairs == [(plain, target)] and metrics["selected_steps"] == 1.0

    def target_logprob() -> float:
        batch = collate([TrainRow(plain, target, None, 0.0)], PAD)
        with torch.no_grad():
            return float((token_logprobs(model, batch) * batch["response_mask"]).sum())

    before = target_logprob()
    engine = make_ds_engine(model, OptimizerConfig(lr=3e-3), micro_batch_size=1)
    sft_update(engine, pairs, pad_id=PAD, progress=False, weights=weights, update=UpdateConfig(epochs=5, micro_batch_size=1))
    assert target_logprob() > before + 0.5
