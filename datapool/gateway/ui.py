"""The inspection UI at ``/ui``: browse, curate and batch-preview the data pool from a browser.

``router`` is a FastAPI ``APIRouter`` that carries its own ``/ui`` prefix (``app.include_router(router)``). It serves
a single static page (``static/index.html`` + ``app.js`` + ``style.css``; plain JS, no build step, no CDN) and a JSON
API under ``/ui/api/...`` that the page calls with ``fetch``. The app provides ``app.state.pool`` (a ``DataPool``)
and ``app.state.config`` (a ``GatewayConfig``: ``api_keys``, ``allow_no_auth``).

The JSON API sits behind the same bearer API keys as the OpenAI routes (the page asks for a key once and keeps it in
localStorage) unless ``allow_no_auth`` is set. The page and its static files need no key: they hold no data.
Errors come back in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import hmac
import math
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import pandas as pd
from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field, StrictBool

from datapool import reads
from datapool.batches import build_batch
from datapool.records import TRAJECTORY_FIELDS

STATIC_DIR = Path(__file__).parent / "static"
STATIC_FILES: dict[str, str] = {"app.js": "text/javascript", "style.css": "text/css", "index.html": "text/html"}
"""The only files ``/ui/static/{name}`` serves (a fixed list: no path ever reaches the filesystem from a request)."""

PROMPT_TAIL_CHARS = 600
"""How much of the end of a step's prompt the trajectory page shows by default (the full text is one click away)."""

MAX_PAGE = 500
"""Largest ``limit`` the trajectory list accepts."""

MAX_GROUPS = 500
"""How many groups of a round the Rounds view lists (the first by group id; the total is shown)."""

STEP_FLAGS = ("truncated", "invalid_action", "retokenized", "tool_failure", "prefix_break")
"""The step flags the UI shows and filters by (``datapool.curation.STEP_FLAGS``)."""
StepFlag = Literal["truncated", "invalid_action", "retokenized", "tool_failure", "prefix_break"]


# ------------------------------------------------------------------------------------------------ errors

