"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, with the HTTP status they go with.

The OpenAI SDKs map the status to an exception class (400 BadRequestError, 401 AuthenticationError, 404
NotFoundError, 409 ConflictError, 413 -> APIStatusError, ...) and show ``message``, so every message says what was
wrong and what to do.
"""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

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


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                                 "code": code}}).encode()


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message, param=param, code=code), status_code=status,
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


async def _on_unexpected(_request: Request, exc: Exception) -> Response:
    log.exception("gateway request failed", exc_info=exc)
    return error_response(500, f"internal gateway error ({type(exc).__name__}): see the gateway log")


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app returns is in OpenAI's error shape."""
    app.add_exception_handler(GatewayError, _on_gateway_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
