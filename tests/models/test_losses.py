"""Policy losses, KL and entropy terms, policy_objective, SFT loss: hand-computed values and gradient masking."""
from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.losses import (
    AGGREGATIONS,
    LOSSES,
    aggregate,
    entropy_from_logits,
    kl_penalty,
    LossConfig,
    masked_token_mean,
    policy_objective,
    ppo_clip,
    sft_loss,
    vanilla_pg,
)

LN2 = math.log(2.0)


def log(x: float) -> float:
    return math.log(x)


def test_ppo_clip_hand_computed_token_mean():
    """Four valid tokens, eps 0.2:
    rho 1.5, A +1: max(-1.5, -1.2) = -1.2   (clipped)
    rho 0.5, A +1: max(-0.5, -0.8) = -0.5
    rho 0.5, A -2: max(1.0, 1.6)   =  1.6   (clipped)
    rho 1.0, A -2: max(2.0, 2.0)   =  2.0
    token-mean = (-1.2 - 0.5 + 1.6 + 2.0) / 4 = 0.475; clip fraction 2/4.
    """
    logp = torch.tensor([[log(1.5), log(0.5), 0.0], [log(0.5), 0.0, 5.0]])
    old = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    loss, metrics = ppo_clip(logp, old, adv, mask)
    assert loss.item() == pytest.approx(0.475, abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 0.5 + 1.0) / 4, abs=1e-6)
    kl = 0.5 * (log(1.5) ** 2 + 2 * log(0.5) ** 2) / 4
    assert metrics["approx_kl_k2"] == pytest.approx(kl, abs=1e-6)
    # k3 = (r - 1) - log r: (0.5 - ln 1.5) + 2 * (-0.5 - ln 0.5) + 0, over 4 tokens (CleanRL's approx_kl)
    k3 = ((0.5 - log(1.5)) + 2 * (-0.5 - log(0.5))) / 4
    assert metrics["approx_kl_k3"] == pytest.approx(k3, abs=1e-6)


def test_clip_higher_and_dual_clip():
    # rho 1.25 with A +1: clipped to 1.2 at eps_high 0.2, unclipped at eps_high 0.28
    logp, old, adv, mask = torch.tensor([[log(1.25)]]), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)
    assert ppo_clip(logp, old, adv, mask)[0].item() == pytest.approx(-1.2)
    assert ppo_clip(logp, old, adv, mask, clip_high=0.28)[0].item() == pytest.approx(-1.25)
    # rho 5, A -1: max(5, 1.2) = 5; dual clip c = 3 caps it at 3; A > 0 is never dual-clipped
    logp = torch.tensor([[log(5.0), log(5.0)]])
    adv = torch.tensor([[-1.0, 1.0]])
    loss, metrics = ppo_clip(logp, torch.zeros(1, 2), adv, torch.tensor([[1.0, 0.0]]), dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0)
    assert metrics["dual_clip_fraction"] == 1.0
    loss, _ = ppo_clip(logp, torch.zeros(1, 2), adv, torch.tensor([[0.0, 1.0]]), dual_clip=3.0)
    assert loss.item() == pytest.approx(-1.2)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip(logp, logp, adv, adv, dual_clip=0.5)


def test_ratio_is_clamped_so_huge_log_ratios_stay_finite():
    logp = torch.tensor([[1000.0, -1000.0]], requires_grad=True)
    loss, _ = ppo_clip(logp, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


def test_aggregation_modes_hand_computed():
    """Row 0: tokens 1, 2, 3 (3 valid); row 1: token 4 (1 valid); row 2: none (skipped); L = 4."""
    loss_mat = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert aggregate(loss_mat, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss_mat, mask, "seq-mean-token-sum-norm").item() == pytest.approx((6 / 4 + 4 / 4) / 2)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert aggregate(loss_mat, torch.zeros(3, 4), mode).item() == 0.0  # nothing valid: 0, not nan
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(loss_mat, mask, "sum")


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                         "seq-mean-token-sum-norm"])
def test_masked_tokens_get_exactly_zero_gradient(aggregation):
    torch.manual_seed(0)
    logp = (torch.randn(3, 5) - 2).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(3, 5)
    old[0, 4] = float("inf")  # garbage at a masked position must not leak
    mask = torch.tensor([[1, 1, 0, 0, 0], [0, 1, 1, 1, 0], [0, 0, 0, 0, 0]]).float()
    loss, _ = ppo_clip(logp, old, torch.randn(3, 5), mask, aggregation=aggregation)
    loss.backward()
    assert torch.equal(logp.grad[mask == 0], torch.zeros(int((mask == 0).sum())))
    assert (logp.grad[mask == 1] != 0).any()


def test_masked_token_mean_and_registry():
    x = torch.tensor([[1.0, float("nan")], [3.0, 5.0]])
    assert masked_token_mean(x, torch.tensor([[1, 0], [1, 1]])).item() == pytest.approx(3.0)
    assert LOSSES["ppo_clip"] is ppo_clip
    assert LOSSES["vanilla_pg"] is vanilla_pg
    with pytest.raises(KeyError, match="ppo_clip"):
        LOSSES["dpo"]


