"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, with the HTTP status they go with.

The OpenAI SDKs map the status to an exception class (400 BadRequestError, 401 AuthenticationError, 404
NotFoundError, 409 ConflictError, 413 -> APIStatusError, ...) and show ``message``, so every message says what was
wrong and what to do. A pool that cannot be written (disk full, read-only) is a 503 ``pool_unwritable``; anything
unexpected is a 500 that leaves the connection usable (``UnexpectedErrorMiddleware``).
"""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from datapool.writability import PoolUnwritableError

log = logging.getLogger("arlflow.gateway")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
          422: "invalid_request_error", 502: "upstream_error", 503: "upstream_error"}


class GatewayError(Exception):
    """A request the gateway refuses (4xx) or could not serve (5xx); nothing was written for it."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None,
               kind: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind or _TYPES.get(status, "server_error"),
                                 "param": param, "code": code}}).encode()


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, kind: str | None = None) -> Response:
    return Response(error_body(status, message, param=param, code=code, kind=kind), status_code=status,
                    media_type="application/json", headers=headers)


def _field_path(loc: tuple) -> str:
    """``("body", "messages", 0, "role")`` -> ``messages[0].role``."""
    out = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


async def _on_gateway_error(_request: Request, exc: GatewayError) -> Response:
    return error_response(exc.status, exc.message, param=exc.param, code=exc.code)


async def _on_validation_error(_request: Request, exc: RequestValidationError) -> Response:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": "invalid"}
    if first.get("type") == "json_invalid":
        return error_response(400, "the request body is not valid JSON: send a JSON object with "
                                   "Content-Type: application/json", code="invalid_json")
    param = _field_path(tuple(first.get("loc", ())))
    if not param:  # the body as a whole: not an object, or not sent as JSON
        return error_response(400, "the request body must be a JSON object sent with Content-Type: "
                                   "application/json", code="invalid_json")
    if first.get("type") == "missing":
        message = f"missing required field '{param}'"
    else:
        message = f"invalid field '{param}': {first.get('msg', 'invalid value')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return error_response(400, message, param=param or None, code="invalid_value")


async def _on_http_error(_request: Request, exc: StarletteHTTPException) -> Response:
    if exc.status_code == 404:
        message = "no such route: see GET /v1/models, POST /v1/chat/completions, POST /v1/completions"
    else:
        message = str(exc.detail)
    return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))


async def _on_pool_unwritable(_request: Request, exc: PoolUnwritableError) -> Response:
    log.error("%s", exc)
    return error_response(503, str(exc), code="pool_unwritable", kind="server_error")


def _unexpected(exc: Exception) -> Response:
    log.exception("gateway request failed", exc_info=exc)
    return error_response(500, f"internal gateway error ({type(exc).__name__}): see the gateway log")


class UnexpectedErrorMiddleware:
    """Answers an exception no handler took with a 500 in OpenAI's shape, and stops it here.

    Starlette's handler for ``Exception`` sends its 500 and then re-raises (for servers to log), and uvicorn
    answers an exception that escapes the app by closing the connection: the client's next request on that
    keep-alive connection failed. Add this outermost. A response already under way (a stream cut mid-body) cannot
    become an error any more: that exception goes on, and the connection closes as it must."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:  # noqa: BLE001 - the point: nothing escapes to the server
            if started:
                raise
            await _unexpected(exc)(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app returns is in OpenAI's error shape (with ``UnexpectedErrorMiddleware`` added last)."""
    app.add_exception_handler(GatewayError, _on_gateway_error)
    app.add_exception_handler(PoolUnwritableError, _on_pool_unwritable)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
