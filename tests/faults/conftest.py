"""Fault-suite fixtures: a Prefect API for stage processes, and ``stages``, which runs ``arlflow stage ...`` as a
real child process (forked from tests/faults/stage_runner.py, which imported the CLI once) and can SIGKILL it.

The gateway's kill -9 under load lives with the gateway tests and is part of this suite's scope without being
duplicated here: tests/datapool/gateway/test_crash.py::test_kill_9_under_load_keeps_every_acknowledged_record_
exactly_once (see README.md; run it with ``pytest tests/faults tests/datapool/gateway/test_crash.py``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("stage_runner.py")
# the children pick their own torch.distributed port, MLflow store (the project's) and Prefect API (the request's)
INHERITED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MLFLOW_TRACKING_URI",
             "PREFECT_API_URL", "ARLFLOW_MLFLOW_PARENT_RUN_ID")


@dataclass(frozen=True)
class StageExit:
    exit: int
    """The child's exit status; -9 when SIGKILL ended it."""
    wall_s: float
    log: Path

    @property
    def killed(self) -> bool:
        return self.exit == -signal.SIGKILL


class StageProcesses:
    """``run(root, "rollout", 1)`` runs ``arlflow stage rollout --round 1 --root ROOT`` in a fresh child process;
    ``kill_after_s`` SIGKILLs it (its whole process group) that long after it started; ``kill_at="commit"`` makes
    it SIGKILL itself inside its output commit."""

    def __init__(self, api_url: str, tmp: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k not in INHERITED}
        env.update(PYTHONPATH=str(REPO), PREFECT_HOME=str(tmp / "prefect-home"),
                   PREFECT_SERVER_ANALYTICS_ENABLED="false", HF_HUB_OFFLINE="1")
        self.api_url = api_url
        self.proc = subprocess.Popen([sys.executable, str(RUNNER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=tmp)

    def run(self, root: Path, stage: str, round_index: int | None = None, *, kill_after_s: float | None = None,
            kill_at: str | None = None, log_name: str | None = None) -> StageExit:
        argv = ["stage", stage, "--root", str(root)] + ([] if round_index is None else ["--round", str(round_index)])
        label = stage if round_index is None else f"{stage}_{round_index}"
        log = root / "logs" / "fault-suite" / f"{log_name or label}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        request = {"argv": argv, "root": str(root), "log": str(log), "prefect_api_url": self.api_url,
                   "kill_at": kill_at}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = self._reply()["pid"]
        if kill_after_s is not None:
            time.sleep(kill_after_s)
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:  # it finished first
                pass
        done = self._reply()
        return StageExit(exit=done["exit"], wall_s=done["wall_s"], log=log)

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the stage runner ({RUNNER}) died: exit {self.proc.wait()}; its stderr is in the "
                               "pytest output")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="session")
def prefect_api_url() -> Iterator[str]:
    """The Prefect API the stage processes report to: an active one (a harness another fixture started), else a
    temporary server of Prefect's own test harness for this session."""
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    import prefect.settings
    from prefect.testing.utilities import prefect_test_harness

    if prefect.settings.PREFECT_API_URL.value():
        yield prefect.settings.PREFECT_API_URL.value()
        return
    with prefect_test_harness(server_startup_timeout=120):
        yield prefect.settings.PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def stage_runner_process(tmp_path_factory) -> Iterator[StageProcesses]:
    """The fork server, started first so that its import overlaps the Prefect server's start."""
    runner = StageProcesses("", tmp_path_factory.mktemp("stage-runner"))
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def stages(stage_runner_process, prefect_api_url) -> StageProcesses:
    stage_runner_process.api_url = prefect_api_url
    return stage_runner_process
