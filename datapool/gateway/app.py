"""The OpenAI-compatible gateway: every response it returns was first committed to the data pool as a step.

Routes (also under ``/t/{trajectory_id}``, so an SDK only changes its ``base_url``)::

    GET  /health                          no key needed; 503 when the upstream is down or the pool unwritable
    GET  /v1/models
    POST /v1/chat/completions             messages, tools, tool_choice, sampling, n, stream (SSE), seed, logprobs
    POST /v1/completions                  prompt as text or token ids; vLLM's return_token_ids
    POST /v1/trajectories/{id}/reward     {"reward": float, "step_index": int | null}
    POST /v1/trajectories/{id}/complete   {"status": "complete" | "truncated" | "failed", "won": bool | null}
    GET  /v1/trajectories/{id}

Headers: ``X-Trajectory-Id`` / ``X-Group-Id`` (instead of the path prefix), ``Idempotency-Key`` (a retry gets the
stored response, nothing is sampled or written twice), ``X-Env`` and ``X-Round`` (recorded on a new trajectory).
A request without a trajectory id is its own one-step trajectory (left "open" so a reward can still arrive); its id
is in the response (``trajectory_id``) and the ``X-Trajectory-Id`` response header.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from starlette.responses import Response, StreamingResponse

from datapool.gateway import ui
from datapool.gateway.chat import ChatRenderer
from datapool.gateway.committer import GroupCommitter
from datapool.gateway.config import GatewayConfig
from datapool.gateway.errors import GatewayError, UnexpectedErrorMiddleware, install_error_handlers
from datapool.gateway.health import PoolWritability
from datapool.gateway.recorder import Recorder, RequestContext, Served
from datapool.gateway.schemas import ChatCompletionRequest, CompleteRequest, CompletionRequest, RewardRequest
from datapool.gateway.security import SecurityMiddleware
from datapool.gateway.streaming import sse_events
from datapool.gateway.upstreams import Upstream
from datapool.store import TrajectoryClosedError

_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,200}$")
_ID_FIELDS = ("token_ids", "prompt_token_ids")


def _json(payload: object, *, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """Always valid JSON: a non-finite float (a stored return written before returns were kept finite) is sent as
    null, never as the non-JSON ``Infinity``."""
    try:
        text = json.dumps(payload, separators=(",", ":"), allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(payload), separators=(",", ":"), allow_nan=False)
    return Response(text.encode(), status_code=status, media_type="application/json", headers=headers)


def _finite(value: object) -> object:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _checked_id(value: str | None, what: str) -> str | None:
    if value is None:
        return None
    if not _ID.match(value):
        raise GatewayError(400, f"{what} {value[:80]!r} is not valid: use 1-200 characters from A-Z a-z 0-9 . _ : @ "
                                "/ + = -", param=what.replace(" ", "_"))
    return value


def _context(request: Request) -> RequestContext:
    headers = request.headers
    in_path = request.path_params.get("trajectory_id")
    in_header = headers.get("x-trajectory-id")
    if in_path is not None and in_header is not None and in_path != in_header:
        raise GatewayError(400, f"trajectory id {in_path!r} in the path and {in_header!r} in X-Trajectory-Id "
                                "differ: send one", param="trajectory_id")
    round_text = headers.get("x-round", "0")
    if not (round_text.isascii() and round_text.isdigit()) or len(round_text) > 10 or int(round_text) > 2 ** 31 - 1:
        raise GatewayError(400, f"X-Round must be an int in [0, 2**31 - 1] in ASCII digits, got {round_text[:40]!r}",
                           param="round")
    key = headers.get("idempotency-key")
    if key is not None and not 1 <= len(key) <= 255:
        raise GatewayError(400, "Idempotency-Key must be 1-255 characters", param="idempotency_key")
    return RequestContext(trajectory_id=_checked_id(in_path or in_header, "trajectory id"),
                          group_id=_checked_id(headers.get("x-group-id"), "group id"), idempotency_key=key,
                          env=_checked_id(headers.get("x-env"), "env") or "gateway", round=int(round_text))


def _client_view(response: dict, return_token_ids: bool) -> dict:
    """The stored response without the id fields when the request did not ask for them (vLLM's default)."""
    if return_token_ids:
        return response
    view = {k: v for k, v in response.items() if k not in _ID_FIELDS}
    view["choices"] = [{k: v for k, v in choice.items() if k not in _ID_FIELDS} for choice in response["choices"]]
    return view


def _headers(served: Served) -> dict[str, str]:
    headers = {"X-Trajectory-Id": served.trajectory_ids[0]}
    if served.step_index is not None:
        headers["X-Step-Index"] = str(served.step_index)
    if served.replayed:
        headers["X-Idempotent-Replay"] = "true"
    return headers


def _trajectory_json(traj) -> dict:
    return dataclasses.asdict(traj)


def _api_routes(state: dict) -> APIRouter:
    """The routes; ``state`` holds the recorder, pool, config and upstream shared by every request."""
    router = APIRouter()
    recorder: Recorder = state["recorder"]
    config: GatewayConfig = state["config"]
    pool = state["pool"]

    @router.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [{"id": config.model_name, "object": "model",
                                                  "created": state["started"], "owned_by": "arlflow"}]})

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        ctx = _context(request)
        served = await run_in_threadpool(recorder.chat, ctx, body)
        return _respond(served, body, chat=True)

    @router.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        ctx = _context(request)
        served = await run_in_threadpool(recorder.completion, ctx, body)
        return _respond(served, body, chat=False)

    def _respond(served: Served, body, *, chat: bool) -> Response:
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = sse_events(served.response, recorder.renderer, chat=chat,
                                return_token_ids=body.return_token_ids, include_usage=include_usage)
            return StreamingResponse(iter(events), media_type="text/event-stream", headers=_headers(served))
        return _json(_client_view(served.response, body.return_token_ids), headers=_headers(served))

    @router.post("/v1/trajectories/{target_id:path}/reward")  # :path: rollout ids hold "/"
    async def reward(target_id: str, body: RewardRequest) -> Response:
        def apply():
            pool.set_reward(target_id, body.reward, step_index=body.step_index, require_open=True)
            return pool.get_trajectory(target_id)
        traj = await run_in_threadpool(_pool_call, apply, target_id)
        return _json({"trajectory_id": target_id, "episode_return": traj.episode_return, "status": traj.status,
                      "num_steps": traj.num_steps})

    @router.post("/v1/trajectories/{target_id:path}/complete")
    async def complete(target_id: str, body: CompleteRequest) -> Response:
        def apply():
            pool.finish_trajectory(target_id, status=body.status, won=body.won, require_open=True)
            return pool.get_trajectory(target_id)
        traj = await run_in_threadpool(_pool_call, apply, target_id)
        return _json({"trajectory_id": target_id, "status": traj.status, "won": traj.won,
                      "episode_return": traj.episode_return, "num_steps": traj.num_steps})

    @router.get("/v1/trajectories/{target_id:path}")
    async def get_trajectory(target_id: str) -> Response:
        traj = await run_in_threadpool(_pool_call, lambda: pool.get_trajectory(target_id), target_id)
        return _json(_trajectory_json(traj))

    return router


