"""benchmarks/gpu_check.sh --dry-run: the GPU check's own path (arlflow's DeepSpeed engine factory, the MFU
arithmetic, the JSON it writes) on CPU with a 2-layer model, so the script is known to run before a GPU is lent."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_train_mfu import SMOLLM2_135M, flops_per_token

REPO = Path(__file__).resolve().parents[2]


def test_flops_per_token_of_smollm2_135m():
    params = 134_515_008                         # LlamaForCausalLM(SMOLLM2_135M), tied head counted once
    per_token = flops_per_token(params, SMOLLM2_135M["num_hidden_layers"], SMOLLM2_135M["hidden_size"], 1024)
    assert per_token == pytest.approx(6 * params + 12 * 30 * 576 * 1024)


@pytest.mark.slow
def test_gpu_check_dry_run_writes_its_result(tmp_path):
    # not this process's torch.distributed rendezvous (an earlier test's DeepSpeed engine may still hold its port)
    dist = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"}
    env = {**{k: v for k, v in os.environ.items() if k not in dist}, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_check_dry_run.json").read_text())
    assert result["dry_run"] is True and result["steps"] == 3 and result["tokens_per_s"] > 0
    assert 0 < result["mfu"] < 1 and result["achieved_tflops"] == pytest.approx(
        result["tokens_per_s"] * result["flops_per_token"] / 1e12)
