"""Off-policy correction of stale rows (docs/algorithms.md §2.7): decoupled PPO with truncated importance weights.

Hand-computed weights and losses, bit-identity with the uncorrected objective when no row is stale, the cap, the
staleness / weight metrics of rl_update on a tiny policy, the micro-batch split, resume and config validation.
"""
from __future__ import annotations

import copy
import json
import math
import re
from types import SimpleNamespace

import pytest
import torch

from models import staleness, trainer
from models.batching import TrainRow, UpdateConfig, collate, select_rows
from models.build import load_policy
from models.checks import ConfigValueError
from models.ds_engine import OptimizerConfig, load_ds_config, make_ds_engine
from models.forward import token_logprobs
from models.layouts import RowSpec, collate_rows, concatenated, step_rows
from models.losses import AGGREGATIONS, LossConfig, policy_objective, ppo_clip, truncated_is_weights
from models.trainer import rl_update

PAD = 0
LOG = math.log


# --- the loss -------------------------------------------------------------------------------------------------------

def test_decoupled_ppo_hand_computed():
    """Row 0 stale (staleness 1), A = +1, two tokens; row 1 on-policy (staleness 0), A = -2, one token. C = 1.5,
    clip 0.2 / 0.2, token-mean over the 3 valid tokens.

    row 0 token a: pi = 0.55, prox = 0.5, behav = 0.25  ratio 1.1 (unclipped): l = -1.1;  w = min(0.5/0.25, 1.5) = 1.5
                                                        (truncated: 2 > C)                w * l = -1.65
    row 0 token b: pi = 0.4,  prox = 0.4, behav = 0.5   ratio 1.0:            l = -1.0;  w = 0.4/0.5 = 0.8, w*l = -0.8
    row 1 token:   pi = 0.25, prox = 0.5, behav = 0.05  ratio 0.5, clipped to 0.8: l = max(2 * 0.5, 2 * 0.8) = 1.6;
                                                        staleness 0, so w = 1 (not 0.5 / 0.05 = 10)
    decoupled: (-1.65 - 0.8 + 1.6) / 3 = -0.85 / 3;  none: (-1.1 - 1.0 + 1.6) / 3 = -0.5 / 3.
    d loss / d logp (ratio r: d(-A w r)/d logp = -A w r; a clipped token gets 0):
      decoupled: a: -1.5 * 1.1 / 3 = -0.55;  b: -0.8 * 1.0 / 3;  row 1: 0.
    Weight metrics over the 2 stale tokens: mean (1.5 + 0.8) / 2 = 1.15, max 1.5, truncated 1 / 2.
    """
    logp = torch.tensor([[LOG(0.55), LOG(0.4)], [LOG(0.25), 0.0]], requires_grad=True)
    prox = torch.tensor([[LOG(0.5), LOG(0.4)], [LOG(0.5), 0.0]])
    behav = torch.tensor([[LOG(0.25), LOG(0.5)], [LOG(0.05), 0.0]])
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    stale = torch.tensor([True, False])
    decoupled = LossConfig(is_weight_cap=1.5)

    weights, weight_metrics = truncated_is_weights(prox, behav, stale, mask, 1.5)
    torch.testing.assert_close(weights, torch.tensor([[1.5, 0.8], [1.0, 1.0]]))
    assert weights[1].tolist() == [1.0, 1.0]                                  # exactly 1 off the stale rows
    assert weight_metrics["is_weight_mean"] == pytest.approx(1.15, abs=1e-6)
    assert weight_metrics["is_weight_max"] == pytest.approx(1.5)
    assert weight_metrics["is_weight_truncated_fraction"] == pytest.approx(0.5)

    loss, metrics = policy_objective(logp, prox, adv, mask, decoupled, behaviour_logp=behav, stale_rows=stale)
    torch.testing.assert_close(loss, torch.tensor(-0.85 / 3))
    assert metrics["pg_loss"] == pytest.approx(-0.85 / 3, abs=1e-6)
    assert metrics["is_weight_mean"] == pytest.approx(1.15, abs=1e-6) and metrics["is_weight_max"] == 1.5
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[-0.55, -0.8 / 3], [0.0, 0.0]]))

    none = LossConfig(off_policy="none", is_weight_cap=1.5)
    uncorrected, none_metrics = policy_objective(logp, prox, adv, mask, none, behaviour_logp=behav, stale_rows=stale)
    torch.testing.assert_close(uncorrected, torch.tensor(-0.5 / 3))
    assert none_metrics["is_weight_mean"] == metrics["is_weight_mean"]     # logged, not applied

    # vanilla_pg takes the same weights: l = -w * A * logp
    reinforce, _ = policy_objective(logp, prox, adv, mask, LossConfig(name="vanilla_pg", is_weight_cap=1.5),
                                    behaviour_logp=behav, stale_rows=stale)
    expected = (-1.5 * LOG(0.55) - 0.8 * LOG(0.4) + 2.0 * LOG(0.25)) / 3
    torch.testing.assert_close(reinforce, torch.tensor(expected))