def _pool_call(fn, trajectory_id: str):
    """Map the pool's errors to HTTP: unknown trajectory/step -> 404, bad value -> 400."""
    try:
        return fn()
    except KeyError as exc:
        raise GatewayError(404, f"{exc.args[0] if exc.args else exc}: check the trajectory id (and step_index)",
                           param="trajectory_id", code="trajectory_not_found") from exc
    except TrajectoryClosedError as exc:
        raise GatewayError(409, str(exc), param="trajectory_id", code="trajectory_finished") from exc
    except ValueError as exc:
        raise GatewayError(400, str(exc)) from exc


def create_app(config: GatewayConfig, upstream: Upstream, pool, tokenizer) -> FastAPI:
    """The gateway app over ``upstream`` (where samples come from) and ``pool`` (a ``datapool.store.DataPool``)."""
    committer = GroupCommitter(pool)
    writability = PoolWritability(pool, min_free_bytes=config.min_free_bytes)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await run_in_threadpool(committer.close)
        await run_in_threadpool(writability.close)

    app = FastAPI(title="arlflow gateway", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    renderer = ChatRenderer(tokenizer)
    state = {"recorder": Recorder(config, upstream, pool, renderer, committer), "config": config, "pool": pool,
             "started": int(time.time())}
    app.state.pool = pool
    app.state.config = config
    app.state.upstream = upstream
    app.state.tokenizer = tokenizer
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        # on the event loop, never in the generation threads: both answers are cached marks (upstream.health()
        # reads the upstreams' marks, writability the pool's last failed write or probe; see gateway.health)
        problem = await writability.problem()
        healthy = upstream.health()
        status = "pool_unwritable" if problem else "ok" if healthy else "upstream_down"
        body = {"status": status, "upstream": getattr(upstream, "name", "?"), "upstream_healthy": healthy,
                "pool": "unwritable" if problem else "writable"}
        if problem:
            body["pool_problem"] = problem
        return _json(body, status=200 if status == "ok" else 503)

    routes = _api_routes(state)
    app.include_router(routes)
    app.include_router(routes, prefix="/t/{trajectory_id}")
    app.include_router(ui.router)  # carries its own /ui prefix
    app.add_middleware(SecurityMiddleware, api_keys=config.api_keys, allow_no_auth=config.allow_no_auth,
                       max_body_bytes=config.max_body_bytes)
    app.add_middleware(UnexpectedErrorMiddleware)  # outermost: no exception reaches uvicorn (it would close)
    return app
