"""Bearer API keys and the request body size limit, as one pure ASGI middleware in front of every route.

Both checks run before the app reads or parses anything, so a rejected request never reaches the store. Open
without a key: ``GET /health`` (load balancers and the upstream pool probe it) and the UI's static files under
``/ui`` (the page asks for the key and sends it with its ``/ui/api/...`` calls, which do need it).
"""
from __future__ import annotations

import hmac

from datapool.gateway.errors import error_body

_BODY_METHODS = {"POST", "PUT", "PATCH"}


def needs_auth(path: str) -> bool:
    if path == "/health":
        return False
    if path == "/ui" or path.startswith("/ui/"):
        return path.startswith("/ui/api/")
    return True


class SecurityMiddleware:
    def __init__(self, app, *, api_keys: tuple[str, ...], allow_no_auth: bool, max_body_bytes: int) -> None:
        self.app = app
        self.api_keys = tuple(key.encode() for key in api_keys)
        self.allow_no_auth = allow_no_auth
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if sum(name == b"authorization" for name, _ in scope["headers"]) > 1:
            # one rule for the API and the UI: a request that carries two keys is refused, never half-read
            await _send_error(send, 400, "more than one Authorization header: send exactly one "
                                         "`Authorization: Bearer <key>`", code="duplicate_authorization")
            return
        headers = dict(scope["headers"])
        if not self.allow_no_auth and needs_auth(scope["path"]) and not self._authorized(headers):
            await _send_error(send, 401, "missing or invalid API key: send `Authorization: Bearer <key>` with a key "
                                         "the gateway was started with (--api-key)",
                              code="invalid_api_key", extra_headers=[(b"www-authenticate", b"Bearer")])
            return
        if scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        value = headers.get(b"authorization", b"")
        scheme, _, key = value.partition(b" ")
        if scheme.lower() != b"bearer" or not key:
            return False
        key = key.strip()
        # compare against every key (no early exit) in constant time per key
        return sum(hmac.compare_digest(key, known) for known in self.api_keys) > 0

    async def _too_large(self, send) -> None:
        await _send_error(send, 413, f"request body larger than the gateway's limit of {self.max_body_bytes} bytes: "
                                     "send less context, or start the gateway with a larger max_body_bytes",
                          code="request_too_large")


async def _send_error(send, status: int, message: str, *, code: str,
                      extra_headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = error_body(status, message, code=code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