def random_inputs(seed: int, rows: int = 3, width: int = 6):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, 7, generator=gen).requires_grad_()
    targets = torch.randint(0, 7, (rows, width), generator=gen)
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)  # [B, L]
    old = logp.detach() + 0.3 * torch.randn(rows, width, generator=gen)           # [B, L]
    behav = old - 2.0 * torch.rand(rows, width, generator=gen)                    # [B, L] would be capped
    ref = logp.detach() + 0.2 * torch.randn(rows, width, generator=gen)           # [B, L]
    adv = torch.randn(rows, width, generator=gen)                                 # [B, L]
    mask = (torch.rand(rows, width, generator=gen) > 0.3).float()                 # [B, L]
    mask[:, 0] = 1.0
    return logits, logp, old, behav, ref, adv, mask


@pytest.mark.parametrize("name", ["ppo_clip", "vanilla_pg"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_no_stale_row_is_bit_identical_to_the_uncorrected_objective(name, aggregation):
    """staleness 0 everywhere: decoupled, none and the call without the new arguments (as before the correction)
    give the same loss and the same gradients, bit for bit, even though behaviour and proximal log-probs differ."""
    logits, logp, old, behav, ref, adv, mask = random_inputs(seed=7)
    entropy = torch.tensor(0.3)
    fresh = torch.zeros(logp.shape[0], dtype=torch.bool)
    results = {}
    for label, cfg, extra in (
        ("before", LossConfig(name=name, aggregation=aggregation, kl_beta=0.1, dual_clip=3.0), {}),
        ("decoupled", LossConfig(name=name, aggregation=aggregation, kl_beta=0.1, dual_clip=3.0),
         {"behaviour_logp": behav, "stale_rows": fresh}),
        ("none", LossConfig(name=name, aggregation=aggregation, kl_beta=0.1, dual_clip=3.0, off_policy="none"),
         {"behaviour_logp": behav, "stale_rows": fresh}),
    ):
        loss, metrics = policy_objective(logp, old, adv, mask, cfg, ref_logp=ref, entropy=entropy, **extra)
        (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
        results[label] = (loss.detach(), grad, metrics)
    for label in ("decoupled", "none"):
        assert torch.equal(results[label][0], results["before"][0]), label
        assert torch.equal(results[label][1], results["before"][1]), label
        assert {k: v for k, v in results[label][2].items() if not k.startswith("is_weight")} == results["before"][2]
    assert results["decoupled"][2]["is_weight_mean"] == 1.0 and results["decoupled"][2]["is_weight_max"] == 1.0
    assert results["decoupled"][2]["is_weight_truncated_fraction"] == 0.0


def test_on_policy_rows_of_a_mixed_batch_keep_their_exact_gradient():
    """Row 0 stale, rows 1 and 2 not: per-sequence aggregation, so rows 1-2's gradients are those of "none" bit for
    bit (their weight is exactly 1), and row 0's differ."""
    logits, logp, old, behav, ref, adv, mask = random_inputs(seed=11)
    stale = torch.tensor([True, False, False])
    grads = {}
    for mode in ("decoupled", "none"):
        cfg = LossConfig(aggregation="seq-mean-token-sum", off_policy=mode)
        loss, _ = policy_objective(logp, old, adv, mask, cfg, behaviour_logp=behav, stale_rows=stale)
        (grads[mode],) = torch.autograd.grad(loss, logits, retain_graph=True)
    assert torch.equal(grads["decoupled"][1:], grads["none"][1:])
    assert not torch.equal(grads["decoupled"][0], grads["none"][0])


@pytest.mark.parametrize("name", ["ppo_clip", "vanilla_pg"])
def test_a_capped_stale_row_counts_exactly_cap_times_its_on_policy_term(name):
    """Behaviour log-probs 5 nats below the proximal ones: every weight is min(e^5, C) = C = 2, so the stale row's
    loss and gradient are exactly 2x the uncorrected ones (a power of two: exact in floating point)."""
    logits, logp, old, _, _, adv, mask = random_inputs(seed=3, rows=1)
    behav = old - 5.0                                                        # [1, L]
    stale = torch.tensor([True])
    out = {}
    for mode in ("decoupled", "none"):
        cfg = LossConfig(name=name, off_policy=mode, is_weight_cap=2.0)
        loss, metrics = policy_objective(logp, old, adv, mask, cfg, behaviour_logp=behav, stale_rows=stale)
        (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
        out[mode] = (loss.detach(), grad, metrics)
    assert torch.equal(out["decoupled"][0], 2.0 * out["none"][0])
    assert torch.equal(out["decoupled"][1], 2.0 * out["none"][1])
    assert out["decoupled"][2]["is_weight_truncated_fraction"] == 1.0
    assert out["decoupled"][2]["is_weight_mean"] == out["decoupled"][2]["is_weight_max"] == 2.0


def test_weights_ignore_garbage_at_masked_positions_and_rows_without_log_probs():
    prox = torch.tensor([[0.0, float("nan")], [-1.0, -1.0]])
    behav = torch.tensor([[-0.5, float("inf")], [-40.0, -40.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    weights, metrics = truncated_is_weights(prox, behav, torch.tensor([True, False]), mask, 2.0)
    torch.testing.assert_close(weights, torch.tensor([[math.exp(0.5), 1.0], [1.0, 1.0]]))
    assert metrics["is_weight_max"] == pytest.approx(math.exp(0.5))
    none, defaults = truncated_is_weights(prox, behav, torch.tensor([False, False]), mask, 2.0)
    assert torch.equal(none, torch.ones(2, 2))
    assert defaults == {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_weight_truncated_fraction": 0.0}


def test_a_registered_loss_gets_no_weights_without_stale_rows():
    """A loss written before token_weights existed still trains on-policy batches."""
    seen = []

    def old_style(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip, aggregation):
        seen.append(1)
        return ppo_clip(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                        dual_clip=dual_clip, aggregation=aggregation)

    from models.losses import LOSSES
    LOSSES.register("old_style")(old_style)
    try:
        _, logp, old, behav, _, adv, mask = random_inputs(seed=5)
        policy_objective(logp, old, adv, mask, LossConfig(name="old_style"), behaviour_logp=behav,
                         stale_rows=torch.zeros(3, dtype=torch.bool))
        assert seen == [1]
    finally:
        LOSSES.unregister("old_style")


# --- config ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, message", [
    ("off_policy", "truncated", "off_policy = 'truncated': must be one of ['decoupled', 'none']"),
    ("is_weight_cap", 0.5, "is_weight_cap = 0.5: must be >= 1"),
    ("is_weight_cap", 0.0, "is_weight_cap = 0.0: must be >= 1"),
    ("is_weight_cap", float("inf"), "is_weight_cap = inf: must be a finite number"),
    ("is_weight_cap", "2", "is_weight_cap = '2': must be >= 1"),
])
def test_loss_config_rejects_bad_off_policy_settings(field, value, message):
    with pytest.raises(ConfigValueError, match=re.escape(message)):
        LossConfig(**{field: value})


def test_loss_config_off_policy_defaults():
    cfg = LossConfig()
    assert (cfg.off_policy, cfg.is_weight_cap) == ("decoupled", 2.0)
    assert LossConfig(is_weight_cap=1.0).is_weight_cap == 1.0                 # C = 1: weights never exceed 1


# --- batches and layouts --------------------------------------------------------------------------------------------

def test_collate_carries_staleness_and_keeps_the_behaviour_log_probs():
    rows = [TrainRow([5, 6], [7, 8], [-0.5, -1.0], 1.0, staleness=2), TrainRow([4], [3], None, -1.0)]
    batch = collate(rows, PAD)
    assert batch["staleness"].dtype == torch.long and batch["staleness"].tolist() == [2, 0]
    assert torch.equal(batch["behaviour_logprobs"], batch["old_logprobs"])
    batch["old_logprobs"][0, 1] = 0.0                                        # the trainer replaces old_logprobs
    assert batch["behaviour_logprobs"][0, 1].item() == -0.5
    picked = select_rows(batch, [1, 0])                                      # as the micro-batches take rows
    assert picked["staleness"].tolist() == [0, 2] and picked["behaviour_logprobs"].shape == (2, 4)
    assert select_rows(batch, [1])["behaviour_logprobs"].shape == (1, 2)    # trimmed to its own width
    with pytest.raises(ValueError, match="row 0: staleness must be an int >= 0"):
        collate([TrainRow([5], [7], None, 0.0, staleness=-1)], PAD)


class CharTokenizer:
    """One id per character; only decode runs (the prompts below extend each other)."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return "".join(chr(i) for i in ids)


def step(index, prompt, response, staleness=None, trajectory="t0"):
    """A step as the train stage passes it (a frame row); `staleness` is a column only when given."""
    fields = dict(trajectory_id=trajectory, group_id="g0", step_index=index, prompt_ids=prompt, response_ids=response,
                  logprobs=[-0.5] * len(response), observation="")
    return SimpleNamespace(**fields) if staleness is None else SimpleNamespace(**fields, staleness=staleness)


def test_layouts_take_the_largest_staleness_of_their_steps():
    steps = [step(0, [1, 2], [3], staleness=1), step(1, [1, 2, 3, 9], [4, 5], staleness=3), step(2, [1, 2, 3, 9, 4, 5,
             9], [6], staleness=0)]
    assert [r.staleness for r in step_rows(steps)] == [1, 3, 0]
    row = concatenated(steps, CharTokenizer())                               # prefix-consistent prompts
    assert row.staleness == 3
    assert step_rows([step(0, [1], [2])])[0].staleness == 0                 # records without the field: on-policy
    assert RowSpec._fields[-1] == "staleness" and RowSpec._field_defaults["staleness"] == 0
    batch = collate_rows([row, row._replace(staleness=0)], PAD)
    assert batch["staleness"].tolist() == [3, 0]
    assert torch.equal(batch["behaviour_logprobs"], batch["old_logprobs"])


# --- the trainer ----------------------------------------------------------------------------------------------------

def stale_rows_for(model, tokenizer) -> tuple[list[TrainRow], dict[str, int]]:
    """4 rows with rollout log-probs = the start policy's + delta (so pi_prox / pi_behav = exp(-delta)):
    row 0 staleness 0 (delta +1: would be weighted e^-1, is not), row 1 staleness 1 (delta +0.5: w = e^-0.5),
    row 2 staleness 2 (delta -2: w = min(e^2, 2) = 2, truncated), row 3 staleness 1 without log-probs (w = 1)."""
    prompt = tokenizer("You are in the kitchen.\n> ")["input_ids"]
    responses = [tokenizer(text)["input_ids"] for text in ("take key 7", "go north", "open the red door", "look")]
    rows = [TrainRow(prompt, r, None, a) for r, a in zip(responses, (1.0, -0.5, 0.75, -1.0))]
    batch = collate(rows, PAD)
    with torch.no_grad():
        start = token_logprobs(model, batch)                                # [B, L]
    mask = batch["response_mask"].bool()
    deltas, staleness = (1.0, 0.5, -2.0, None), (0, 1, 2, 1)
    rows = [r._replace(old_logprobs=None if d is None else (start[b][mask[b]] + d).tolist(), staleness=s)
            for b, (r, d, s) in enumerate(zip(rows, deltas, staleness))]
    return rows, {"weighted_low": len(responses[1]), "truncated": len(responses[2])}


def expected_weights(counts: dict[str, int]) -> dict[str, float]:
    low, high = counts["weighted_low"], counts["truncated"]
    return {"is_weight_mean": (low * math.exp(-0.5) + high * 2.0) / (low + high), "is_weight_max": 2.0,
            "is_weight_truncated_fraction": high / (low + high)}


@pytest.mark.parametrize("epochs, mini_batch", [(2, 2), (1, 4)], ids=["proximal-recomputed", "one-step"])
def test_rl_update_reports_staleness_and_importance_weights(tiny_policy_dir, epochs, mini_batch):
    """Mixed staleness through DeepSpeed on the tiny policy, with the proximal log-probs recomputed before the
    updates (2 epochs x 2 mini-batches) and taken from the training forward (1 epoch, 1 mini-batch)."""
    model, tokenizer = load_policy(tiny_policy_dir)
    rows, counts = stale_rows_for(model, tokenizer)
    engine = make_ds_engine(model, OptimizerConfig(lr=1e-3), micro_batch_size=2)
    steps = []
    result = rl_update(engine, rows, pad_id=PAD, loss=LossConfig(is_weight_cap=2.0), progress=False,
                       update=UpdateConfig(epochs=epochs, micro_batch_size=2, mini_batch_size=mini_batch),
                       on_update=lambda step, m: steps.append(m))
    assert result["stale_row_fraction"] == 0.75
    assert (result["staleness_mean"], result["staleness_max"]) == (1.0, 2.0)
    assert {k: v for k, v in result.items() if k.startswith("staleness_count_")} == {
        "staleness_count_0": 1.0, "staleness_count_1": 2.0, "staleness_count_2": 1.0}
    # the proximal policy is the start policy in every update of the call, so the weights are known exactly
    for key, value in expected_weights(counts).items():
        assert result[key] == pytest.approx(value, abs=1e-4), key
    assert result["is_weight_max"] <= 2.0
    assert len(steps) == epochs * (4 // mini_batch)
    for m in steps:
        assert m["is_weight_max"] <= 2.0 and 0.0 <= m["is_weight_truncated_fraction"] <= 1.0
        rows_in_step = sum(v for k, v in m.items() if k.startswith("staleness_count_"))
        assert rows_in_step == mini_batch
        assert m["stale_row_fraction"] == pytest.approx(1.0 - m.get("staleness_count_0", 0.0) / mini_batch)
    for key in ("loss", "grad_norm", "logp_mismatch_mean", "ratio_mean"):
        assert math.isfinite(result[key]), key


def test_weights_below_one_are_not_hidden_by_updates_without_stale_tokens(tiny_policy_dir):
    """Only row 1 is stale and its weights are all e^-0.5 < 1: the largest weight of the call is e^-0.5, not the 1.0
    that a step without stale tokens reports."""
    model, tokenizer = load_policy(tiny_policy_dir)
    rows, _ = stale_rows_for(model, tokenizer)
    rows = [r._replace(staleness=1 if b == 1 else 0) for b, r in enumerate(rows)]
    engine = make_ds_engine(model, OptimizerConfig(lr=1e-3), micro_batch_size=1)
    steps = []
    result = rl_update(engine, rows, pad_id=PAD, loss=LossConfig(), progress=False,
                       update=UpdateConfig(epochs=2, micro_batch_size=1, mini_batch_size=2),
                       on_update=lambda step, m: steps.append(m))
    assert result["is_weight_max"] == pytest.approx(math.exp(-0.5), abs=1e-4)
    assert result["is_weight_mean"] == pytest.approx(math.exp(-0.5), abs=1e-4)
    assert result["is_weight_truncated_fraction"] == 0.0
    with_stale = [m for m in steps if m["stale_row_fraction"] > 0]
    without = [m for m in steps if m["stale_row_fraction"] == 0]
    assert len(with_stale) == len(without) == 2                              # one mini-batch of each per epoch
    assert all(m["is_weight_max"] == pytest.approx(math.exp(-0.5), abs=1e-4) for m in with_stale)
    assert all((m["is_weight_mean"], m["is_weight_max"], m["is_weight_truncated_fraction"]) == (1.0, 1.0, 0.0)
               for m in without)


def sgd_config(tmp_path) -> str:
    """Plain SGD (lr 1: the update is the gradient) so updates compare exactly."""
    path = tmp_path / "sgd.json"
    path.write_text(json.dumps({**load_ds_config(0), "optimizer": {"type": "SGD", "params": {}}}))
    return str(path)


def one_update(model, rows, tmp_path, loss: LossConfig, *, micro_batch_size: int, token_budget: int = 0):
    policy = copy.deepcopy(model)
    engine = make_ds_engine(policy, OptimizerConfig(lr=1.0, grad_clip=0.0), config_path=sgd_config(tmp_path),
                            micro_batch_size=micro_batch_size)
    result = rl_update(engine, rows, pad_id=PAD, loss=loss, progress=False,
                       update=UpdateConfig(epochs=2, micro_batch_size=micro_batch_size, mini_batch_size=len(rows),
                                           token_budget=token_budget))
    return [(p - q).detach() for p, q in zip(policy.parameters(), model.parameters())], result


def test_rl_update_without_stale_rows_is_bit_identical_under_both_corrections(tiny_policy_dir, tmp_path):
    model, tokenizer = load_policy(tiny_policy_dir)
    rows, _ = stale_rows_for(model, tokenizer)
    rows = [r._replace(staleness=0) for r in rows]
    runs = {mode: one_update(model, rows, tmp_path, LossConfig(off_policy=mode), micro_batch_size=2)
            for mode in ("decoupled", "none")}
    for a, b in zip(runs["decoupled"][0], runs["none"][0]):
        assert torch.equal(a, b)
    for key in ("loss", "pg_loss", "grad_norm", "entropy", "clip_fraction"):
        assert runs["decoupled"][1][key] == runs["none"][1][key], key
    assert runs["decoupled"][1]["stale_row_fraction"] == 0.0
    assert runs["decoupled"][1]["staleness_count_0"] == 4.0


def test_stale_rows_change_the_update_and_the_micro_batch_split_does_not(tiny_policy_dir, tmp_path):
    """decoupled differs from none on stale rows; cutting the mini-batch into micro-batches by a token budget gives
    the same update and weight metrics (the new tensors are sliced with the rows)."""
    model, tokenizer = load_policy(tiny_policy_dir)
    rows, counts = stale_rows_for(model, tokenizer)
    longest = max(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    whole, whole_result = one_update(model, rows, tmp_path, LossConfig(), micro_batch_size=4)
    split, split_result = one_update(model, rows, tmp_path, LossConfig(), micro_batch_size=4, token_budget=longest + 2)
    uncorrected, _ = one_update(model, rows, tmp_path, LossConfig(off_policy="none"), micro_batch_size=4)
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert any(not torch.allclose(a, b, atol=1e-6) for a, b in zip(whole, uncorrected))
    assert whole_result["micro_batches"] < split_result["micro_batches"]
    for key, value in expected_weights(counts).items():
        assert whole_result[key] == pytest.approx(value, abs=1e-4), key
        assert split_result[key] == pytest.approx(whole_result[key], abs=1e-6), key


# --- resume ---------------------------------------------------------------------------------------------------------

def test_fingerprint_of_an_all_on_policy_batch_is_unchanged():
    """The digest the trainer computed before staleness existed (same rows, same settings), so checkpoints of
    on-policy calls still resume; a stale row changes it."""
    rows = [TrainRow([5, 6], [7, 8, 9], [-0.5, -1.0, -1.5], 1.0), TrainRow([4], [3, 2], None, [0.5, -0.25])]
    settings = {"loss": {"name": "ppo_clip"}, "seed": 0}
    before = "d811a1d6d7e72ebe8b81ea06f5a3001e058b3f4a6cc87d4244cdad26cc426294"
    assert trainer._fingerprint(collate(rows, PAD), settings) == before
    stale = [rows[0]._replace(staleness=1), rows[1]]
    assert trainer._fingerprint(collate(stale, PAD), settings) != before
    fresh_settings = staleness.loss_settings(LossConfig(), collate(rows, PAD))
    assert "off_policy" not in fresh_settings and "is_weight_cap" not in fresh_settings
    assert staleness.loss_settings(LossConfig(is_weight_cap=3.0), collate(stale, PAD))["is_weight_cap"] == 3.0


def test_stale_run_resumes_to_the_uninterrupted_result(tiny_policy_dir, tmp_path):
    """Checkpoint after every update, drop the newest one, rerun: it redoes the last update and ends with the same
    parameters and the same staleness and weight metrics (kept in the checkpointed trainer state)."""
    model, tokenizer = load_policy(tiny_policy_dir)
    rows, _ = stale_rows_for(model, tokenizer)

    def train(checkpoint_dir, **kwargs):
        policy = copy.deepcopy(model)
        engine = make_ds_engine(policy, OptimizerConfig(lr=3e-3), micro_batch_size=2)
        result = rl_update(engine, rows, pad_id=PAD, seed=3, loss=LossConfig(), checkpoint_dir=checkpoint_dir,
                           progress=False, update=UpdateConfig(epochs=2, micro_batch_size=2, checkpoint_every=1),
                           **kwargs)
        return policy, result

    done, first = train(tmp_path / "ckpt")
    newest = sorted(p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_"))[-1]
    for path in sorted(newest.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    newest.rmdir()
    steps = []
    resumed, second = train(tmp_path / "ckpt", on_update=lambda s, m: steps.append(s))
    assert steps == [4]
    for p, q in zip(resumed.parameters(), done.parameters()):
        assert torch.equal(p, q)
    for key in ("stale_row_fraction", "staleness_count_1", "is_weight_mean", "is_weight_max",
                "is_weight_truncated_fraction", "loss"):
        assert second[key] == first[key], key
    with pytest.raises(ValueError, match="another run"):                   # staleness is part of the call
        rl_update(make_ds_engine(copy.deepcopy(model), OptimizerConfig(lr=3e-3), micro_batch_size=2),
                  [r._replace(staleness=r.staleness + 1) for r in rows], pad_id=PAD, seed=3, loss=LossConfig(),
                  checkpoint_dir=tmp_path / "ckpt", progress=False,
                  update=UpdateConfig(epochs=2, micro_batch_size=2, checkpoint_every=1))
