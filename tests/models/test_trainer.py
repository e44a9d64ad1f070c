"""DeepSpeed trainer on CPU: collate alignment, RL and SFT updates on a tiny policy."""
from __future__ import annotations

import os

import pytest
import torch

from models.build import load_policy, save_policy
from models.trainer import (
    TrainRow,
    collate,
    ensure_single_process_env,
    full_weights,
    load_ds_config,
    make_ds_engine,
    rl_update,
    sft_update,
    token_logprobs,
)

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
    engine = make_ds_engine(model, lr=1e-3, micro_batch_size=2)
    rows = make_rows(tokenizer)
    rows[0] = rows[0]._replace(old_logprobs=[-1.0] * len(rows[0].response_ids))
    metrics = rl_update(engine, rows, pad_id=PAD, micro_batch_size=2, epochs=2, clip_low=0.2, clip_high=0.28)
    assert engine.module is model
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert metrics["updates"] == 4.0
    for key in ("loss", "clip_fraction", "approx_kl", "ratio_mean", "entropy", "grad_norm", "advantage_mean",
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
    engine = make_ds_engine(model, lr=3e-3, micro_batch_size=4)
    for step in range(4):
        rl_update(engine, rows, pad_id=PAD, micro_batch_size=4, clip_low=0.2, clip_high=0.2, seed=step,
                  aggregation="seq-mean-token-mean")
    assert response_logprob(model, good) > good_before + 0.1
    assert response_logprob(model, bad) < bad_before - 0.1


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_zero_stages_train_report_grad_norm_and_save(policy, zero_stage, tmp_path):
    model, tokenizer = policy
    rows = make_rows(tokenizer)
    before = response_logprob(model, rows[0])
    engine = make_ds_engine(model, lr=3e-3, zero_stage=zero_stage, micro_batch_size=2, grad_accum=2)
    metrics = rl_update(engine, rows, pad_id=PAD, micro_batch_size=2, epochs=2)
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
    engine = make_ds_engine(model, lr=3e-3, micro_batch_size=3)
    metrics = sft_update(engine, pairs, pad_id=PAD, micro_batch_size=3, epochs=5, progress=False)
    assert eval_loss() < before - 0.5
    assert metrics["updates"] == 10.0
    assert metrics["loss_last"] < metrics["loss_first"]
    assert metrics["loss_last_epoch"] < metrics["loss_first_epoch"]
    assert metrics["tokens_per_s"] > 0
