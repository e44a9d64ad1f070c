"""A torch-extension build lock left by a killed process no longer hangs every later DeepSpeed start.

torch's FileBaton (which DeepSpeed's JIT ops load through) polls forever while ``<op dir>/lock`` exists; a process
SIGKILLed while it held the lock leaves the file behind. Found when the kill-9 fault suite killed `transfer` inside
DeepSpeed's start and the rerun waited 90 minutes. The locks here are made by torch's own FileBaton in real
processes, one killed and one alive."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from models.ds_engine import OptimizerConfig, clear_stale_build_locks, make_ds_engine

ROOT = Path(__file__).resolve().parents[2]
HOLD = textwrap.dedent("""
    import os, signal, sys, time
    from torch.utils.file_baton import FileBaton
    assert FileBaton(sys.argv[1]).try_acquire()
    if sys.argv[2] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    print("held", flush=True)
    time.sleep(600)
""")


def stale_lock(path: Path) -> Path:
    """``path``, created by a FileBaton in a process then killed with SIGKILL while it held it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-c", HOLD, str(path), "die"], timeout=60)
    assert done.returncode == -signal.SIGKILL and path.exists()
    return path


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="telling a stale lock needs Linux /proc")
def test_a_lock_left_by_a_killed_process_is_removed_and_a_held_one_is_kept(tmp_path):
    stale = stale_lock(tmp_path / "py311_cpu" / "dead_op" / "lock")
    flat = stale_lock(tmp_path / "flat_op" / "lock")  # the layout under TORCH_EXTENSIONS_DIR
    live_path = tmp_path / "py311_cpu" / "busy_op" / "lock"
    live_path.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(live_path), "hold"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert clear_stale_build_locks(tmp_path) == [flat, stale]
        assert not stale.exists() and not flat.exists()
        assert live_path.exists(), "a lock a live process holds (a build in progress) must stay"
        assert clear_stale_build_locks(tmp_path) == []
    finally:
        holder.kill()
        holder.wait()
    assert clear_stale_build_locks(tmp_path) == [live_path]  # its holder is gone now


def test_no_extension_dir_is_nothing_to_do(tmp_path):
    assert clear_stale_build_locks(tmp_path / "absent") == []


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() or not Path("/proc/self/fd").is_dir(),
                    reason="the CPU accelerator's shared-memory op, on Linux")
def test_deepspeed_starts_despite_a_stale_lock_on_its_cpu_op(tmp_path):
    # build (or find cached) the op in the machine's extension dir, then copy it: the copy loads without a rebuild
    make_ds_engine(torch.nn.Linear(4, 4), OptimizerConfig(lr=1e-3), micro_batch_size=1)
    from torch.utils.cpp_extension import get_default_build_root

    built = sorted(Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()).glob("*/deepspeed_shm_comm"))
    assert built, "DeepSpeed started on the CPU without its shared-memory op: where is it built?"
    op_dir = tmp_path / built[0].name  # under TORCH_EXTENSIONS_DIR an op's dir is <that dir>/<op>
    shutil.copytree(built[0], op_dir)
    stale_lock(op_dir / "lock")
    script = ("import torch\nfrom models.ds_engine import OptimizerConfig, make_ds_engine\n"
              "make_ds_engine(torch.nn.Linear(4, 4), OptimizerConfig(lr=1e-3), micro_batch_size=1)\nprint('started')")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    try:
        run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240,
                             env={**env, "TORCH_EXTENSIONS_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        pytest.fail("DeepSpeed waited on the stale lock left by a killed process")
    assert run.returncode == 0 and "started" in run.stdout, run.stderr[-3000:]
    assert "stale torch-extension build lock" in run.stderr
    assert not (op_dir / "lock").exists()