def test_sft_loss_hand_computed_and_masked():
    # uniform logits over V = 4: cross-entropy log 4 per token; a confident correct token: ~0
    logits = torch.zeros(1, 3, 4)
    logits[0, 1, 2] = 100.0
    labels = torch.tensor([[1, 2, -100]])  # the masked label may be anything, even out of range
    mask = torch.tensor([[1, 1, 0]])
    assert sft_loss(logits, labels, mask).item() == pytest.approx(math.log(4) / 2, abs=1e-5)
    leaf = logits.clone().requires_grad_()
    sft_loss(leaf, labels, mask).backward()
    assert torch.equal(leaf.grad[0, 2], torch.zeros(4))


def test_vanilla_pg_hand_computed_and_ignores_clip_arguments():
    """l = -A * logp: tokens (logp -1, A 2) -> 2 and (logp -2, A 1) -> 2; token-mean 2; d/dlogp = -A / 2."""
    logp = torch.tensor([[-1.0, -2.0, -9.0]], requires_grad=True)
    adv = torch.tensor([[2.0, 1.0, float("nan")]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = vanilla_pg(logp, logp.detach(), adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert loss.item() == pytest.approx(2.0)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -0.5, 0.0]]))
    assert metrics == {"clip_fraction": 0.0, "approx_kl_k2": 0.0, "approx_kl_k3": 0.0, "ratio_mean": 1.0}


def test_kl_penalty_kinds_hand_computed():
    """Two valid tokens with logp - ref = +ln 2 and -ln 2 (the third is masked garbage):
    k1: (ln 2 - ln 2) / 2 = 0;  k2: 0.5 * ln(2)^2;
    k3 with d = ref - logp = -ln 2, +ln 2: (0.5 + ln 2 - 1) + (2 - ln 2 - 1) = 0.5, mean 0.25.
    """
    logp = torch.tensor([[LN2, 0.0, 0.0]])
    ref = torch.tensor([[0.0, LN2, float("inf")]])
    mask = torch.tensor([[1, 1, 0]])
    assert kl_penalty(logp, ref, mask, kind="k1").item() == pytest.approx(0.0, abs=1e-7)
    assert kl_penalty(logp, ref, mask, kind="k2").item() == pytest.approx(0.5 * LN2**2)
    assert kl_penalty(logp, ref, mask).item() == pytest.approx(0.25)
    # seq-mean-token-sum over one sequence = the sum of the two k3 values
    assert kl_penalty(logp, ref, mask, aggregation="seq-mean-token-sum").item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(logp, ref, mask, kind="k4")


def test_kl_k3_is_clamped_and_gradients_stay_finite():
    # logp far below ref: d = ref - logp = 15 -> exp(15) - 16 clamped to 10; d = 1000 is clamped to 20 first
    logp = torch.tensor([[-15.0, -1000.0, 0.0]], requires_grad=True)
    ref = torch.zeros(1, 3)
    kl = kl_penalty(logp, ref, torch.ones(1, 3))
    assert kl.item() == pytest.approx((10.0 + 10.0 + 0.0) / 3)
    kl.backward()
    assert torch.isfinite(logp.grad).all()
    # d/dlogp of k3 = 1 - exp(ref - logp): at logp - ref = ln 2 it is 1 - 1/2
    logp = torch.tensor([[LN2]], requires_grad=True)
    kl_penalty(logp, torch.zeros(1, 1), torch.ones(1, 1)).backward()
    assert logp.grad.item() == pytest.approx(0.5)


def test_entropy_from_logits_hand_computed_and_differentiable():
    """Row 0: uniform over V = 4 -> ln 4; p = (1/4, 3/4, 0, 0) (logits 0, ln 3, -inf, -inf) ->
    -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335; row 1: nan logits at a masked position must not matter."""
    logits = torch.zeros(2, 2, 4)
    logits[0, 1] = torch.tensor([0.0, math.log(3.0), -float("inf"), -float("inf")])
    logits[1, 0] = float("nan")
    mask = torch.tensor([[1, 1], [0, 0]])
    expected_second = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    ent = entropy_from_logits(logits, mask)
    assert ent.item() == pytest.approx((math.log(4) + expected_second) / 2, abs=1e-6)
    with_inf = logits.clone().requires_grad_()
    entropy_from_logits(with_inf, mask).backward()
    assert torch.isfinite(with_inf.grad).all()
    leaf = torch.randn(2, 2, 4).requires_grad_()
    entropy_from_logits(leaf, mask).backward()
    assert torch.equal(leaf.grad[1], torch.zeros(2, 4))
    assert (leaf.grad[0] != 0).any()
    assert entropy_from_logits(leaf, torch.zeros(2, 2)).item() == 0.0


