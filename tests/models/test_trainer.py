"""DeepSpeed trainer on CPU: collate alignment, micro-batching, RL and SFT updates, reference policy and LoRA."""
from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch

from models.build import load_policy, save_policy
from models import trainer
from models.layouts import RowSpec, collate_rows
from models.aux_losses import AuxConfig
from models.losses import AGGREGATIONS, entropy_from_logits
from models.reference import ReferencePolicy, apply_lora
from models import forward
from models.batching import TrainRow, UpdateConfig, collate, pack_micro_batches
from models.ds_engine import (LrSchedule, OptimizerConfig, build_ds_config, ensure_single_process_env, full_weights,
                              load_ds_config, make_ds_engine, resolve_precision)
from models.forward import token_logprobs
from models.losses import LossConfig
from models.sft import sft_update
from models.trainer import rl_update

PAD = 0


def test_collate_aligns_response_mask_with_next_token_logits():
    rows = [TrainRow([5, 6], [7, 8, 9], [-0.1, -0.2, -0.3], 1.5), TrainRow([4], [3], None, -1.0)]
    batch = collate(rows, pad_id=PAD)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [4, 3, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["target_ids"].tolist() == [[6, 7, 8, 9, 0], [3, 0, 0, 0, 0]]
    # position t predicts token t + 1: the response tokens 7, 8, 9 are predicted at positions 1, 2, 3
    assert batch["response_mask"].tolist() == [[0, 1, 1, 1, 0], [1, 0, 0, 0, 0]]
    torch.testing.assert_close(batch["old_logprobs"][0], torch.tensor([0.0, -0.1, -0.2, -0.3, 0.0]))
    assert batch["advantages"].tolist() == [[0, 1.5, 1.5, 1.5, 0], [-1.0, 0, 0, 0, 0]]
    assert batch["has_old_logprobs"].tolist() == [True, False]
    targets = batch["target_ids"][batch["response_mask"].bool()].tolist()
    assert targets == [7, 8, 9, 3]
    per_token = collate([TrainRow([5, 6], [7, 8, 9], None, [0.5, -1.0, 2.0])], pad_id=PAD)
    assert per_token["advantages"].tolist() == [[0, 0.5, -1.0, 2.0, 0]]
    with pytest.raises(ValueError, match="advantages for 3"):
        collate([TrainRow([5, 6], [7, 8, 9], None, [0.5, -1.0])], pad_id=PAD)
    with pytest.raises(ValueError, match="empty prompt"):
        collate([TrainRow([], [1], None, 0.0)], pad_id=PAD)
    with pytest.raises(ValueError, match="old log-probs"):
        collate([TrainRow([1], [2, 3], [-1.0], 0.0)], pad_id=PAD)


def test_single_process_env_keeps_launcher_values(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", "29512")
    ensure_single_process_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == ("0", "1", "29512")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_shipped_deepspeed_configs_are_cpu_safe(stage):
    config = load_ds_config(stage)
    assert config["zero_optimization"]["stage"] == stage
    assert not config["bf16"]["enabled"] and not config["fp16"]["enabled"]
    with pytest.raises(FileNotFoundError, match="config_path"):
        load_ds_config(7)


def test_token_logprobs_match_a_manual_full_forward(tiny_policy_dir):
    model, _ = load_policy(tiny_policy_dir)
    rows = [TrainRow([5, 6, 7], [8, 9], None, 0.0), TrainRow([10], [11, 12, 13], None, 0.0)]
    batch = collate(rows, pad_id=PAD)
    with torch.no_grad():
        got = token_logprobs(model, batch)                                    # [B, L]
        for b, row in enumerate(rows):
            ids = torch.tensor([row.prompt_ids + row.response_ids])
            logp = torch.log_softmax(model(ids).logits[0], dim=-1)            # [T, V]
            n = len(row.prompt_ids)
            expected = logp[torch.arange(n - 1, n - 1 + len(row.response_ids)), torch.tensor(row.response_ids)]
            torch.testing.assert_close(got[b][batch["response_mask"][b].bool()], expected, atol=1e-5, rtol=0)


@pytest.fixture
def policy(tiny_policy_dir):
    return load_policy(tiny_policy_dir)


def make_rows(tokenizer, advantage_of_first: float = 1.0) -> list[TrainRow]:
    prompt = tokenizer("You are in the kitchen.\n> ")["input_ids"]
    good = tokenizer("take key 7")["input_ids"]
    bad = tokenizer("go north")["input_ids"]
    return [TrainRow(prompt, good, None, advantage_of_first), TrainRow(prompt, bad, None, -advantage_of_first)] * 2


def response_logprob(model, row: TrainRow) -> float:
    batch = collate([row], pad_id=PAD)
    with torch.no_grad():
        return float((token_logprobs(model, batch) * batch["response_mask"]).sum())


def test_rl_update_changes_parameters_and_reports_metrics(policy):
    model, tokenizer = policy
    before = [p.detach().clone() for p in model.parameters()]
    engine = make_ds_engine(model, OptimizerConfig(lr=1e-3), micro_batch_size=2)
    rows = make_rows(tokenizer)
    rows[0] = rows[0]._replace(old_logprobs=[-1.0] * len(rows[0].response_ids))
    metrics = rl_update(engine, rows, pad_id=PAD, loss=LossConfig(clip_low=0.2, clip_high=0.28), update=UpdateConfig(epochs=2, micro_batch_size=2))
    assert engine.module is model
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert metrics["updates"] == 4.0
    for key in ("loss", "clip_fraction", "approx_kl_k3", "ratio_mean", "entropy", "grad_norm", "advantage_mean",
                "advantage_std", "response_length", "tokens_per_s", "logp_mismatch_mean", "logp_mismatch_max"):
        assert key in metrics and torch.isfinite(torch.tensor(metrics[key])), key
    assert metrics["grad_norm"] > 0
    assert metrics["advantage_mean"] == 0.0
    assert metrics["logp_mismatch_max"] >= metrics["logp_mismatch_mean"] > 0


def test_positive_advantage_response_becomes_more_likely(policy):
    model, tokenizer = policy
    rows = make_rows(tokenizer)
    good, bad = rows[0], rows[1]
    good_before, bad_before = response_logprob(model, good), response_logprob(model, bad)
    engine = make_ds_engine(model, OptimizerConfig(lr=3e-3), micro_batch_size=4)
    for step in range(4):
        rl_update(engine, rows, pad_id=PAD, seed=step, loss=LossConfig(clip_low=0.2, clip_high=0.2, aggregation="seq-mean-token-mean"), update=UpdateConfig(micro_batch_size=4))
    assert response_logprob(model, good) > good_before + 0.1
    assert response_logprob(model, bad) < bad_before - 0.1


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_zero_stages_train_report_grad_norm_and_save(policy, zero_stage, tmp_path):
    model, tokenizer = policy
    rows = make_rows(tokenizer)
    before = response_logprob(model, rows[0])
    engine = make_ds_engine(model, OptimizerConfig(lr=3e-3, zero_stage=zero_stage), micro_batch_size=2, grad_accum=2)
    metrics = rl_update(engine, rows, pad_id=PAD, loss=LossConfig(), update=UpdateConfig(epochs=2, micro_batch_size=2))
    assert metrics["updates"] == 2.0  # 4 micro-batches, 2 per optimizer step
    assert metrics["grad_norm"] > 0
    with torch.no_grad():
        after = float((token_logprobs(engine, collate(rows[:1], PAD)) * collate(rows[:1], PAD)["response_mask"]).sum())
    assert after > before
    with full_weights(engine) as trained:
        save_policy(trained, tokenizer, tmp_path)
    reloaded, _ = load_policy(tmp_path)
    assert response_logprob(reloaded, rows[0]) == pytest.approx(after, abs=1e-4)


def test_sft_update_lowers_loss_on_a_fixed_set(policy):
    model, tokenizer = policy
    pairs = [
        (tokenizer(f"room {i}. Exits: north.\n> ")["input_ids"], tokenizer(f"take key {i}<|endoftext|>")["input_ids"])
        for i in range(6)
    ]

    def eval_loss() -> float:
        batch = collate([TrainRow(p, r, None, 0.0) for p, r in pairs], PAD)
        with torch.no_grad():
            lp = token_logprobs(model, batch)
        return float(-(lp * batch["response_mask"]).sum() / batch["response_mask"].sum())

    before = eval_loss()
    engine = make_ds_engine(model, OptimizerConfig(lr=3e-3), micro_batch_size=3)
    metrics = sft_update(engine, pairs, pad_id=PAD, progress=False, update=UpdateConfig(epochs=5, micro_batch_size=3))
    assert eval_loss() < before - 0.5
    assert metrics["updates"] == 10.0
    assert metrics["loss_last"] < metrics["loss_first"]
    assert metrics["loss_last_epoch"] < metrics["loss_first_epoch"]
    assert metrics["tokens_per_s"] > 0


# --- micro-batching, objective, schedule, precision -----------------------------------------------------------------

def test_pack_micro_batches_sorts_longest_first_and_respects_rows_and_budget():
    lengths = [3, 9, 5, 9, 2, 4]
    assert pack_micro_batches(list(range(6)), lengths, max_rows=2) == [[1, 3], [2, 5], [0, 4]]
    # budget 12, longest first: 9 | 9 | 5, 4 (2 x 5 = 10; a third row would make 15) | 3, 2 (2 x 3 = 6)
    assert pack_micro_batches(list(range(6)), lengths, max_rows=8, token_budget=12) == [[1], [3], [2, 5], [0, 4]]
    assert pack_micro_batches([4, 0, 2], lengths, max_rows=8, token_budget=15) == [[2, 0, 4]]  # 3 x 5 = 15
    assert pack_micro_batches([1], lengths, max_rows=8, token_budget=4) == [[1]]  # too long for the budget: alone


def varied_rows(tokenizer) -> list[TrainRow]:
    """8 rows of different prompt and response lengths, advantages of both signs, half with rollout log-probs."""
    rows = []
    for i in range(8):
        prompt = tokenizer(f"room {i}. " + "Exits: north, east. " * (i % 3) + "\n> ")["input_ids"]
        response = tokenizer(["take key 7", "go north", "open the red door now", "look"][i % 4])["input_ids"]
        logprobs = [-1.5] * len(response) if i % 2 else None
        rows.append(TrainRow(prompt, response, logprobs, float(i % 3) - 1.0 + 0.25 * i))
    return rows


def sgd_config(tmp_path) -> str:
    """A config whose optimizer is plain SGD: lr 1 makes the update equal to the gradient (Adam's would hide it)."""
    path = tmp_path / "sgd.json"
    path.write_text(json.dumps({**load_ds_config(0), "optimizer": {"type": "SGD", "params": {}}}))
    return str(path)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_token_budget_split_gives_the_update_of_one_big_batch(tiny_policy_dir, tmp_path, aggregation):
    """One optimizer step on 8 rows: as one micro-batch, or packed by a small token budget into several."""
    model, tokenizer = load_policy(tiny_policy_dir)
    rows = varied_rows(tokenizer)
    longest = max(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    updates, seen = {}, {}
    for name, budget in (("whole", None), ("split", longest + 3)):
        policy = copy.deepcopy(model)
        engine = make_ds_engine(policy, OptimizerConfig(lr=1.0, grad_clip=0.0), config_path=sgd_config(tmp_path), micro_batch_size=8)
        log = []
        rl_update(engine, rows, pad_id=PAD, loss=LossConfig(aggregation=aggregation),
                  update=UpdateConfig(micro_batch_size=8, mini_batch_size=8, token_budget=budget),
                  on_update=lambda step, m: log.append(m))
        updates[name] = [(p - q).detach() for p, q in zip(policy.parameters(), model.parameters())]
        seen[name] = log[0]
    assert seen["whole"]["micro_batches"] == 1 and seen["split"]["micro_batches"] >= 4
    assert max(float(u.abs().max()) for u in updates["whole"]) > 1e-3  # the step did move the weights
    for whole, split in zip(updates["whole"], updates["split"]):
        torch.testing.assert_close(split, whole, atol=1e-5, rtol=0)
    assert seen["split"]["loss"] == pytest.approx(seen["whole"]["loss"], abs=1e-6)
    assert seen["split"]["grad_norm"] == pytest.approx(seen["whole"]["grad_norm"], rel=1e-5)


def test_on_update_reports_every_optimizer_step(policy):
    model, tokenizer = policy
    rows = varied_rows(tokenizer)
    engine = make_ds_engine(model, OptimizerConfig(lr=1e-3), micro_batch_size=2, grad_accum=2)
    calls = []
    result = rl_update(engine, rows, pad_id=PAD, loss=LossConfig(),
                       update=UpdateConfig(epochs=2, micro_batch_size=2, token_budget=40),
                       on_update=lambda step, m: calls.append((step, m)))
    assert [step for step, _ in calls] == [1, 2, 3, 4]  # 8 rows / mini-batch of 2 x 2 = 2 steps per epoch
    for _, m in calls:
        for key in ("loss", "pg_loss", "clip_fraction", "approx_kl_k3", "entropy", "grad_norm", "lr", "advantage_mean",
                    "advantage_std", "response_length", "tokens_per_s", "micro_batches"):
            assert math.isfinite(m[key]), key
    assert calls[0][1]["approx_kl_k3"] == pytest.approx(0.0, abs=1e-10)  # old log-probs are the current weights'
    assert result["updates"] == 4.0
    assert result["loss"] == pytest.approx(sum(m["loss"] for _, m in calls) / 4)


def test_lr_schedule_warmup_then_cosine():
    schedule = LrSchedule("cosine", warmup_steps=2, total_steps=6, min_ratio=0.1)
    got = [schedule(step) for step in range(8)]
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert got == pytest.approx([0.5, 1.0] + cosine + [0.1])
    assert [LrSchedule("constant", warmup_steps=4)(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="total_steps"):
        LrSchedule("cosine", warmup_steps=3)


@pytest.mark.parametrize("epochs, micro, mini, accum", [(1, 2, 0, 1), (2, 3, 0, 1), (1, 2, 0, 2), (2, 2, 6, 1)])
def test_optimizer_steps_known_before_the_engine_are_the_updates_it_takes(policy, epochs, micro, mini, accum):
    """UpdateConfig.optimizer_steps sizes a cosine schedule before make_ds_engine: it must equal the updates that
    sft_update and rl_update then take, for every batching knob."""
    model, tokenizer = policy
    rows = varied_rows(tokenizer)
    update = UpdateConfig(epochs=epochs, micro_batch_size=micro, mini_batch_size=mini)
    for run in ("sft", "rl"):
        engine = make_ds_engine(model, OptimizerConfig(lr=1e-4), micro_batch_size=micro, grad_accum=accum)
        if run == "sft":
            taken = sft_update(engine, [(r.prompt_ids, r.response_ids) for r in rows], pad_id=PAD, update=update,
                               progress=False)["updates"]
        else:
            taken = rl_update(engine, rows, pad_id=PAD, loss=LossConfig(), update=update, progress=False)["updates"]
        assert taken == update.optimizer_steps(len(rows), grad_accum=accum), run


def test_engine_steps_the_lr_schedule(policy):
    model, tokenizer = policy
    engine = make_ds_engine(model, OptimizerConfig(lr=1e-2, lr_schedule="cosine", warmup_steps=2), micro_batch_size=2, total_steps=4)
    lrs = []
    rl_update(engine, varied_rows(tokenizer), pad_id=PAD, loss=LossConfig(), update=UpdateConfig(micro_batch_size=2),
              on_update=lambda step, metrics: lrs.append(metrics["lr"]))
    assert lrs == pytest.approx([5e-3, 1e-2, 1e-2, 5e-3], abs=1e-12)  # the lr each update used
    assert engine.lr_scheduler.state_dict()["last_epoch"] == 4


def test_precision_is_fp32_on_cpu_and_bf16_on_gpu(monkeypatch):
    assert resolve_precision("auto") == "fp32"
    assert not build_ds_config(0)["bf16"]["enabled"]
    with pytest.raises(ValueError, match="needs a GPU"):
        resolve_precision("bf16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert build_ds_config(2, precision="auto")["bf16"]["enabled"]
    assert not build_ds_config(2, precision="fp32")["bf16"]["enabled"]


def test_rl_update_rejects_bad_arguments(policy):
    model, tokenizer = policy
    engine = make_ds_engine(model, OptimizerConfig(lr=1e-3), micro_batch_size=2)
    rows = varied_rows(tokenizer)
    with pytest.raises(ValueError, match="reference"):
        rl_update(engine, rows, pad_id=PAD, loss=LossConfig(kl_beta=0.01), update=UpdateConfig(micro_batch_size=2))
    with pytest.raises(ValueError, match="aggregation = 'mean'"):
        LossConfig(aggregation="mean")
    with pytest.raises(ValueError, match="token_budget = -1: must be >= 0"):
        UpdateConfig(micro_batch_size=2, token_budget=-1)
    with pytest.raises(ValueError, match="micro_batch_size = 0: must be > 0"):
        UpdateConfig(micro_batch_size=0)
    with pytest.raises(ValueError, match="aux losses"):
        rl_update(engine, rows, pad_id=PAD, loss=LossConfig(), update=UpdateConfig(micro_batch_size=2),
                  aux=AuxConfig(names=("echo",)))


# --- reference policy and LoRA --------------------------------------------------------------------------------------

def test_reference_is_the_frozen_start_policy_and_kl_grows_from_zero(policy):
    model, tokenizer = policy
    rows = varied_rows(tokenizer)
    batch = collate(rows, PAD)
    with torch.no_grad():
        start = token_logprobs(model, batch)                                 # [B, L]
    reference = ReferencePolicy(model)
    assert not any(p.requires_grad for p in reference.model.parameters())
    engine = make_ds_engine(model, OptimizerConfig(lr=3e-3), micro_batch_size=4)
    log = []
    rl_update(engine, rows, pad_id=PAD, reference=reference, loss=LossConfig(kl_beta=0.1),
              update=UpdateConfig(epochs=3, micro_batch_size=4), on_update=lambda s, m: log.append(m))
    assert log[0]["kl_loss"] == pytest.approx(0.0, abs=1e-9)  # policy == reference before the first step
    assert log[-1]["kl_loss"] > 1e-6
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(reference.ref_logprobs(batch)[mask], start[mask], atol=1e-6, rtol=0)
    with torch.no_grad():
        assert not torch.allclose(token_logprobs(model, batch)[mask], start[mask], atol=1e-4)


def test_lora_trains_adapters_only_and_saves_a_plain_merged_model(policy, tmp_path):
    model, tokenizer = policy
    base_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows = varied_rows(tokenizer)
    batch = collate(rows, PAD)
    with torch.no_grad():
        start = token_logprobs(model, batch)                                 # [B, L]
    lora = apply_lora(model, r=4, alpha=8)
    reference = ReferencePolicy(lora)
    assert reference.shares_policy
    engine = make_ds_engine(lora, OptimizerConfig(lr=1e-2), micro_batch_size=4)
    rl_update(engine, rows, pad_id=PAD, reference=reference, loss=LossConfig(kl_beta=0.01), update=UpdateConfig(epochs=2, micro_batch_size=4))
    named = dict(lora.named_parameters())
    changed = {n for n, p in named.items() if "lora_" in n and not torch.equal(p, torch.zeros_like(p))
               and "lora_B" in n}
    assert changed, "the LoRA B matrices should have moved away from zero"
    base_after = {n.removeprefix("base_model.model.").replace(".base_layer", ""): p
                  for n, p in named.items() if "lora_" not in n}
    assert base_after.keys() == base_before.keys()
    for name, before in base_before.items():  # every base weight is untouched
        assert torch.equal(base_after[name], before), name
    with torch.no_grad():
        trained = token_logprobs(engine, batch)
        torch.testing.assert_close(reference.ref_logprobs(batch), start, atol=0, rtol=0)  # adapters switched off
    with full_weights(engine) as merged:
        assert not any("lora" in n for n, _ in merged.named_parameters())
        save_policy(merged, tokenizer, tmp_path / "merged")
    reloaded, _ = load_policy(tmp_path / "merged")
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(reloaded, batch)[mask], trained[mask], atol=1e-5, rtol=0)
    assert any("lora_" in n for n, _ in engine.module.named_parameters())  # the engine still trains adapters


def spec_rows() -> list[RowSpec]:
    """Concatenated-layout rows (prompt, response, observation, response) of two groups, ragged, for the aux losses."""
    rows = []
    for i in range(4):
        prompt, first, obs, second = [5 + i, 6, 7], [20 + i, 21], [40, 41 + i, 42][: 2 + i % 2], [30, 31 + i]
        ids = prompt + first + obs + second
        response = [0] * 3 + [1] * 2 + [0] * len(obs) + [1] * 2
        rows.append(RowSpec(
            input_ids=ids, response_mask=response, observation_mask=[0] * 5 + [1] * len(obs) + [0] * 2,
            old_logprobs=[-1.5 * r for r in response], turn_index=[0 if r else -1 for r in response],
            trajectory_id=f"t{i}", group_id=f"g{i // 2}", step_indices=(0, 1), advantage=(-1.0) ** i,
            success=i % 2 == 0,
        ))
    return rows


class ModuleAsEngine:
    """The part of a DeepSpeed engine that `_micro_objective` calls: forward, `module` and `device`."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.device = module, torch.device("cpu")

    def __call__(self, **inputs):
        return self.module(**inputs)


@pytest.mark.parametrize("lora", [False, True])
def test_lm_head_on_needed_positions_matches_the_full_forward(policy, monkeypatch, lora):
    """The head applied to response + observation positions only gives the loss, metrics and gradients of the full
    [B, L, V] logits (the pre-change computation, forced by reporting the head as not splittable)."""
    model, _ = policy
    engine = ModuleAsEngine(apply_lora(model) if lora else model)  # autograd.grad, not engine.backward, below
    part = collate_rows(spec_rows(), PAD)
    part["ref_logprobs"] = part["old_logprobs"] - 0.1
    objective = LossConfig(aggregation="seq-mean-token-mean", kl_beta=0.1, entropy_coef=0.01)
    assert forward.splits_lm_head(engine.module)
    results = {}
    for name, splits in (("split", True), ("full", False)):
        monkeypatch.setattr(forward, "splits_lm_head", lambda module, splits=splits: splits)
        loss, metrics = trainer._micro_objective(engine, part, objective, AuxConfig(names=("echo", "seal")),
                                                 on_policy=False)
        grads = torch.autograd.grad(loss, [p for p in engine.module.parameters() if p.requires_grad])
        results[name] = (loss.detach(), metrics, grads)
    (loss, metrics, grads), (full_loss, full_metrics, full_grads) = results["split"], results["full"]
    torch.testing.assert_close(loss, full_loss, atol=1e-6, rtol=0)
    assert metrics.keys() == full_metrics.keys()
    for key in ("entropy", "kl_loss", "pg_loss", "approx_kl_k3", "echo_loss", "seal_loss"):
        assert metrics[key] == pytest.approx(full_metrics[key], abs=1e-6), key
    for got, expected in zip(grads, full_grads):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_entropy_at_picked_positions_equals_entropy_from_logits(aggregation):
    logits = torch.randn(3, 5, 7)
    logits[0, 1, 2] = -math.inf
    mask = torch.tensor([[0, 1, 1, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.float32)
    expected = entropy_from_logits(logits, mask, aggregation)
    got = forward.entropy_at(logits[mask.bool()], mask, aggregation)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_one_step_update_reuses_the_training_logprobs(tiny_policy_dir, tmp_path, monkeypatch):
    """One epoch of one mini-batch skips the old-log-prob pass: same update and mismatch as with the pass."""
    model, tokenizer = load_policy(tiny_policy_dir)
    rows = varied_rows(tokenizer)
    with torch.no_grad():
        rollout = token_logprobs(model, collate(rows, PAD))                  # [B, L]
    mask = collate(rows, PAD)["response_mask"].bool()
    rows = [r._replace(old_logprobs=[v + 0.01 * (b + 1) for v in rollout[b][mask[b]].tolist()]) if b % 2 else r
            for b, r in enumerate(rows)]
    updates, results, passes = {}, {}, {}
    for name, reuse in (("reuse", True), ("recompute", False)):
        monkeypatch.setattr(trainer, "_reuses_training_logprobs", lambda e, n, reuse=reuse: reuse and e == n == 1)
        policy = copy.deepcopy(model)
        engine = make_ds_engine(policy, OptimizerConfig(lr=1.0, grad_clip=0.0), config_path=sgd_config(tmp_path), micro_batch_size=3)
        calls = []
        monkeypatch.setattr(trainer, "token_logprobs", lambda *a, calls=calls: calls.append(1) or token_logprobs(*a))
        results[name] = rl_update(engine, rows, pad_id=PAD, loss=LossConfig(), update=UpdateConfig(micro_batch_size=3, mini_batch_size=len(rows)))
        passes[name] = len(calls)
        updates[name] = [(p - q).detach() for p, q in zip(policy.parameters(), model.parameters())]
    assert passes == {"reuse": 0, "recompute": math.ceil(len(rows) / 3)}
    assert results["reuse"]["ratio_mean"] == pytest.approx(1.0, abs=1e-12)   # exactly 1 per token
    assert results["reuse"]["approx_kl_k3"] == 0.0 and results["reuse"]["clip_fraction"] == 0.0
    for key in ("logp_mismatch_mean", "logp_mismatch_max", "loss", "entropy", "grad_norm"):
        assert results["reuse"][key] == pytest.approx(results["recompute"][key], abs=1e-5), key
    assert results["reuse"]["logp_mismatch_max"] == pytest.approx(0.01 * len(rows), abs=1e-4)
    for reused, recomputed in zip(updates["reuse"], updates["recompute"]):
        torch.testing.assert_close(reused, recomputed, atol=1e-5, rtol=0)


def shared_prompt_rows() -> list[TrainRow]:
    """GRPO-like rows: two groups sharing a prompt each (different prompt lengths, so the shorter prompts are padded
    before their responses in the prefix pass), ragged responses, a row whose prompt differs from group A's in its
    last token only (it shares the prefix), and a row whose prompt is a strict prefix of group A's (not shared)."""
    a, b = [5, 6, 7, 8, 9], [11, 12, 13]
    rows = [TrainRow(a, [20], None, 1.0), TrainRow(a, [21, 22, 23], None, -0.5), TrainRow(a, [24, 25, 26, 27], None,
            [0.3, -0.2, 0.1, 0.4]), TrainRow(b, [30, 31], None, 0.7), TrainRow(b, [32, 33, 34, 35, 36], None, -1.2),
            TrainRow(a[:-1] + [10], [40, 41], None, 0.2), TrainRow(a[:3], [42, 43, 44], None, -0.3)]
    return [r._replace(old_logprobs=[-1.0 - 0.1 * i for i in range(len(r.response_ids))]) for r in rows]


class StagedModuleAsEngine(ModuleAsEngine):
    def zero_optimization_stage(self) -> int:
        return 0


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_shared_prompt_prefix_path_matches_the_plain_forward(policy, monkeypatch, aggregation):
    """Prefix once per distinct prompt + KV cache expanded to its rows gives the log-probs, entropy, loss and
    gradients of the plain forward over every padded row."""
    model, _ = policy
    model.train()
    engine = StagedModuleAsEngine(model)
    rows = shared_prompt_rows()
    part = collate(rows, PAD)
    part["ref_logprobs"] = part["old_logprobs"] - 0.1
    plan = forward.shared_prefix_plan(engine, part)
    assert plan is not None and plan.prefix_ids.shape[0] == 3 and plan.tail_ids.shape == (len(rows), 5)
    mask = part["response_mask"].bool()
    fast_logits = forward.shared_prefix_logits(engine, part, plan)
    plain_logits, _ = forward.logits_at(engine, part, mask, want_hidden=False)
    torch.testing.assert_close(fast_logits, plain_logits, atol=1e-5, rtol=0)
    objective = LossConfig(aggregation=aggregation, kl_beta=0.1, entropy_coef=0.01)
    results = {}
    for name, planner in (("fast", forward.shared_prefix_plan), ("plain", lambda engine, part: None)):
        monkeypatch.setattr(trainer, "shared_prefix_plan", planner)
        loss, metrics = trainer._micro_objective(engine, part, objective, AuxConfig(), on_policy=False)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        results[name] = (loss.detach(), metrics, grads)
    (loss, metrics, grads), (plain_loss, plain_metrics, plain_grads) = results["fast"], results["plain"]
    torch.testing.assert_close(loss, plain_loss, atol=1e-5, rtol=0)
    for key in ("entropy", "kl_loss", "pg_loss", "approx_kl_k3", "ratio_mean"):
        assert metrics[key] == pytest.approx(plain_metrics[key], abs=1e-5), key
    for got, expected in zip(grads, plain_grads):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_shared_prompt_prefix_path_falls_back_when_unusual(policy):
    model, _ = policy
    engine = StagedModuleAsEngine(model)
    unique = collate([TrainRow([5, 6], [7], None, 0.0), TrainRow([8, 9], [7, 3], None, 0.0)], PAD)
    assert forward.shared_prefix_plan(engine, unique) is None                # nothing shared
    assert forward.shared_prefix_plan(engine, collate_rows(spec_rows(), PAD)) is None  # RowSpec layout
    assert forward.shared_prefix_plan(StagedModuleAsEngine(apply_lora(copy.deepcopy(model))),
                                      collate(shared_prompt_rows(), PAD)) is None      # peft
    zero3 = StagedModuleAsEngine(model)
    zero3.zero_optimization_stage = lambda: 3
    assert forward.shared_prefix_plan(zero3, collate(shared_prompt_rows(), PAD)) is None


def test_rl_update_with_shared_prompts_matches_the_plain_forward(tiny_policy_dir, tmp_path, monkeypatch):
    """End to end through DeepSpeed: the same parameter update and metrics with and without the prefix path."""
    model, _ = load_policy(tiny_policy_dir)
    rows = shared_prompt_rows()
    updates, results, planned = {}, {}, {}
    for name, fast in (("fast", True), ("plain", False)):
        plans = []
        real_plan = forward.shared_prefix_plan
        monkeypatch.setattr(trainer, "shared_prefix_plan",
                            lambda e, p, fast=fast, plans=plans: plans.append(1) or (real_plan(e, p) if fast else None))
        policy = copy.deepcopy(model)
        engine = make_ds_engine(policy, OptimizerConfig(lr=1.0, grad_clip=0.0), config_path=sgd_config(tmp_path),
                                micro_batch_size=4)
        results[name] = rl_update(engine, rows, pad_id=PAD, loss=LossConfig(),
                                  update=UpdateConfig(micro_batch_size=4, mini_batch_size=len(rows)))
        planned[name] = len(plans)
        monkeypatch.setattr(trainer, "shared_prefix_plan", real_plan)
        updates[name] = [(p - q).detach() for p, q in zip(policy.parameters(), model.parameters())]
    assert planned["fast"] == 2
    for key in ("loss", "entropy", "grad_norm", "logp_mismatch_mean"):
        assert results["fast"][key] == pytest.approx(results["plain"][key], abs=1e-5), key
    for fast, plain in zip(updates["fast"], updates["plain"]):
        torch.testing.assert_close(fast, plain, atol=1e-5, rtol=0)
