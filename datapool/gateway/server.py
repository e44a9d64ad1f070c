"""Build a gateway from paths and URLs, and run it under uvicorn (what ``arlflow gateway serve`` calls)."""
from __future__ import annotations

from pathlib import Path

import uvicorn
from fastapi import FastAPI

from datapool.gateway.app import create_app
from datapool.gateway.config import GatewayConfig
from datapool.gateway.upstreams import LocalEngineUpstream, OpenAIUpstreamPool
from datapool.store import DataPool
from models.build import load_policy, load_tokenizer
from models.hf_engine import TransformersEngine


def build_gateway(config: GatewayConfig, *, policy: str | Path, pool_url: str, upstream_urls: list[str] = (),
                  upstream_api_key: str | None = None, strategy: str = "round_robin",
                  max_batch_size: int = 64) -> tuple[FastAPI, DataPool]:
    """The app and its pool. Without ``upstream_urls`` the policy folder is served in-process
    (``TransformersEngine``); with them, the policy folder only provides the tokenizer and the samples come from
    those OpenAI-compatible servers (vLLM, other gateways)."""
    policy = Path(policy)
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
    return create_app(config, upstream, pool, tokenizer), pool


def serve(app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> None:
    """Run ``app`` until interrupted (uvicorn picks httptools/uvloop when they are installed)."""
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False, timeout_graceful_shutdown=5)
