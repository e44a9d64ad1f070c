"""Two CPU ranks under the `deepspeed` launcher with ZeRO-2: same parameters as one process on the same rows, and
a run whose rank 0 is SIGKILLed inside a checkpoint save resumes bit-identical.

rl_update gives every rank rows r, r + 2, ... of each global mini-batch and normalizes the loss over the whole
mini-batch, so the sum of the ranks' gradients (DeepSpeed averages, rl_update multiplies by the world size) is the
one-process gradient. What differs is float summation order (another split into micro-batches, an all-reduce), so
one process and two ranks agree to float tolerance, not bitwise: after 4 AdamW steps the gap is ~2e-6.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.checkpoint import latest_complete_checkpoint

SCRIPT = Path(__file__).with_name("_train_script.py")
REPO = SCRIPT.parents[2]
# 16 rows, global mini-batches of 8 (4 per rank), 2 epochs: 4 optimizer steps; the budget forces several micro-batches
TRAIN_ARGS = ["--zero-stage", "2", "--rows", "16", "--mini-batch-size", "8", "--epochs", "2", "--token-budget", "30",
              "--checkpoint-every", "1"]
TOLERANCE = 1e-5


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(command: list[str], *, expect_success: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=500)
    if expect_success:
        assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return done


def run_two_ranks(out: Path, checkpoint_dir: Path, *extra: str, expect_success: bool = True):
    return run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port()), "--no_local_rank", str(SCRIPT), "--out", str(out),
                "--checkpoint-dir", str(checkpoint_dir), *TRAIN_ARGS, *extra], expect_success=expect_success)


def summary(out: Path) -> dict:
    return json.loads(out.with_suffix(".json").read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """Final parameters of an uninterrupted 2-rank ZeRO-2 run (checkpointing every step)."""
    folder = tmp_path_factory.mktemp("two_ranks")
    run_two_ranks(folder / "final.pt", folder / "ckpt")
    return folder / "final.pt"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_zero2_ranks_match_one_process(two_ranks, tmp_path):
    one = tmp_path / "one.pt"
    run([sys.executable, str(SCRIPT), "--out", str(one), "--checkpoint-dir", str(tmp_path / "ckpt"), *TRAIN_ARGS])
    assert summary(one)["world_size"] == 1 and summary(two_ranks)["world_size"] == 2
    assert summary(one)["steps_seen"] == summary(two_ranks)["steps_seen"] == [1, 2, 3, 4]
    assert summary(one)["max_change"] > 1e-3  # trained weights are compared, not two copies of the start
    single, ranks = torch.load(one, weights_only=True), torch.load(two_ranks, weights_only=True)
    assert single.keys() == ranks.keys()
    gap = max(float((single[name] - ranks[name]).abs().max()) for name in single)
    assert gap < TOLERANCE, f"max |one process - two ranks| = {gap}"
    for key in ("loss", "grad_norm", "clip_fraction", "entropy"):  # per-update metrics are reduced over ranks
        assert summary(two_ranks)["result"][key] == pytest.approx(summary(one)["result"][key], rel=1e-4, abs=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_killed_inside_a_save_resume_bit_identical(two_ranks, tmp_path):
    out, checkpoints = tmp_path / "final.pt", tmp_path / "ckpt"
    killed = run_two_ranks(out, checkpoints, "--die-in-save", "3", expect_success=False)  # rank 0 dies publishing 3
    assert killed.returncode != 0 and not out.exists()
    assert (checkpoints / "step_00000003.tmp").is_dir()
    assert latest_complete_checkpoint(checkpoints).name == "step_00000002"

    run_two_ranks(out, checkpoints)
    assert summary(out)["steps_seen"] == [3, 4]
    expected, got = torch.load(two_ranks, weights_only=True), torch.load(out, weights_only=True)
    differing = [name for name in expected if not torch.equal(got[name], expected[name])]
    assert not differing, {n: float((got[n] - expected[n]).abs().max()) for n in differing}
