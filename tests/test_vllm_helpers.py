"""Without a vLLM venv the live vLLM tests skip (a developer's `pytest` before `make vllm`), and fail where system
tests are required (CI): never a collection error."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.vllm_helpers import REPO


def run_vllm_tests(tmp_path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "ARLFLOW_REQUIRE_SYSTEM_TESTS"}
    environ.update(ARLFLOW_VLLM_PYTHON=str(tmp_path / "no-venv" / "python"), **env)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "tests/tasks/test_vllm_engine.py"], cwd=REPO, env=environ, capture_output=True, text=True)


def test_a_missing_vllm_venv_skips_its_module_or_fails_where_system_tests_are_required(tmp_path):
    skipped = run_vllm_tests(tmp_path)
    # the module skips whole at import: no test collected, no collection error
    assert skipped.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, skipped.stdout[-2000:]
    assert "1 skipped" in skipped.stdout and "error" not in skipped.stdout.lower()

    required = run_vllm_tests(tmp_path, ARLFLOW_REQUIRE_SYSTEM_TESTS="1")
    assert required.returncode != 0
    assert "vLLM is required here (ARLFLOW_REQUIRE_SYSTEM_TESTS=1)" in required.stdout
    assert "run `make vllm`" in required.stdout
