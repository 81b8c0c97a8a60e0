"""The rollout server: one ``RolloutEngine`` behind an ASGI app (FastAPI), SGLang's routes and
OpenAI's.

The app holds one ``EngineService`` (``rollout.server.service``: generation, engine calls off the
event loop, weight updates, the info answers) in ``app.state.service``; the routes are thin
functions over it, in a module per family: ``sglang_routes`` (``/generate``), ``openai_routes``
(``/v1/...``) and ``control_routes`` (weights, control, ops); the guards (API keys, the body limit)
are in ``auth``.

Security: with ``api_key`` every route but ``/health`` needs ``Authorization: Bearer KEY`` (401);
with ``admin_api_key`` the weight and control routes need that key and a generation key is refused
there (403); ``update_weights_from_disk`` reads only under ``allowed_weight_dirs`` (symlinks
resolved first); tensor handles come only from clients on this host, as JSON (never a pickle);
bodies past ``max_body_bytes`` are refused (413).
"""

from __future__ import annotations

from typing import Optional

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from rollout.engine.engine import RolloutEngine
from rollout.server import control_routes, openai_routes, sglang_routes
from rollout.server.auth import limit_body
from rollout.server.service import EngineService, ServerConfig, result_json
from rollout.server.sglang_routes import sglang_item

__all__ = ["ServerConfig", "create_app", "result_json", "sglang_item"]


async def _http_error(request: Request, exc: HTTPException):
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)


def create_app(engine: RolloutEngine, config: Optional[ServerConfig] = None) -> FastAPI:
    app = FastAPI(title="rollout-worker", version="0.1.0")
    app.state.service = EngineService(engine, config)
    app.middleware("http")(limit_body)
    app.add_exception_handler(HTTPException, _http_error)
    for module in (sglang_routes, openai_routes, control_routes):
        app.include_router(module.router)
    return app
