"""The rollout server: one ``RolloutEngine`` behind an ASGI app (FastAPI), SGLang's routes and
OpenAI's.

Generation goes through ``RolloutEngine.async_generate``, so concurrent requests meet in the
scheduler's batch (nothing is serialised per request); a client that disconnects aborts its
request and frees its KV; a request that outlives ``request_timeout_s`` (say, queued behind a
weight update that waits for a quiet point) is aborted and answered 504. Weight and control calls
run in a worker thread (the event loop keeps serving) and answer the engine's ``WeightResult``.

Security: with ``api_key`` every route but ``/health`` needs ``Authorization: Bearer KEY`` (401);
with ``admin_api_key`` the weight and control routes need that key and a generation key is refused
there (403); ``update_weights_from_disk`` reads only under ``allowed_weight_dirs`` (symlinks
resolved first); tensor handles come only from clients on this host, as JSON (never a pickle);
bodies past ``max_body_bytes`` are refused (413).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from rollout.engine import RolloutEngine
from rollout.messages import WeightResult
from rollout.outputs import RolloutOutput
from rollout.server import protocol as P
from rollout.server.metrics import ServerMetrics


@dataclass
class ServerConfig:
    api_key: Optional[str] = None
    admin_api_key: Optional[str] = None
    allowed_weight_dirs: list[str] = field(default_factory=list)
    max_body_bytes: int = 32 << 20
    request_timeout_s: float = 600.0
    served_model_name: Optional[str] = None


# ---------------------------------------------------------------------------------------------
# shaping outputs


def _finish(o: RolloutOutput) -> Optional[dict]:
    if o.finish_reason is None:
        return None
    out: dict[str, Any] = {"type": o.finish_reason}
    if o.matched_stop is not None:
        out["matched"] = o.matched_stop
    return out


def sglang_item(o: RolloutOutput, return_logprob: bool) -> dict:
    """One sample as SGLang's ``/generate`` shapes it, plus our per-token weight versions."""
    meta: dict[str, Any] = {
        "id": o.rid, "prompt_index": o.prompt_index, "sample_index": o.sample_index, "finish_reason": _finish(o),
        "prompt_tokens": len(o.prompt_token_ids), "completion_tokens": len(o.output_token_ids),
        "cached_tokens": o.num_cached_tokens, "weight_version": o.weight_version,
        "output_weight_versions": o.output_weight_versions, "e2e_latency": o.latency_s,
    }
    if return_logprob:
        meta["logprob_mode"] = o.logprob_mode
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(o.output_logprobs, o.output_token_ids)]
        meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in top] for top in o.output_top_logprobs]
        start = len(o.prompt_token_ids) - len(o.input_logprobs)
        meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(o.input_logprobs, o.prompt_token_ids[start:])]
        meta["input_top_logprobs"] = [[[lp, t, None] for t, lp in top] for top in o.input_top_logprobs]
    if o.output_token_sampling_mask:  # SGLang's names
        meta["output_token_sampling_mask"] = o.output_token_sampling_mask
        meta["output_token_sampling_logprobs"] = o.output_token_sampling_logprobs
    return {"text": o.text, "output_ids": o.output_token_ids, "meta_info": meta}


def result_json(result: WeightResult) -> JSONResponse:
    body = {k: v for k, v in dataclasses.asdict(result).items() if k != "value"}
    return JSONResponse(body, status_code=200 if result.success else 400)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


# ---------------------------------------------------------------------------------------------
# the app


