"""Build a gateway from paths and URLs, and run it under uvicorn (what ``arlflow gateway serve`` calls)."""
from __future__ import annotations

import errno
import socket
from pathlib import Path
from urllib.parse import urlsplit

import uvicorn
from fastapi import FastAPI

from datapool.gateway.app import create_app
from datapool.gateway.config import GatewayConfig
from datapool.gateway.upstreams import LocalEngineUpstream, OpenAIUpstreamPool
from datapool.store import DataPool, PoolUnwritableError
from models.build import load_policy, load_tokenizer
from models.hf_engine import TransformersEngine


def build_gateway(config: GatewayConfig, *, policy: str | Path, pool_url: str, upstream_urls: list[str] = (),
                  upstream_api_key: str | None = None, strategy: str = "round_robin",
                  max_batch_size: int = 64) -> tuple[FastAPI, DataPool]:
    """The app and its pool. Without ``upstream_urls`` the policy folder is served in-process
    (``TransformersEngine``); with them, the policy folder only provides the tokenizer and the samples come from
    those OpenAI-compatible servers (vLLM, other gateways)."""
    policy = Path(policy)
    for url in upstream_urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--upstream {url!r} is not an http(s) URL: give the upstream's OpenAI base URL, e.g. "
                             "http://gpu1:8000/v1")
    if upstream_urls:
        if not (policy / "tokenizer_config.json").is_file() and not (policy / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer in {policy}: --policy must be the served model's folder (the "
                                    "gateway renders chat templates and decodes ids with its tokenizer)")
        tokenizer = load_tokenizer(policy)
        upstream = OpenAIUpstreamPool(list(upstream_urls), tokenizer=tokenizer, api_key=upstream_api_key,
                                      strategy=strategy)
    else:
        model, tokenizer = load_policy(policy)
        engine = TransformersEngine(model, tokenizer, policy_version=config.policy_version,
                                    max_batch_size=max_batch_size)
        upstream = LocalEngineUpstream(engine)
    pool = DataPool(pool_url)
    problem = pool.check_writable(min_free_bytes=config.min_free_bytes)
    if problem is not None:  # every request would be a 503: refuse to start instead
        pool.close()
        raise PoolUnwritableError(f"{problem} (the gateway did not start)")
    return create_app(config, upstream, pool, tokenizer), pool


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` for ``serve``; ValueError with one line saying what to do when it cannot be
    (uvicorn binding itself would log its own line and exit with code 3)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port} is not a TCP port: use 1-65535 (0 picks a free one)")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    except OSError as err:
        raise ValueError(f"--host {host!r} cannot be resolved ({err.strerror or err}): use an IP address or a name "
                         "this machine resolves, e.g. 127.0.0.1 or 0.0.0.0") from err
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        hint = ("stop the process using it or pick another --port" if err.errno == errno.EADDRINUSE else
                "use --host 127.0.0.1, 0.0.0.0 or an address of this machine" if err.errno == errno.EADDRNOTAVAIL
                else "ports below 1024 need privileges: use another --port" if err.errno == errno.EACCES else
                "check --host and --port")
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}: {hint}") from err
    return sock


def serve(app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
          sock: socket.socket | None = None) -> None:
    """Run ``app`` until interrupted, on ``sock`` (from ``bind_socket``) or on host:port (uvicorn picks
    httptools/uvloop when they are installed)."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                           timeout_graceful_shutdown=5))
    server.run(sockets=None if sock is None else [sock])
    if not server.started:
        raise SystemExit(3)  # uvicorn's startup failure (it logged why)
