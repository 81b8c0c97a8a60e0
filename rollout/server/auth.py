"""The server's guards: API keys (``user`` for generation and reads, ``admin`` for weight and
control routes) as FastAPI dependencies, and the body-size limit as a plain ASGI middleware.

With ``api_key`` every route but ``/health`` needs ``Authorization: Bearer KEY`` (401); with
``admin_api_key`` the weight and control routes need that key and a generation key is refused
there (403); bodies past ``max_body_bytes`` are refused (413), whether declared (``Content-Length``)
or counted as they arrive (a chunked body declares nothing).

No ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` hands the route a ``receive`` that
never reports the client's disconnect, so a non-streaming request whose client left was never
aborted. ``BodyLimit`` wraps ``receive`` itself and passes every message through.
"""

from __future__ import annotations

import secrets
from typing import Optional

from fastapi import HTTPException, Request

from rollout.server.encoding import JSONResponse


def _key(request: Request) -> Optional[str]:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


def _is(key: Optional[str], expected: Optional[str]) -> bool:
    """Constant-time, over bytes: the header's bytes as sent (Starlette decodes headers as latin-1)
    against the key's UTF-8 (``compare_digest`` refuses non-ASCII ``str``)."""
    if key is None or expected is None:
        return False
    return secrets.compare_digest(key.encode("latin-1", "replace"), expected.encode("utf-8", "surrogatepass"))


def user(request: Request) -> None:
    """Generation and reads: open unless --api-key is set (either key then passes)."""
    config = request.app.state.service.config
    if config.api_key is None:
        return
    key = _key(request)
    if not (_is(key, config.api_key) or _is(key, config.admin_api_key)):
        raise HTTPException(401, "missing or wrong API key: send Authorization: Bearer <key>")


def admin(request: Request) -> None:
    """Weight and control routes: the admin key when set (the generation key is refused), else the
    API key when set, else open."""
    config = request.app.state.service.config
    key = _key(request)
    if config.admin_api_key is not None:
        if _is(key, config.admin_api_key):
            return
        if _is(key, config.api_key):
            raise HTTPException(403, "this route needs the admin API key; the generation key is not enough")
        raise HTTPException(401, "missing or wrong admin API key: send Authorization: Bearer <admin key>")
    if config.api_key is not None and not _is(key, config.api_key):
        raise HTTPException(401, "missing or wrong API key: send Authorization: Bearer <key>")


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int, seen: Optional[int] = None):
        what = "request body" if seen is None else f"request body of {seen} bytes"
        super().__init__(413, f"{what} exceeds the limit of {limit} bytes (--max-body-mb)")


class BodyLimit:
    """413 for a body past the app's ``max_body_bytes``: at once when ``Content-Length`` declares
    more, else as soon as the bytes received pass it (raised inside the route's body read, where the
    app's ``HTTPException`` handler answers it)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = scope["app"].state.service.config.max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            refused = JSONResponse({"detail": BodyTooLarge(limit, int(declared)).detail}, status_code=413,
                                   headers={"connection": "close"})
            return await refused(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counted, send)