def create_app(engine: RolloutEngine, config: Optional[ServerConfig] = None) -> FastAPI:
    config = config or ServerConfig()
    app = FastAPI(title="rollout-worker", version="0.1.0")
    metrics = ServerMetrics(engine)
    model_name = config.served_model_name or os.path.basename(os.path.normpath(engine.config.model_path))
    allowed_dirs = [os.path.realpath(d) for d in config.allowed_weight_dirs]

    # ------------------------------------------------------------------ guards

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            return JSONResponse({"detail": f"request body of {length} bytes exceeds the limit of "
                                           f"{config.max_body_bytes} bytes"}, status_code=413)
        return await call_next(request)

    def _key(request: Request) -> Optional[str]:
        auth = request.headers.get("authorization", "")
        return auth[7:].strip() if auth.lower().startswith("bearer ") else None

    def _is(key: Optional[str], expected: Optional[str]) -> bool:
        return key is not None and expected is not None and secrets.compare_digest(key, expected)

    def user(request: Request) -> None:
        """Generation and reads: open unless --api-key is set (either key then passes)."""
        if config.api_key is None:
            return
        key = _key(request)
        if not (_is(key, config.api_key) or _is(key, config.admin_api_key)):
            raise HTTPException(401, "missing or wrong API key: send Authorization: Bearer <key>")

    def admin(request: Request) -> None:
        key = _key(request)
        if config.admin_api_key is not None:
            if _is(key, config.admin_api_key):
                return
            if _is(key, config.api_key):
                raise HTTPException(403, "this route needs the admin API key; the generation key is not enough")
            raise HTTPException(401, "missing or wrong admin API key: send Authorization: Bearer <admin key>")
        if config.api_key is not None and not _is(key, config.api_key):
            raise HTTPException(401, "missing or wrong API key: send Authorization: Bearer <key>")

    async def blocking(fn, *args, **kwargs):
        """An engine call that may wait (a quiet point, a transfer): off the event loop."""
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None

    # ------------------------------------------------------------------ generation core

    async def run_generate(request: Request, kwargs: dict) -> list[RolloutOutput]:
        """All samples of a request, aborted if the client leaves or the timeout passes."""
        t0 = time.perf_counter()
        try:
            task = asyncio.ensure_future(engine.async_generate(**kwargs))
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        deadline = time.monotonic() + config.request_timeout_s
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
                    raise HTTPException(504, f"the request did not finish within {config.request_timeout_s}s "
                                             "(aborted); the engine may be waiting for a weight update")
            outs = task.result()
        except ValueError as exc:
            metrics.failed(request.url.path)
            raise HTTPException(400, str(exc)) from None
        except RuntimeError as exc:
            metrics.failed(request.url.path)
            raise HTTPException(503, str(exc)) from None
        metrics.finished(request.url.path, outs, time.perf_counter() - t0)
        return outs

    async def stream_generate(request: Request, kwargs: dict, shape) -> StreamingResponse:
        """Server-sent events: ``shape(snapshot)`` per update, then ``[DONE]``; a client that
        leaves closes the iterator, which aborts its requests."""
        try:
            events = await engine.async_generate(stream=True, **kwargs)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        t0 = time.perf_counter()

        async def body() -> AsyncIterator[str]:
            last: dict = {}
            deadline = time.monotonic() + config.request_timeout_s
            try:
                while True:
                    try:  # a timed-out wait cancels the engine's iterator, which aborts the requests
                        snap = await asyncio.wait_for(events.__anext__(), max(0.0, deadline - time.monotonic()))
                    except StopAsyncIteration:
                        break
                    last[(snap.prompt_index, snap.sample_index)] = snap
                    for piece in shape(snap):
                        yield _sse(piece)
            except (TimeoutError, asyncio.TimeoutError):
                yield _sse({"error": f"the request did not finish within {config.request_timeout_s}s (aborted)"})
            except (ValueError, RuntimeError) as exc:
                yield _sse({"error": str(exc)})
            finally:
                await events.aclose()
            metrics.finished(request.url.path, list(last.values()), time.perf_counter() - t0)
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    # ------------------------------------------------------------------ SGLang generation

    @app.post("/generate", dependencies=[Depends(user)])
    async def generate(body: P.GenerateRequest, request: Request):
        metrics.started(request.url.path)
        if (body.text is None) == (body.input_ids is None):
            raise HTTPException(400, "pass exactly one of text or input_ids")
        kwargs = dict(prompts=body.text, input_ids=body.input_ids, sampling_params=body.sampling_params or {},
                      return_logprob=body.return_logprob, top_logprobs_num=body.top_logprobs_num,
                      logprob_start_len=body.logprob_start_len, rid=body.rid,
                      return_sampling_mask=body.return_sampling_mask)
        if body.stream:
            return await stream_generate(request, kwargs, lambda o: [sglang_item(o, body.return_logprob)])
        outs = await run_generate(request, kwargs)
        items = [sglang_item(o, body.return_logprob) for o in outs]
        single = isinstance(body.text, str) or (body.input_ids is not None and body.input_ids
                                                and isinstance(body.input_ids[0], int))
        return items[0] if single and len(items) == 1 else items

    # ------------------------------------------------------------------ OpenAI

    from rollout.server import openai_routes

    openai_routes.add_routes(app, engine, model_name, user, run_generate, stream_generate, metrics)

    # ------------------------------------------------------------------ weights

    def _allowed(path: str) -> None:
        if not allowed_dirs:
            return
        real = os.path.realpath(path)
        if not any(os.path.commonpath([real, d]) == d for d in allowed_dirs):
            raise HTTPException(403, f"{path!r} is outside --allowed-weight-dirs")

    async def timed_update(fn, *args, **kwargs) -> JSONResponse:
        result = await blocking(fn, *args, **kwargs)
        metrics.weight_update(result)
        return result_json(result)

    @app.post("/update_weights_from_disk", dependencies=[Depends(admin)])
    async def update_weights_from_disk(body: P.UpdateFromDiskRequest):
        _allowed(body.model_path)
        return await timed_update(engine.update_weights_from_disk, body.model_path, load_format=body.load_format,
                                  flush_cache=body.flush_cache, weight_version=body.weight_version,
                                  recapture_cuda_graph=body.recapture_cuda_graph,
                                  abort_all_requests=body.abort_all_requests)

    @app.post("/update_weights_from_tensor", dependencies=[Depends(admin)])
    async def update_weights_from_tensor(body: P.UpdateFromTensorRequest, request: Request):
        if request.client is None or request.client.host not in ("127.0.0.1", "::1", "localhost"):
            raise HTTPException(403, "tensor handles name memory on this host: only same-host clients may send them")
        handle = body.serialized_named_tensors
        if isinstance(handle, list):
            if not handle:
                raise HTTPException(400, "serialized_named_tensors is empty")
            handle = handle[0]  # every rank of this engine opens the one bucket
        return await timed_update(engine.update_weights_from_tensor, handle, load_format=None,
                                  flush_cache=body.flush_cache, weight_version=body.weight_version,
                                  abort_all_requests=body.abort_all_requests, partial=body.partial,
                                  transaction=body.transaction)

    @app.post("/init_weights_update_group", dependencies=[Depends(admin)])
    async def init_weights_update_group(body: P.InitGroupRequest):
        return result_json(await blocking(engine.init_weights_update_group, body.master_address, body.master_port,
                                          body.rank_offset, body.world_size, body.group_name, body.backend,
                                          body.timeout_s))

    @app.post("/update_weights_from_distributed", dependencies=[Depends(admin)])
    async def update_weights_from_distributed(body: P.UpdateFromDistributedRequest):
        return await timed_update(engine.update_weights_from_distributed, body.names, body.dtypes, body.shapes,
                                  body.group_name, flush_cache=body.flush_cache, weight_version=body.weight_version,
                                  load_format=body.load_format, bucket_bytes=body.bucket_bytes,
                                  abort_all_requests=body.abort_all_requests, partial=body.partial,
                                  transaction=body.transaction)

    @app.post("/destroy_weights_update_group", dependencies=[Depends(admin)])
    async def destroy_weights_update_group(body: P.GroupNameRequest):
        return result_json(await blocking(engine.destroy_weights_update_group, body.group_name))

    @app.post("/begin_weight_update", dependencies=[Depends(admin)])
    async def begin_weight_update(body: P.BeginUpdateRequest):
        return result_json(await blocking(engine.begin_weight_update, body.weight_version))

    @app.post("/commit_weight_update", dependencies=[Depends(admin)])
    async def commit_weight_update(body: P.CommitUpdateRequest):
        return await timed_update(engine.commit_weight_update, flush_cache=body.flush_cache, partial=body.partial,
                                  abort_all_requests=body.abort_all_requests)

    @app.post("/abort_weight_update", dependencies=[Depends(admin)])
    async def abort_weight_update():
        return result_json(await blocking(engine.abort_weight_update))

    @app.post("/get_weights_by_name", dependencies=[Depends(admin)])
    async def get_weights_by_name(body: P.GetWeightsRequest):
        return await blocking(engine.get_weights_by_name, body.name, body.truncate_size)

    @app.api_route("/get_weight_version", methods=["GET", "POST"], dependencies=[Depends(user)])
    async def get_weight_version():
        return {"weight_version": engine.get_weight_version()}

    @app.post("/update_weight_version", dependencies=[Depends(admin)])
    async def update_weight_version(body: P.VersionRequest):
        await blocking(engine.update_weight_version, body.new_version)
        return {"success": True, "message": "version updated", "weight_version": engine.get_weight_version()}

    # ------------------------------------------------------------------ control

    @app.api_route("/flush_cache", methods=["GET", "POST"], dependencies=[Depends(admin)])
    async def flush_cache():
        await blocking(engine.flush_cache)
        return {"success": True, "message": "prefix cache flushed"}

    @app.post("/pause_generation", dependencies=[Depends(admin)])
    async def pause_generation(body: P.PauseRequest):
        await blocking(engine.pause_generation, body.mode)
        return {"success": True, "message": f"generation paused ({body.mode})"}

    @app.post("/continue_generation", dependencies=[Depends(admin)])
    async def continue_generation():
        await blocking(engine.continue_generation)
        return {"success": True, "message": "generation continues"}

    @app.post("/abort_request", dependencies=[Depends(admin)])
    async def abort_request(body: P.AbortRequest):
        await blocking(engine.abort_request, body.rid, body.abort_all)
        return {"success": True, "message": "abort requested"}

    @app.post("/release_memory_occupation", dependencies=[Depends(admin)])
    async def release_memory_occupation(body: P.ReleaseRequest):
        return result_json(await blocking(engine.release_memory_occupation, body.tags, body.backup_weights))

    @app.post("/resume_memory_occupation", dependencies=[Depends(admin)])
    async def resume_memory_occupation(body: P.MemoryRequest):
        return result_json(await blocking(engine.resume_memory_occupation, body.tags))

    # ------------------------------------------------------------------ ops

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/health_generate", dependencies=[Depends(user)])
    async def health_generate(request: Request):
        kwargs = dict(input_ids=[[0]], sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                      return_logprob=False, rid=f"health-{uuid.uuid4().hex[:8]}")
        outs = await run_generate(request, kwargs)
        return {"status": "ok", "output_ids": outs[0].output_token_ids}

    @app.get("/get_model_info", dependencies=[Depends(user)])
    async def get_model_info():
        mc = engine.model_config
        return {"model_path": engine.config.model_path, "tokenizer_path": engine.config.tokenizer_path
                or engine.config.model_path, "served_model_name": model_name, "architecture": mc.architecture,
                "is_generation": True, "vocab_size": mc.vocab_size, "dtype": str(engine.dtype).replace("torch.", ""),
                "tp_size": engine.tp_size, "weight_version": engine.get_weight_version()}

    @app.get("/get_server_info", dependencies=[Depends(user)])
    async def get_server_info():
        stats = await blocking(engine.get_stats)
        engine_config = {k: v for k, v in dataclasses.asdict(engine.config).items()}
        return {"engine_config": engine_config, "served_model_name": model_name, "stats": stats,
                "weight_version": engine.get_weight_version(), "dtype": str(engine.dtype).replace("torch.", ""),
                "tp_size": engine.tp_size, "max_body_bytes": config.max_body_bytes,
                "request_timeout_s": config.request_timeout_s, "auth": config.api_key is not None,
                "admin_auth": config.admin_api_key is not None, "allowed_weight_dirs": allowed_dirs,
                "cpu": engine.cpu_kernels()}

    @app.get("/metrics", dependencies=[Depends(user)])
    async def prometheus_metrics():
        body, content_type = await asyncio.to_thread(metrics.render)
        return Response(body, media_type=content_type)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)

    @app.get("/", response_class=PlainTextResponse)
    async def root():
        return "rollout-worker server: see /docs for the routes\n"

    return app
