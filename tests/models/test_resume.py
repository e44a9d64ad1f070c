"""Checkpoint and resume: complete checkpoints only, fallback past damaged ones, and a SIGKILLed run that resumes
to the very same weights as an uninterrupted one."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from models.build import load_policy
from models.checkpoint import MANIFEST, checkpoint_problem, latest_complete_checkpoint
from models.reference import apply_lora
from models.ds_engine import OptimizerConfig, make_ds_engine
from models.losses import LossConfig
from models.trainer import TrainRow, UpdateConfig, rl_update

PAD = 0
SCRIPT = Path(__file__).with_name("_train_script.py")
REPO = SCRIPT.parents[2]
# dropout makes the run consume the torch RNG, so the resume must restore it to end bit-identical
RUN_ARGS = ["--dropout", "0.1", "--zero-stage", "0", "--checkpoint-every", "2", "--rows", "24", "--epochs", "3"]
TOTAL_UPDATES = 18  # 3 epochs x 24 rows / mini-batch of 4


def rows_for(tokenizer) -> list[TrainRow]:
    rows = []
    for i in range(6):
        prompt = tokenizer(f"room {i}. Exits: north.\n> ")["input_ids"]
        response = tokenizer(["take key 7", "go north", "open door"][i % 3])["input_ids"]
        rows.append(TrainRow(prompt, response, None, float(i % 3) - 1.0))
    return rows


def train(policy_dir, checkpoint_dir, **kwargs):
    """A fresh engine on the saved tiny policy, then rl_update: 3 epochs x 3 mini-batches of 2 rows = 9 updates."""
    model, tokenizer = load_policy(policy_dir)
    engine = make_ds_engine(model, OptimizerConfig(lr=3e-3), micro_batch_size=2)
    result = rl_update(engine, rows_for(tokenizer), pad_id=PAD, seed=3, checkpoint_dir=checkpoint_dir, loss=LossConfig(),
                       update=UpdateConfig(epochs=3, micro_batch_size=2, checkpoint_every=1), **kwargs)
    return model, result


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_damaged_or_unfinished_newest_checkpoints_are_skipped(tiny_policy_dir, tmp_path):
    done, _ = train(tiny_policy_dir, tmp_path / "full")
    folders = sorted(p.name for p in (tmp_path / "full").iterdir() if p.is_dir())
    assert folders == ["step_00000008", "step_00000009"]  # the newest two are kept
    assert (tmp_path / "full" / "latest").read_text() == "step_00000009"
    assert latest_complete_checkpoint(tmp_path / "full").name == "step_00000009"

    newest = tmp_path / "full" / "step_00000009"
    weights = newest / "mp_rank_00_model_states.pt"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF                                              # one flipped byte, same size
    weights.write_bytes(bytes(data))
    assert "sha256" in checkpoint_problem(newest)
    assert latest_complete_checkpoint(tmp_path / "full").name == "step_00000008"
    (newest / MANIFEST).unlink()                                              # as if killed before the manifest
    assert "no manifest" in checkpoint_problem(newest)
    (tmp_path / "full" / "step_00000010.tmp").mkdir()                         # a save killed mid-way
    assert latest_complete_checkpoint(tmp_path / "full").name == "step_00000008"

    # the rerun resumes from step 8, redoes update 9 only, and ends where the uninterrupted run ended
    steps = []
    resumed, result = train(tiny_policy_dir, tmp_path / "full", on_update=lambda s, m: steps.append(s))
    assert steps == [9]
    assert result["updates"] == 9.0
    assert_same_parameters(resumed, done)
    assert not (tmp_path / "full" / "step_00000010.tmp").exists()             # leftovers are cleaned by a save


def test_finished_checkpoint_returns_its_result_and_weights(tiny_policy_dir, tmp_path):
    done, first = train(tiny_policy_dir, tmp_path / "ckpt")
    steps = []
    again, second = train(tiny_policy_dir, tmp_path / "ckpt", on_update=lambda s, m: steps.append(s))
    assert steps == [] and second == first
    assert_same_parameters(again, done)


@pytest.mark.parametrize("change", [{"clip_high": 0.28}, {"lr": 1e-3}])
def test_checkpoint_of_another_call_is_refused_before_loading(tiny_policy_dir, tmp_path, change):
    """Other rl_update settings, or another learning rate in the engine: the checkpoint is not this run's."""
    train(tiny_policy_dir, tmp_path / "ckpt")
    model, tokenizer = load_policy(tiny_policy_dir)
    before = [p.detach().clone() for p in model.parameters()]
    engine = make_ds_engine(model, OptimizerConfig(lr=change.pop("lr", 3e-3)), micro_batch_size=2)
    with pytest.raises(ValueError, match="another run"):
        rl_update(engine, rows_for(tokenizer), pad_id=PAD, seed=3, checkpoint_dir=tmp_path / "ckpt",
                  loss=LossConfig(**change), update=UpdateConfig(epochs=3, micro_batch_size=2, checkpoint_every=1))
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))  # nothing was loaded into it


