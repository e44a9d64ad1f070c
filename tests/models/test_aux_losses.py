"""ECHO and SEAL auxiliary losses: hand-computed values, gradient locality, loop reference, registry, config."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models.aux_losses import AUX_LOSSES, AuxConfig, AuxInputs, echo, seal

CFG = AuxConfig()


def inputs(logits=None, target_ids=None, observation_mask=None, hidden=None, attention_mask=None, success=None,
           group_index=None) -> AuxInputs:
    """AuxInputs with harmless defaults for the fields a test does not care about (B = 3, L = 3, V = 2, H = 2)."""
    return AuxInputs(
        logits=torch.zeros(3, 3, 2) if logits is None else logits,
        target_ids=torch.zeros(3, 3, dtype=torch.long) if target_ids is None else target_ids,
        observation_mask=torch.zeros(3, 3) if observation_mask is None else observation_mask,
        hidden=hidden,
        attention_mask=torch.ones(3, 3, dtype=torch.long) if attention_mask is None else attention_mask,
        success=torch.zeros(3, dtype=torch.bool) if success is None else success,
        group_index=torch.zeros(3, dtype=torch.long) if group_index is None else group_index,
    )


def test_echo_hand_computed_per_sequence_length_normalized():
    """V = 2. Row 0 has two observation tokens: logits (0, 0) -> CE ln 2; logits (0, ln 3) with target 1 ->
    p = 3/4, CE = -ln 0.75; row mean (ln 2 - ln 0.75) / 2. Row 1 has one: logits (0, ln 3), target 0 -> p = 1/4,
    CE = ln 4. Row 2 has none: skipped, not counted as 0.
    L_env = ((ln 2 - ln 0.75) / 2 + ln 4) / 2; the returned loss is 0.05 * L_env."""
    logits = torch.zeros(3, 3, 2)
    logits[0, 2, 1] = math.log(3.0)
    logits[1, 0, 1] = math.log(3.0)
    logits[2] = 50.0  # never an observation position
    targets = torch.tensor([[9, 0, 1], [0, 0, 0], [1, 1, 1]])  # 9 at a masked position: never looked up
    obs = torch.tensor([[0, 1, 1], [1, 0, 0], [0, 0, 0]])
    loss, metrics = echo(inputs(logits=logits, target_ids=targets, observation_mask=obs), CFG)
    env = ((math.log(2) - math.log(0.75)) / 2 + math.log(4)) / 2
    assert metrics["echo_loss"] == pytest.approx(env, abs=1e-6)
    assert metrics["echo_tokens"] == 3.0
    assert loss.item() == pytest.approx(0.05 * env, abs=1e-7)
    assert echo(inputs(logits=logits, target_ids=targets, observation_mask=obs), AuxConfig(echo_weight=1.0)
                )[0].item() == pytest.approx(env, abs=1e-6)


def test_echo_gradient_reaches_only_observation_logits():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 7).requires_grad_()
    targets = torch.randint(0, 7, (3, 4))
    obs = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 1]])
    loss, _ = echo(AuxInputs(logits, targets, obs, None, torch.ones(3, 4), torch.zeros(3, dtype=torch.bool),
                             torch.zeros(3, dtype=torch.long)), CFG)
    loss.backward()
    touched = logits.grad.abs().sum(dim=-1) > 0                             # [B, L]
    assert torch.equal(touched, obs.bool())


def test_echo_without_observation_tokens_is_zero_and_backpropagates():
    logits = torch.randn(3, 3, 2).requires_grad_()
    loss, metrics = echo(inputs(logits=logits), CFG)
    loss.backward()
    assert loss.item() == 0.0 and metrics == {"echo_loss": 0.0, "echo_tokens": 0.0}
    assert torch.equal(logits.grad, torch.zeros(3, 3, 2))


def test_seal_hand_computed():
    """Pooled states (mean over attended tokens), H = 2:
    group 0: success (1, 0), failure (0, 1): cos 0, distance 1, hinge max(0, 0.5 - 1) = 0.
    group 1: successes (2, 0) and (0, 0) -> centroid (1, 0); failure (1, 1) (its second token is padding):
             cos 1/sqrt 2, hinge 0.5 - (1 - 0.70711) = 0.20711.
    group 2: successes only: skipped. seal_loss = (0 + 0.20711) / 2, returned loss 0.01 * that."""
    hidden = torch.tensor([
        [[2.0, 0.0], [0.0, 0.0]],   # g0 success -> (1, 0)
        [[0.0, 2.0], [0.0, 0.0]],   # g0 failure -> (0, 1)
        [[2.0, 0.0], [2.0, 0.0]],   # g1 success -> (2, 0)
        [[0.0, 0.0], [0.0, 0.0]],   # g1 success -> (0, 0)
        [[1.0, 1.0], [9.0, -9.0]],  # g1 failure -> (1, 1), padding ignored
        [[5.0, 5.0], [5.0, 5.0]],   # g2 success only
    ]).requires_grad_()
    attention = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 1], [1, 0], [1, 1]])
    success = torch.tensor([True, False, True, True, False, True])
    groups = torch.tensor([10, 10, 4, 4, 4, 7])  # any ids, any order
    x = AuxInputs(torch.zeros(6, 2, 2), torch.zeros(6, 2, dtype=torch.long), torch.zeros(6, 2), hidden, attention,
                  success, groups)
    loss, metrics = seal(x, CFG)
    hinge = 0.5 - (1 - 1 / math.sqrt(2))
    assert metrics["seal_loss"] == pytest.approx(hinge / 2, abs=1e-6)
    assert metrics["seal_groups"] == 2.0
    assert metrics["seal_cosine"] == pytest.approx((0 + 1 / math.sqrt(2)) / 2, abs=1e-6)
    assert loss.item() == pytest.approx(0.01 * hinge / 2, abs=1e-8)
    loss.backward()
    assert torch.equal(hidden.grad[5], torch.zeros(2, 2))        # outcome-pure group: no gradient
    assert torch.equal(hidden.grad[4, 1], torch.zeros(2))        # padding: no gradient
    assert torch.equal(hidden.grad[:2], torch.zeros(2, 2, 2))    # group 0 beyond the margin: no gradient
    assert (hidden.grad[2:5] != 0).any()


def test_seal_is_zero_without_mixed_groups_and_keeps_the_graph():
    hidden = torch.randn(3, 3, 2).requires_grad_()
    for success in (torch.tensor([True, True, True]), torch.tensor([False, False, False])):
        loss, metrics = seal(inputs(hidden=hidden, success=success, group_index=torch.tensor([0, 0, 1])), CFG)
        assert loss.item() == 0.0 and metrics["seal_groups"] == 0.0 and metrics["seal_cosine"] == 0.0
        loss.backward()
        assert hidden.grad is not None and torch.equal(hidden.grad, torch.zeros(3, 3, 2))
    # successes and failures in different groups do not pair up
    loss, metrics = seal(inputs(hidden=hidden, success=torch.tensor([True, False, True]),
                                group_index=torch.tensor([0, 1, 2])), CFG)
    assert loss.item() == 0.0 and metrics["seal_groups"] == 0.0


def loop_seal(hidden, attention, success, groups, margin) -> float:
    """Plain-loop SEAL: one group at a time."""
    hinges = []
    for g in sorted(set(groups.tolist())):
        pooled = {True: [], False: []}
        for b in range(len(groups)):
            if groups[b] == g:
                n = attention[b].sum()
                pooled[bool(success[b])].append((hidden[b] * attention[b][:, None]).sum(0) / n)
        if pooled[True] and pooled[False]:
            cos = F.cosine_similarity(torch.stack(pooled[True]).mean(0), torch.stack(pooled[False]).mean(0), dim=0)
            hinges.append(max(0.0, margin - (1 - float(cos))))
    return sum(hinges) / len(hinges) if hinges else 0.0


def test_seal_vectorized_matches_loop():
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        hidden = torch.randn(12, 5, 8, generator=gen)
        attention = (torch.rand(12, 5, generator=gen) > 0.3).long()
        attention[:, 0] = 1
        success = torch.rand(12, generator=gen) > 0.5
        groups = torch.randint(0, 4, (12,), generator=gen)
        cfg = AuxConfig(seal_margin=1.2)
        _, metrics = seal(AuxInputs(torch.zeros(12, 5, 2), torch.zeros(12, 5, dtype=torch.long), torch.zeros(12, 5),
                                    hidden, attention, success, groups), cfg)
        assert metrics["seal_loss"] == pytest.approx(loop_seal(hidden, attention, success, groups, 1.2), abs=1e-5)


def test_seal_needs_hidden_states_and_registry_and_config():
    with pytest.raises(ValueError, match="output_hidden_states"):
        seal(inputs(), CFG)
    assert AUX_LOSSES["echo"] is echo and AUX_LOSSES["seal"] is seal
    assert (CFG.echo_weight, CFG.seal_weight, CFG.seal_margin) == (0.05, 0.01, 0.5)
    with pytest.raises(ValueError, match="echo_weight"):
        AuxConfig(echo_weight=-1.0)
    with pytest.raises(ValueError, match="seal_margin"):
        AuxConfig(seal_margin=0.0)
