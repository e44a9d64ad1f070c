"""PPO clip loss, aggregation modes, SFT loss: hand-computed values and gradient masking."""
from __future__ import annotations

import math

import pytest
import torch

from models.losses import LOSSES, aggregate, masked_token_mean, ppo_clip, sft_loss


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
    assert metrics["approx_kl"] == pytest.approx(kl, abs=1e-6)


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
