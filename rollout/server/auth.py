"""The server's guards: API keys (``user`` for generation and reads, ``admin`` for weight and
control routes) as FastAPI dependencies, and the body-size limit as a middleware.

With ``api_key`` every route but ``/health`` needs ``Authorization: Bearer KEY`` (401); with
``admin_api_key`` the weight and control routes need that key and a generation key is refused
there (403); bodies past ``max_body_bytes`` are refused (413).
"""

from __future__ import annotations

import secrets
from typing import Optional

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse


def _key(request: Request) -> Optional[str]:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


def _is(key: Optional[str], expected: Optional[str]) -> bool:
    return key is not None and expected is not None and secrets.compare_digest(key, expected)


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


async def limit_body(request: Request, call_next):
    """413 for a declared body past ``max_body_bytes``."""
    limit = request.app.state.service.config.max_body_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        return JSONResponse({"detail": f"request body of {length} bytes exceeds the limit of {limit} bytes"},
                            status_code=413)
    return await call_next(request)