def _error_response(status: int, message: str, *, type_: str, param: str | None = None,
                    code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


class _UIRoute(APIRoute):
    """Turns every failure of a UI endpoint into an OpenAI-shaped JSON error, whatever handlers the app has:
    bad input (ValueError, validation) -> 400, unknown trajectory/step (KeyError) -> 404, auth -> 401."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except HTTPException as exc:
                kind = "authentication_error" if exc.status_code == 401 else "invalid_request_error"
                response = _error_response(exc.status_code, str(exc.detail), type_=kind,
                                           code="invalid_api_key" if exc.status_code == 401 else None)
                if exc.headers:
                    response.headers.update(exc.headers)
                return response
            except RequestValidationError as exc:
                first = exc.errors()[0] if exc.errors() else {}
                loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path")]
                if first.get("type") == "json_invalid":
                    return _error_response(400, "the request body is not valid JSON", type_="invalid_request_error")
                message = f"{'.'.join(loc) or 'request'}: {first.get('msg', 'invalid request')}"
                return _error_response(400, message, type_="invalid_request_error", param=".".join(loc) or None)
            except KeyError as exc:
                message = exc.args[0] if exc.args else "not found"
                return _error_response(404, str(message), type_="not_found_error")
            except ValueError as exc:
                return _error_response(400, str(exc), type_="invalid_request_error")

        return guarded


# -------------------------------------------------------------------------------------------------- auth

def require_api_key(request: Request) -> None:
    """Accept ``Authorization: Bearer <key>`` for one of the configured keys, or anything when allow_no_auth."""
    config = request.app.state.config
    if getattr(config, "allow_no_auth", False):
        return
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() == "bearer" and key:
        for valid in getattr(config, "api_keys", ()):
            if hmac.compare_digest(key.strip().encode(), str(valid).encode()):
                return
    raise HTTPException(401, "missing or invalid API key: send 'Authorization: Bearer <key>' "
                             "(type the key into the UI's key box)", headers={"WWW-Authenticate": "Bearer"})


router = APIRouter(prefix="/ui", route_class=_UIRoute, tags=["ui"])
api = APIRouter(prefix="/api", route_class=_UIRoute, dependencies=[Depends(require_api_key)])


def _pool(request: Request) -> Any:
    return request.app.state.pool


def _plain(value: Any) -> Any:
    """Make ``value`` JSON-safe: numpy scalars/arrays to Python, non-finite floats to None, keys to str."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


# ------------------------------------------------------------------------------------------------- pages

@router.get("", include_in_schema=False, name="ui_index")
def index() -> FileResponse:
    """The single-page UI (routing happens client-side, in the URL hash)."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})


@router.get("/", include_in_schema=False)
def index_slash(request: Request) -> RedirectResponse:
    """``/ui/`` -> ``/ui``: the page's relative links assume the address without the slash."""
    return RedirectResponse(str(request.url_for("ui_index")), status_code=307)


@router.get("/static/{name}", include_in_schema=False)
def static_file(name: str) -> FileResponse:
    if name not in STATIC_FILES:
        raise KeyError(f"no static file '{name}'")
    return FileResponse(STATIC_DIR / name, media_type=STATIC_FILES[name], headers={"Cache-Control": "no-cache"})


@router.get("/config")
def ui_config(request: Request) -> dict[str, Any]:
    """What the page needs before it has a key: whether it must ask for one (open: outside ``/ui/api``)."""
    config = request.app.state.config
    return {"auth_required": not getattr(config, "allow_no_auth", False),
            "model_name": getattr(config, "model_name", None)}


# --------------------------------------------------------------------------------------------- JSON API

@api.get("/stats")
def stats(request: Request) -> dict[str, Any]:
    """Counts by status/env/round, steps, exclusions (``DataPool.stats``)."""
    return _plain(_pool(request).stats())


@api.get("/rounds")
def rounds(request: Request, env: str | None = None, round: int | None = Query(None, ge=0)) -> dict[str, Any]:
    """The Rounds view: every round's summary (``reads.round_summaries``) and the reward distribution of one
    round's groups (``round``, default the latest), of ``env``'s trajectories when given (empty means "any").
    Apart from ``/stats``, which the live list polls: this one scans every step."""
    env = env or None
    with _pool(request).engine.connect() as conn:
        summaries = reads.round_summaries(conn, env=env)
        if round is None and summaries:
            round = summaries[-1]["round"]
        groups, total = reads.group_returns(conn, round, env=env, limit=MAX_GROUPS) if round is not None else ([], 0)
    return _plain({"env": env, "rounds": summaries, "group_round": round, "groups": groups, "groups_total": total})


@api.get("/trajectories")
def list_trajectories(
    request: Request,
    env: str | None = None,
    round: int | None = Query(None, ge=0),
    policy_version: str | None = None,
    status: str | None = None,
    min_return: float | None = None,
    max_return: float | None = None,
    label: str | None = None,
    excluded: bool | None = None,
    flag: StepFlag | None = None,
    limit: int = Query(100, ge=1, le=MAX_PAGE),
    offset: int = Query(0, ge=0),
) -> dict[str, Any]:
    """Trajectories newest first, filtered like ``DataPool.query_trajectories`` (empty strings mean "any")."""
    filters = {"env": env or None, "round": round, "policy_version": policy_version or None,
               "status": status or None, "min_return": min_return, "max_return": max_return,
               "label": label or None, "excluded": excluded, "flag": flag}
    rows = _pool(request).query_trajectories(**filters, limit=limit, offset=offset)
    for row in rows:
        row.pop("scenario", None)  # can be long; the trajectory page shows it
    return {"trajectories": _plain(rows), "limit": limit, "offset": offset}


def _step_view(step: Any, curation: dict[str, Any] | None) -> dict[str, Any]:
    """What the trajectory page shows of one step (no raw token ids: only their counts)."""
    prompt = step.prompt_text
    flags = {
        "truncated": bool(step.truncated),
        "invalid_action": not bool(step.action_valid),
        "retokenized": bool(step.retokenized),
        "tool_failure": int(step.tool_successes) < int(step.tool_calls),
        "prefix_break": bool(step.prefix_break),
    }
    return {
        "step_index": step.step_index,
        "observation": step.observation,
        "prompt_tail": prompt[-PROMPT_TAIL_CHARS:],
        "prompt_text": prompt,
        "prompt_chars": len(prompt),
        "action": step.action,
        "response_text": step.response_text,
        "reward": step.reward,
        "process_reward": step.process_reward,
        "prompt_tokens": len(step.prompt_ids),
        "response_tokens": len(step.response_ids),
        "mean_logprob": float(np.mean(step.logprobs)) if len(step.logprobs) else None,
        "tool_calls": step.tool_calls,
        "tool_successes": step.tool_successes,
        "skill_ids": list(step.skill_ids),
        "flags": [name for name in STEP_FLAGS if flags[name]],
        "curation": _curation_view(curation),
    }


def _curation_view(row: dict[str, Any] | None) -> dict[str, Any]:
    row = row or {}
    return {"excluded": bool(row.get("excluded") or False), "label": row.get("label"),
            "note": row.get("note") or "", "updated_at": row.get("updated_at")}


@api.get("/trajectories/{trajectory_id:path}")  # :path: rollout ids hold "/"
def get_trajectory(request: Request, trajectory_id: str) -> dict[str, Any]:
    """One trajectory with its steps and their curation (labels/exclusions)."""
    pool = _pool(request)
    traj = pool.get_trajectory(trajectory_id)
    curation = pool.curation_of(trajectory_id)
    step_curation = {int(k): v for k, v in (curation.get("steps") or {}).items()}
    fields = {f.name: getattr(traj, f.name) for f in TRAJECTORY_FIELDS}
    fields["steps"] = [_step_view(s, step_curation.get(s.step_index))
                       for s in sorted(traj.steps, key=lambda s: s.step_index)]
    fields["curation"] = _curation_view(curation.get("trajectory"))
    return _plain(fields)


class CurationBody(BaseModel):
    """A label/exclusion change; ``step_index`` null targets the trajectory. Fields left null stay as they are."""
    step_index: int | None = Field(None, ge=0)
    excluded: StrictBool | None = None
    label: str | None = Field(None, max_length=200)
    note: str = Field("", max_length=2000)


@api.post("/trajectories/{trajectory_id:path}/curation")
def curate(request: Request, trajectory_id: str, body: CurationBody) -> dict[str, Any]:
    """Exclude/include or label a trajectory or one of its steps (kept, never deleted); returns the new state."""
    pool = _pool(request)
    pool.curate(trajectory_id, step_index=body.step_index, excluded=body.excluded, label=body.label,
                note=body.note)
    curation = pool.curation_of(trajectory_id)
    return _plain({"trajectory": _curation_view(curation.get("trajectory")),
                   "steps": {int(k): _curation_view(v) for k, v in (curation.get("steps") or {}).items()}})


class BatchBody(BaseModel):
    """A batch preview request: which algorithm's batch, under which token budget, over which steps."""
    algorithm: Literal["grpo", "gigpo"]
    token_budget: int = Field(..., gt=0)
    seed: int = 0
    env: str | None = None
    round: int | None = Field(None, ge=0)


def _group_rows(rows: pd.DataFrame) -> list[dict[str, Any]]:
    """Per chosen group: trajectories, steps and tokens (the batch as the trainer would see it)."""
    if rows is None or len(rows) == 0 or "group_id" not in rows:
        return []
    tokens = rows["prompt_ids"].map(len) + rows["response_ids"].map(len)
    out = []
    for group_id, part in rows.assign(_tokens=tokens).groupby("group_id", sort=True):
        out.append({"group_id": group_id, "trajectories": int(part["trajectory_id"].nunique()),
                    "steps": int(len(part)), "tokens": int(part["_tokens"].sum())})
    return out


@api.post("/batch-preview")
def batch_preview(request: Request, body: BatchBody) -> dict[str, Any]:
    """What ``build_batch`` would emit now for ``algorithm`` under ``token_budget`` (nothing is written)."""
    frame = _pool(request).steps_frame(round=body.round, env=body.env or None)
    batch = build_batch(frame, algorithm=body.algorithm, token_budget=body.token_budget, seed=body.seed)
    return _plain({"algorithm": body.algorithm, "token_budget": body.token_budget, "summary": batch.summary,
                   "groups": _group_rows(batch.rows)})


router.include_router(api)
