#!/usr/bin/env bash
# The GPU check, one prepared run for the lent device machine (H200, torch with CUDA, transformers, peft; no
# DeepSpeed, no network). From this machine:
#   make gpu-wheels          # DeepSpeed as a pure-Python wheel + its small deps into .whl/ (carried)
#   run: bash benchmarks/gpu_check.sh    with carry [".whl"], timeout_s ~420
# It installs the carried wheels into a scratch target, then measures DeepSpeed bf16 training tokens/s and MFU of
# SmolLM2-135M's architecture (benchmarks/gpu_train_mfu.py) at two batch shapes, writing $OUT/gpu_check*.json.
#   bash benchmarks/gpu_check.sh --dry-run     # here, on CPU: the same path on a 2-layer model (tests run it)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if ! "$PY" -c "import deepspeed" 2>/dev/null; then
    if ! ls .whl/deepspeed-*.whl >/dev/null 2>&1; then
        echo "no DeepSpeed here and no .whl/deepspeed-*.whl: run 'make gpu-wheels' and carry .whl" >&2
        exit 2
    fi
    SITE="$OUT/site"
    "$PY" -m pip install --quiet --no-index --no-deps --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
if [ "${1:-}" = "--dry-run" ]; then
    "$PY" benchmarks/gpu_train_mfu.py --dry-run --out "$OUT/gpu_check_dry_run.json"
    exit 0
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || true
"$PY" benchmarks/gpu_train_mfu.py --seq 1024 --micro-batch 16 --steps 30 --out "$OUT/gpu_check_b16.json"
"$PY" benchmarks/gpu_train_mfu.py --seq 2048 --micro-batch 32 --steps 20 --out "$OUT/gpu_check_b32.json"
