"""``EngineService``: the server's one object over its engine. Routes are thin functions over it
(``request.app.state.service``); nothing else holds server state.

Generation goes through ``RolloutEngine.async_generate``, so concurrent requests meet in the
scheduler's batch; a client that disconnects aborts its request and frees its KV; a request that
outlives ``request_timeout_s`` (say, queued behind a weight update waiting for a quiet point) is
aborted and answered 504. Weight and control calls run in a worker thread (the event loop keeps
serving) and answer the engine's ``WeightResult``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rollout.outputs import RolloutOutput
from rollout.server.metrics import ServerMetrics
from rollout.worker.messages import WeightResult


@dataclass
class ServerConfig:
    api_key: Optional[str] = None
    admin_api_key: Optional[str] = None
    allowed_weight_dirs: list[str] = field(default_factory=list)
    max_body_bytes: int = 32 << 20
    request_timeout_s: float = 600.0
    served_model_name: Optional[str] = None


def result_json(result: WeightResult) -> JSONResponse:
    """A weight operation's result as the route answers it: 200 on success, 400 otherwise."""
    body = {k: v for k, v in dataclasses.asdict(result).items() if k != "value"}
    return JSONResponse(body, status_code=200 if result.success else 400)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def service_of(request: Request) -> EngineService:
    """The app's service (a FastAPI dependency)."""
    return request.app.state.service


class EngineService:
    def __init__(self, engine, config: Optional[ServerConfig] = None):
        self.engine = engine
        self.config = config or ServerConfig()
        self.metrics = ServerMetrics(engine)
        self.model_name = self.config.served_model_name or os.path.basename(os.path.normpath(engine.config.model_path))
        self.allowed_dirs = [os.path.realpath(d) for d in self.config.allowed_weight_dirs]

    # ------------------------------------------------------------------ generation

    async def generate(self, request: Request, kwargs: dict) -> list[RolloutOutput]:
        """All samples of a request, aborted if the client leaves or the timeout passes."""
        t0 = time.perf_counter()
        try:
            task = asyncio.ensure_future(self.engine.async_generate(**kwargs))
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        deadline = time.monotonic() + self.config.request_timeout_s
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=1.0)
                if done:
                    break
                if await request.is_disconnected():
                    task.cancel()  # aborts the engine requests: their KV is freed
                    raise HTTPException(499, "client disconnected")
                if time.monotonic() > deadline:
                    task.cancel()
                    raise HTTPException(504, f"the request did not finish within {self.config.request_timeout_s}s "
                                             "(aborted); the engine may be waiting for a weight update")
            outs = task.result()
        except ValueError as exc:
            self.metrics.failed(request.url.path)
            raise HTTPException(400, str(exc)) from None
        except RuntimeError as exc:
            self.metrics.failed(request.url.path)
            raise HTTPException(503, str(exc)) from None
        self.metrics.finished(request.url.path, outs, time.perf_counter() - t0)
        return outs

    async def stream(self, request: Request, kwargs: dict,
                     shape: Callable[[RolloutOutput], Iterable[dict]]) -> StreamingResponse:
        """Server-sent events: ``shape(snapshot)`` per update, then ``[DONE]``; a client that
        leaves closes the iterator, which aborts its requests."""
        try:
            events = await self.engine.async_generate(stream=True, **kwargs)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        return StreamingResponse(self._events(request.url.path, events, shape), media_type="text/event-stream")

    async def _events(self, route: str, events, shape) -> AsyncIterator[str]:
        t0 = time.perf_counter()
        last: dict = {}
        deadline = time.monotonic() + self.config.request_timeout_s
        try:
            while True:
                try:  # a timed-out wait cancels the engine's iterator, which aborts the requests
                    snap = await asyncio.wait_for(events.__anext__(), max(0.0, deadline - time.monotonic()))
                except StopAsyncIteration:
                    break
                last[(snap.prompt_index, snap.sample_index)] = snap
                for piece in shape(snap):
                    yield sse(piece)
        except (TimeoutError, asyncio.TimeoutError):
            yield sse({"error": f"the request did not finish within {self.config.request_timeout_s}s (aborted)"})
        except (ValueError, RuntimeError) as exc:
            yield sse({"error": str(exc)})
        finally:
            await events.aclose()
        self.metrics.finished(route, list(last.values()), time.perf_counter() - t0)
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ engine calls

    async def call(self, fn, *args, **kwargs):
        """An engine call that may wait (a quiet point, a transfer): off the event loop; its
        ``ValueError`` (bad input) answers 400."""
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None

    async def weight_update(self, fn, *args, **kwargs) -> JSONResponse:
        """A weight update off the event loop, counted in the metrics, answered as its result."""
        result = await self.call(fn, *args, **kwargs)
        self.metrics.weight_update(result)
        return result_json(result)

    def check_weight_path(self, path: str) -> None:
        """403 unless ``path`` (symlinks resolved) lies under ``--allowed-weight-dirs`` (when set)."""
        if not self.allowed_dirs:
            return
        real = os.path.realpath(path)
        if not any(os.path.commonpath([real, d]) == d for d in self.allowed_dirs):
            raise HTTPException(403, f"{path!r} is outside --allowed-weight-dirs")

    # ------------------------------------------------------------------ what the info routes say

    @property
    def dtype_name(self) -> str:
        return str(self.engine.dtype).replace("torch.", "")

    def model_info(self) -> dict:
        engine, mc = self.engine, self.engine.model_config
        return {"model_path": engine.config.model_path, "tokenizer_path": engine.config.tokenizer_path
                or engine.config.model_path, "served_model_name": self.model_name, "architecture": mc.architecture,
                "is_generation": True, "vocab_size": mc.vocab_size, "dtype": self.dtype_name,
                "tp_size": engine.tp_size, "weight_version": engine.get_weight_version()}

    async def server_info(self) -> dict:
        engine, config = self.engine, self.config
        stats = await self.call(engine.get_stats)
        return {"engine_config": dataclasses.asdict(engine.config), "served_model_name": self.model_name,
                "stats": stats, "weight_version": engine.get_weight_version(),
                "dtype": self.dtype_name, "tp_size": engine.tp_size,
                "max_body_bytes": config.max_body_bytes, "request_timeout_s": config.request_timeout_s,
                "auth": config.api_key is not None, "admin_auth": config.admin_api_key is not None,
                "allowed_weight_dirs": self.allowed_dirs, "cpu": engine.cpu_kernels()}
