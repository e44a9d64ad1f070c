"""What the trainers show while they run: a tqdm bar per update call (named, with the last step's loss) and an
`on_update` callback per optimizer step, for RL and SFT alike."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.batching import TrainRow, UpdateConfig, collate
from models.build import load_policy
from models.ds_engine import OptimizerConfig, make_ds_engine
from models.forward import token_logprobs
from models.losses import LossConfig
from models.sft import sft_update
from models.trainer import rl_update

PAD = 0
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def policy(tiny_policy_dir):
    return load_policy(tiny_policy_dir)


def sft_pairs(tokenizer) -> list[tuple[list[int], list[int]]]:
    return [(tokenizer(f"room {i}. Exits: north.\n> ")["input_ids"], tokenizer(f"take key {i}")["input_ids"])
            for i in range(6)]


def rl_rows(tokenizer) -> list[TrainRow]:
    prompt = tokenizer("You are in the kitchen.\n> ")["input_ids"]
    return [TrainRow(prompt, tokenizer(text)["input_ids"], None, advantage)
            for text, advantage in [("take key 7", 1.0), ("go north", -1.0)] * 2]


def last_bar(err: str) -> str:
    """The bar as last drawn (tqdm redraws it in place after a carriage return)."""
    return err.replace("\r", "\n").strip().splitlines()[-1]


def test_rl_update_shows_a_named_bar_with_loss_and_tokens_per_s(policy, capsys):
    model, tokenizer = policy
    engine = make_ds_engine(model, OptimizerConfig(lr=1e-3), micro_batch_size=2)
    rl_update(engine, rl_rows(tokenizer), pad_id=PAD, loss=LossConfig(),
              update=UpdateConfig(epochs=2, micro_batch_size=2), desc="train r7")
    bar = last_bar(capsys.readouterr().err)
    assert bar.startswith("train r7: 100%") and "4/4" in bar, bar
    assert "loss=" in bar and "tokens_per_s=" in bar, bar
    rl_update(engine, rl_rows(tokenizer), pad_id=PAD, loss=LossConfig(), update=UpdateConfig(micro_batch_size=2),
              progress=False)
    assert "train" not in capsys.readouterr().err


def test_sft_update_reports_every_optimizer_step_and_its_mini_batch_loss(policy, capsys):
    """With one mini-batch of all pairs cut into two micro-batches, the first step's loss is the token mean over all
    pairs under the starting weights."""
    model, tokenizer = policy
    pairs = sft_pairs(tokenizer)
    batch = collate([TrainRow(p, r, None, 0.0) for p, r in pairs], PAD)
    with torch.no_grad():
        logp = token_logprobs(model, batch)                                      # [B, L]
    start_loss = float(-(logp * batch["response_mask"]).sum() / batch["response_mask"].sum())
    engine = make_ds_engine(model, OptimizerConfig(lr=3e-3), micro_batch_size=3)
    calls = []
    result = sft_update(engine, pairs, pad_id=PAD, update=UpdateConfig(epochs=3, micro_batch_size=3, mini_batch_size=6),
                        desc="warmstart", on_update=lambda step, m: calls.append((step, m)))
    assert [step for step, _ in calls] == [1, 2, 3] and result["updates"] == 3.0
    for _, m in calls:
        for key in ("loss", "grad_norm", "lr", "tokens_per_s"):
            assert math.isfinite(m[key]), key
    assert calls[0][1]["loss"] == pytest.approx(start_loss, rel=1e-5)
    assert calls[-1][1]["loss"] < calls[0][1]["loss"]
    bar = last_bar(capsys.readouterr().err)
    assert bar.startswith("warmstart: 100%") and "3/3" in bar and f"loss={calls[-1][1]['loss']:.3f}" in bar, bar


def test_importing_deepspeed_prints_no_accelerator_warning():
    """DeepSpeed's detection warns "Setting accelerator to CPU" on every import where no GPU is visible; the
    engine module imports it on first use (and not at all on import, so config reads stay fast)."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    done = subprocess.run([sys.executable, "-c", "import sys, models.ds_engine as e; "
                           "assert 'deepspeed' not in sys.modules; e.import_deepspeed()"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    assert "Setting accelerator" not in done.stdout + done.stderr


def test_stage_code_importing_deepspeed_through_accelerate_prints_no_accelerator_warning(tmp_path):
    """accelerate imports DeepSpeed itself (``save_pretrained`` unwraps the model through it: the bootstrap stage
    does), outside arlflow's lazy import: the warning must not reach a stage's output that way either."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    code = ("import sys; from models.build import TinyModelConfig, build_model, save_policy, train_tokenizer; "
            "tok = train_tokenizer(['go north to the lamp'] * 20, 300); "
            f"save_policy(build_model(tok, TinyModelConfig(), seed=0), tok, {str(tmp_path / 'policy')!r}); "
            "assert 'deepspeed' in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    assert "Setting accelerator" not in done.stdout + done.stderr
