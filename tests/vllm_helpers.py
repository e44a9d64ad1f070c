"""Where the vLLM venv is, and whether its live tests may be skipped (a system test, like PostgreSQL and Chromium:
``make test`` builds the venv, CI sets ARLFLOW_REQUIRE_SYSTEM_TESTS=1 so a missing one fails instead of skipping)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("ARLFLOW_VLLM_PYTHON", REPO / ".vllm-venv" / "bin" / "python"))


def require_vllm() -> Path:
    """The vLLM interpreter; skips (or fails under ARLFLOW_REQUIRE_SYSTEM_TESTS=1) when it is not built."""
    if VLLM_PYTHON.exists():
        return VLLM_PYTHON
    reason = f"no vLLM venv at {VLLM_PYTHON}: run `make vllm`"
    if os.environ.get("ARLFLOW_REQUIRE_SYSTEM_TESTS") == "1":
        pytest.fail(f"vLLM is required here (ARLFLOW_REQUIRE_SYSTEM_TESTS=1) but {reason}")
    pytest.skip(reason, allow_module_level=True)   # called at import: the whole module skips
