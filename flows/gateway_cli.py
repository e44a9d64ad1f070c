"""`arlflow gateway serve`: the OpenAI-compatible gateway that records every call into the data pool."""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer

from tasks.layout import Layout


gateway_app = typer.Typer(help="The OpenAI-compatible gateway in front of the data pool.", no_args_is_help=True,
                          pretty_exceptions_enable=False)


@gateway_app.callback()
def gateway() -> None:
    """The OpenAI-compatible gateway in front of the data pool."""


@gateway_app.command()
def serve(
    policy: Path = typer.Option(..., "--policy", help="policy folder (save_policy format): served in-process, or "
                                                      "only its tokenizer when --upstream is given"),
    host: str = typer.Option("127.0.0.1", help="interface to listen on (0.0.0.0 exposes it: use API keys)"),
    port: int = typer.Option(8000, help="TCP port"),
    pool_url: Optional[str] = typer.Option(None, "--pool-url", help="data pool SQLAlchemy URL (default: the "
                                                                    "workspace's, sqlite:///data/pool.db)"),
    experiment: Optional[str] = typer.Option(None, "--experiment", help="the pool of this DVC experiment instead "
                                             "(NAME or NAME@BASELINE, as in data/pools/; `dvc exp run` writes there)"),
    api_key: Optional[List[str]] = typer.Option(None, "--api-key", help="accepted bearer key (repeatable); also "
                                                                      "ARLFLOW_GATEWAY_API_KEYS (comma-separated)"),
    allow_no_auth: bool = typer.Option(False, "--allow-no-auth", help="local development: serve without keys"),
    upstream: Optional[List[str]] = typer.Option(None, "--upstream", help="OpenAI base URL of an upstream server "
                                                                        "(repeatable), e.g. http://gpu1:8000/v1"),
    upstream_api_key: Optional[str] = typer.Option(None, "--upstream-api-key", help="bearer key for the upstreams"),
    strategy: str = typer.Option("round_robin", help="upstream balancing: round_robin or least_loaded"),
    model_name: str = typer.Option("arlflow-policy", "--model-name", help="model id listed by /v1/models"),
    policy_version: Optional[str] = typer.Option(None, "--policy-version", help="recorded on every step "
                                                                             "(default: the policy folder name)"),
    max_body_bytes: int = typer.Option(1 << 20, "--max-body-bytes", help="largest request body accepted"),
    default_max_tokens: int = typer.Option(64, "--default-max-tokens", help="new tokens when a request sets none"),
    max_prompt_chars: int = typer.Option(131_072, "--max-prompt-chars", help="most characters of text per request "
                                                                          "(checked before tokenizing)"),
    log_level: str = typer.Option("warning", "--log-level"),
) -> None:
    """Serve /v1/chat/completions, /v1/completions, rewards and the /ui inspection UI."""
    from datapool.gateway.config import GatewayConfig  # here, not at import: `arlflow --help` stays fast
    from datapool.gateway.server import bind_socket, build_gateway, serve as run_server
    from datapool.store import PoolUnwritableError, masked_url

    keys = list(api_key or []) + [k for k in os.environ.get("ARLFLOW_GATEWAY_API_KEYS", "").split(",") if k]
    try:
        if pool_url and experiment:
            raise ValueError("pass --pool-url or --experiment, not both")
        pool_url = (f"sqlite:///{Layout(Path.cwd()).find_experiment_pool(experiment)}" if experiment
                    else pool_url or "sqlite:///data/pool.db")
        config = GatewayConfig(api_keys=tuple(keys), allow_no_auth=allow_no_auth, max_body_bytes=max_body_bytes,
                               model_name=model_name, policy_version=policy_version or policy.name,
                               default_max_tokens=default_max_tokens, max_prompt_chars=max_prompt_chars)
        app, pool = build_gateway(config, policy=policy, pool_url=pool_url, upstream_urls=list(upstream or []),
                                  upstream_api_key=upstream_api_key, strategy=strategy)
    except (ValueError, OSError, PoolUnwritableError) as err:  # one line, no traceback: what is wrong, what to do
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from err
    try:
        sock = bind_socket(host, port)
    except ValueError as err:
        pool.close()
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from err
    base = f"http://{'[' + host + ']' if ':' in host else host}:{sock.getsockname()[1]}"
    typer.echo(f"arlflow gateway: OpenAI API at {base}/v1, inspection UI at {base}/ui "
               f"(pool {masked_url(pool_url)}; Ctrl+C stops it)")
    try:
        run_server(app, host=host, port=port, log_level=log_level, sock=sock)
    finally:
        pool.close()


if __name__ == "__main__":
    gateway_app()
