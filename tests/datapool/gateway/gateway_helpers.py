"""Test helpers for the gateway: upstreams with known outputs, and a real uvicorn server on loopback."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from datapool.gateway.upstreams import UpstreamResult
from models.build import load_policy
from models.engine import SamplingParams
from models.hf_engine import TransformersEngine

ROOT = Path(__file__).resolve().parents[3]
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


class RecordingUpstream:
    """Wraps an upstream and keeps every result it returned: what 'the ids the engine sampled' were."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = getattr(inner, "name", "recording")
        self.results: list[UpstreamResult] = []
        self._lock = threading.Lock()

    def generate(self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1) -> list[UpstreamResult]:
        results = self.inner.generate(prompt_ids, sampling, n)
        with self._lock:
            self.results.extend(results)
        return results

    def health(self) -> bool:
        return self.inner.health()


class ScriptedUpstream:
    """Answers every prompt with the ids of ``text`` (+ eos), log-prob -1 each; optional delay per call."""

    def __init__(self, tokenizer, text: str = " ok", *, delay_s: float = 0.0, eos: bool = True) -> None:
        self.name = "scripted"
        self.tokenizer = tokenizer
        self.delay_s = delay_s
        self.calls = 0
        self._lock = threading.Lock()
        self.set_text(text, eos=eos)

    def set_text(self, text: str, *, eos: bool = True) -> None:
        self.token_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if eos:
            self.token_ids.append(self.tokenizer.eos_token_id)

    def generate(self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1) -> list[UpstreamResult]:
        with self._lock:
            self.calls += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        ids = self.token_ids[: sampling.max_new_tokens]
        finish = "stop" if ids and ids[-1] == self.tokenizer.eos_token_id else "length"
        return [UpstreamResult(list(prompt_ids), list(ids), [-1.0] * len(ids), finish, upstream=self.name)
                for _ in range(n)]

    def health(self) -> bool:
        return True


class FailingUpstream:
    name = "failing"

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def generate(self, prompt_ids, sampling, n=1):
        raise self.exc

    def health(self) -> bool:
        return False


class ThreadedServer:
    """A real uvicorn server for ``app`` on a free loopback port, in a background thread."""

    def __init__(self, app) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayProcess:
    """``python -m flows.gateway_cli serve`` as a subprocess (the real CLI entry), killable with SIGKILL."""

    def __init__(self, policy_dir: Path, pool_url: str, port: int, log_path: Path) -> None:
        self.args = [sys.executable, "-m", "flows.gateway_cli", "serve", "--policy", str(policy_dir),
                     "--pool-url", pool_url, "--port", str(port), "--api-key", KEY, "--default-max-tokens", "8"]
        self.port = port
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120) -> None:
        log = open(self.log_path, "ab")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(self.args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"gateway did not become healthy: {self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


def tiny_engine(policy_dir: Path):
    """(engine, tokenizer) over the session's tiny policy (tests/conftest.py: tiny_policy_dir)."""
    model, tokenizer = load_policy(policy_dir)
    return TransformersEngine(model, tokenizer, policy_version="tiny-v0"), tokenizer
