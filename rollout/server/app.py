"""The rollout server: one ``RolloutEngine`` behind an ASGI app (FastAPI), SGLang's routes and
OpenAI's.

The app holds one ``EngineService`` (``rollout.server.service``: generation, engine calls off the
event loop, weight updates, the info answers) in ``app.state.service``; the routes are thin
functions over it, in a module per family: ``sglang_routes`` (``/generate``), ``openai_routes``
(``/v1/...``) and ``control_routes`` (weights, control, ops); the guards (API keys, the body limit)
are in ``auth``.

Security: with ``api_key`` every route but ``/health`` needs ``Authorization: Bearer KEY`` (401);
with ``admin_api_key`` the weight and control routes need that key and a generation key is refused
there (403); ``update_weights_from_disk`` reads only under ``allowed_weight_dirs`` (the folder
opened once and checked where it lies, then read through that descriptor); tensor handles come
only from clients on this host, as JSON or read by an allowlist that runs nothing; bodies past ``max_body_bytes`` are
refused (413); ``/docs``, ``/redoc`` and ``/openapi.json`` are off when a key is set.
Bad bodies answer 400 naming the field (SGLang's status), never 422 or 500; so does bad input found
later, in any route family (``rollout.config.InputError``). A request's ``chat_template_kwargs`` are
template variables only, and template text it sends renders only with ``trust_request_chat_template``
(``rollout.engine.templates``).
"""

from __future__ import annotations

from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout.config import InputError
from rollout.engine.engine import RolloutEngine
from rollout.server import (
    areal_routes,
    control_routes,
    lora_routes,
    miles_routes,
    openai_routes,
    prime_rl_routes,
    sglang_routes,
    skyrl_routes,
    trl_routes,
    vllm_routes,
)
from rollout.server.auth import BodyLimit, admin, user
from rollout.server.encoding import JSONResponse
from rollout.server.service import EngineService, ServerConfig, result_json
from rollout.server.sglang_routes import sglang_item

__all__ = ["ServerConfig", "create_app", "result_json", "sglang_item"]


_OPENAI_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                 404: "NotFoundError", 413: "BadRequestError", 499: "ClientClosedRequest", 503: "ServiceUnavailableError",
                 504: "TimeoutError"}


def _error(request: Request, status: int, message: str, extra: Optional[dict] = None, headers=None,
           param: Optional[str] = None) -> JSONResponse:
    """SGLang's ``{"detail": ...}`` on its routes; OpenAI's ``{"error": {message, type, param, code}}``
    under ``/v1/`` (what the openai client and vLLM clients parse)."""
    if request.url.path.startswith("/v1/"):
        body = {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "APIError"), "param": param,
                          "code": status}}
    else:
        body = {"detail": message, **(extra or {})}
    return JSONResponse(body, status_code=status, headers=headers)


async def _http_error(request: Request, exc: StarletteHTTPException):
    if exc.status_code in (404, 405):  # a path or method that does not exist: still only behind the key
        try:
            user(request)
        except StarletteHTTPException as denied:
            exc = denied
    return _error(request, exc.status_code, exc.detail, headers=exc.headers)


def _field(loc) -> str:
    return ".".join(str(part) for part in loc if part != "body") or "body"


def _refused_key(request: Request) -> Optional[StarletteHTTPException]:
    """The route's key check (``user`` / ``admin``), if it refuses this request: a body that fails to
    parse is read before the route's dependencies run, and a caller without the key must learn only
    that (401/403), never what its body got wrong."""
    route = request.scope.get("route")
    for dep in getattr(route, "dependencies", None) or []:
        if dep.dependency in (user, admin):
            try:
                dep.dependency(request)
            except StarletteHTTPException as denied:
                return denied
    return None


async def _invalid(request: Request, exc: RequestValidationError):
    """A body that does not fit its route: SGLang's 400, naming every field and what it should be
    (never echoing the value: it may be NaN, or a string that cannot be encoded) — after the key."""
    denied = _refused_key(request)
    if denied is not None:
        return _error(request, denied.status_code, denied.detail, headers=denied.headers)
    errors = [{"field": _field(e.get("loc", ())), "message": e.get("msg", "invalid")} for e in exc.errors()]
    detail = "invalid request: " + "; ".join(f"{e['field']}: {e['message']}" for e in errors)
    return _error(request, 400, detail, {"errors": errors}, param=errors[0]["field"] if errors else None)


async def _bad_input(request: Request, exc: Exception):
    """Bad input however it surfaced in a handler (``InputError``; a pydantic model built there): 400."""
    if isinstance(exc, ValidationError):
        errors = [{"field": _field(e.get("loc", ())), "message": e.get("msg", "invalid")} for e in exc.errors()]
        detail = "invalid request: " + "; ".join(f"{e['field']}: {e['message']}" for e in errors)
        return _error(request, 400, detail, {"errors": errors}, param=errors[0]["field"] if errors else None)
    return _error(request, 400, str(exc))


def create_app(engine: RolloutEngine, config: Optional[ServerConfig] = None) -> FastAPI:
    service = EngineService(engine, config)
    keyed = service.config.api_key is not None  # the docs routes cannot send a key: off behind one
    app = FastAPI(title="rollout-worker", version="0.1.0", default_response_class=JSONResponse,
                  docs_url=None if keyed else "/docs", redoc_url=None if keyed else "/redoc",
                  openapi_url=None if keyed else "/openapi.json")
    app.state.service = service
    app.add_middleware(BodyLimit)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(InputError, _bad_input)
    app.add_exception_handler(ValidationError, _bad_input)
    for module in (sglang_routes, openai_routes, control_routes, lora_routes, vllm_routes, trl_routes, areal_routes,
                   skyrl_routes, prime_rl_routes, miles_routes):
        app.include_router(module.router)
    return app