def test_policy_objective_combines_terms_hand_computed():
    """One valid token, A = 1, ratio 1: pg = -1. logp - ref = ln 2: k3 = 0.5 + ln 2 - 1 = 0.193147.
    total = -1 + 0.1 * 0.193147 - 0.01 * 0.5 = -0.985685; d total / d logp = -1 + 0.1 * (1 - 1/2) = -0.95."""
    logp = torch.tensor([[LN2, 0.0]], requires_grad=True)
    old = torch.tensor([[LN2, 0.0]])
    ref = torch.tensor([[0.0, 0.0]])
    adv, mask = torch.ones(1, 2), torch.tensor([[1, 0]])
    k3 = 0.5 + LN2 - 1.0
    total, metrics = policy_objective(logp, old, adv, mask, LossConfig(kl_beta=0.1, entropy_coef=0.01), ref_logp=ref,
                                      entropy=torch.tensor(0.5))
    assert total.item() == pytest.approx(-1.0 + 0.1 * k3 - 0.005, abs=1e-6)
    assert metrics["pg_loss"] == pytest.approx(-1.0)
    assert metrics["kl_loss"] == pytest.approx(k3, abs=1e-6) and metrics["kl_ref_k3"] == metrics["kl_loss"]
    assert metrics["entropy"] == pytest.approx(0.5)
    assert metrics["loss"] == pytest.approx(total.item())
    assert metrics["clip_fraction"] == 0.0 and "approx_kl_k3" in metrics
    total.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.95, 0.0]]))

    plain, plain_metrics = policy_objective(logp, old, adv, mask, LossConfig())  # no ref, no entropy: the policy loss alone
    assert plain.item() == pytest.approx(-1.0) and "kl_loss" not in plain_metrics and "entropy" not in plain_metrics
    logged_only, m = policy_objective(logp, old, adv, mask, LossConfig(), ref_logp=ref)  # KL logged, beta 0: not in the loss
    assert logged_only.item() == pytest.approx(-1.0) and m["kl_loss"] == pytest.approx(k3, abs=1e-6)
    reinforce, _ = policy_objective(logp, old, adv, mask, LossConfig(name="vanilla_pg"))
    assert reinforce.item() == pytest.approx(-LN2)


def test_policy_objective_rejects_missing_inputs():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_objective(x, x, x, x, LossConfig(kl_beta=0.01))
    with pytest.raises(ValueError, match="entropy_from_logits"):
        policy_objective(x, x, x, x, LossConfig(entropy_coef=0.01))
    with pytest.raises(KeyError, match="ppo_clip"):
        policy_objective(x, x, x, x, LossConfig(name="dpo"))


@pytest.mark.parametrize("field, value, message", [
    ("clip_low", -1.0, "clip_low = -1.0: must be in [0, 1)"), ("clip_low", 1.0, "in [0, 1)"),
    ("dual_clip", 0.5, "dual_clip = 0.5: must be 0 (off) or > 1"), ("kl_beta", float("nan"), "finite"),
    ("aggregation", "mean", "one of"), ("kl_kind", "k4", "one of"), ("entropy_coef", -0.1, ">= 0"),
])
def test_loss_config_rejects_out_of_range_values(field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LossConfig(**{field: value})


GARBAGE = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30])


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 3), width=st.integers(1, 6), seed=st.integers(0, 2**16), garbage=GARBAGE,
    loss=st.sampled_from(["ppo_clip", "vanilla_pg"]), aggregation=st.sampled_from(AGGREGATIONS),
    kl_kind=st.sampled_from(["k1", "k2", "k3"]), dual_clip=st.sampled_from([None, 3.0]), data=st.data(),
)
def test_masked_tokens_never_get_gradient_through_policy_objective(rows, width, seed, garbage, loss, aggregation,
                                                                   kl_kind, dual_clip, data):
    """Whatever sits at masked positions of old/ref log-probs and advantages, the logits there get exactly 0."""
    mask = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 1), min_size=width, max_size=width),
                                           min_size=rows, max_size=rows)), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, 5, generator=gen).requires_grad_()
    targets = torch.randint(0, 5, (rows, width), generator=gen)
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)  # [B, L]
    off = mask == 0
    old = (logp.detach() + 0.3 * torch.randn(rows, width, generator=gen)).masked_fill(off, garbage)
    ref = (logp.detach() + 0.3 * torch.randn(rows, width, generator=gen)).masked_fill(off, garbage)
    adv = torch.randn(rows, width, generator=gen).masked_fill(off, garbage)
    entropy = entropy_from_logits(logits, mask, aggregation)
    cfg = LossConfig(name=loss, dual_clip=dual_clip or 0.0, aggregation=aggregation, kl_beta=0.1, kl_kind=kl_kind,
                     entropy_coef=0.01)
    total, metrics = policy_objective(logp, old, adv, mask, cfg, ref_logp=ref, entropy=entropy)
    total.backward()
    assert torch.isfinite(total) and all(math.isfinite(v) for v in metrics.values())
    assert torch.equal(logits.grad[off], torch.zeros(int(off.sum()), 5))
    assert torch.isfinite(logits.grad).all()