# --- a real process, killed with SIGKILL ----------------------------------------------------------------------------

def run_script(out: Path, checkpoint_dir: Path, *extra: str) -> subprocess.Popen:
    # the child picks its own free port: this test process may hold the one in its environment
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--checkpoint-dir", str(checkpoint_dir),
               *RUN_ARGS, *extra]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, timeout: float = 300) -> None:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output[-4000:]


def load_parameters(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    folder = tmp_path_factory.mktemp("uninterrupted")
    finish(run_script(folder / "final.pt", folder / "ckpt"))
    summary = json.loads((folder / "final.json").read_text())
    assert summary["steps_seen"] == list(range(1, TOTAL_UPDATES + 1))
    return load_parameters(folder / "final.pt")


def assert_bit_identical(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    differing = [name for name in expected if not torch.equal(got[name], expected[name])]
    assert not differing, {n: float((got[n] - expected[n]).abs().max()) for n in differing}


def completed_steps(checkpoints: Path) -> int:
    newest = latest_complete_checkpoint(checkpoints)
    return int(newest.name.split("_")[1]) if newest is not None else 0


def kill_after_a_new_checkpoint(out: Path, checkpoints: Path, delay: float) -> int:
    """Starts the run, waits for a checkpoint newer than the ones there, SIGKILLs it `delay` s later; steps done."""
    before = completed_steps(checkpoints)
    process = run_script(out, checkpoints, "--step-sleep", "0.15")
    deadline = time.monotonic() + 240
    while completed_steps(checkpoints) <= before:
        assert process.poll() is None and time.monotonic() < deadline, "no new checkpoint before the run ended"
        time.sleep(0.02)
    time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL and not out.exists()
    return completed_steps(checkpoints)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkilled_run_resumes_bit_identical(uninterrupted, tmp_path):
    """Killed twice at arbitrary points (maybe mid-update, maybe mid-save), then run to the end."""
    out, checkpoints = tmp_path / "final.pt", tmp_path / "ckpt"
    delays = random.Random(0)
    first = kill_after_a_new_checkpoint(out, checkpoints, delays.uniform(0.0, 0.5))
    second = kill_after_a_new_checkpoint(out, checkpoints, delays.uniform(0.0, 0.5))
    assert 0 < first < second < TOTAL_UPDATES

    finish(run_script(out, checkpoints, "--step-sleep", "0.15"))
    steps = json.loads(out.with_suffix(".json").read_text())["steps_seen"]
    assert steps == list(range(second + 1, TOTAL_UPDATES + 1))               # resumed, not restarted
    assert_bit_identical(load_parameters(out), uninterrupted)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_killed_inside_a_save_resumes_bit_identical(uninterrupted, tmp_path):
    out, checkpoints = tmp_path / "final.pt", tmp_path / "ckpt"
    process = run_script(out, checkpoints, "--die-in-save", "3")  # SIGKILL after DeepSpeed wrote step 6's files
    process.communicate(timeout=300)
    assert process.returncode == -signal.SIGKILL
    assert (checkpoints / "step_00000006.tmp").is_dir()
    assert latest_complete_checkpoint(checkpoints).name == "step_00000004"

    finish(run_script(out, checkpoints))
    steps = json.loads(out.with_suffix(".json").read_text())["steps_seen"]
    assert steps == list(range(5, TOTAL_UPDATES + 1))
    assert_bit_identical(load_parameters(out), uninterrupted)


def test_lora_run_resumes_from_adapter_only_checkpoints(tiny_policy_dir, tmp_path):
    def lora_train(checkpoint_dir):
        model, tokenizer = load_policy(tiny_policy_dir)
        torch.manual_seed(0)                                                   # the LoRA A matrices are random
        lora = apply_lora(model, r=4, alpha=8)
        engine = make_ds_engine(lora, OptimizerConfig(lr=3e-3), micro_batch_size=2)
        rl_update(engine, rows_for(tokenizer), pad_id=PAD, seed=3, checkpoint_dir=checkpoint_dir, loss=LossConfig(), update=UpdateConfig(epochs=2, micro_batch_size=2, checkpoint_every=1))
        return lora

    done = lora_train(tmp_path / "ckpt")
    saved = torch.load(tmp_path / "ckpt" / "step_00000006" / "mp_rank_00_model_states.pt", weights_only=False)
    assert any("lora_" in name for name in saved["module"])
    assert not any("base_layer" in name for name in saved["module"])         # frozen base weights are left out
    (tmp_path / "ckpt" / "step_00000006" / MANIFEST).unlink()                  # resume from step 5
    assert_same_parameters(lora_train(tmp_path / "ckpt"), done)
