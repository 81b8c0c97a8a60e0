"""``EngineService``: the server's one object over its engine. Routes are thin functions over it
(``request.app.state.service``); nothing else holds server state.

Generation goes through ``RolloutEngine.async_generate``, so concurrent requests meet in the
scheduler's batch; a client that disconnects aborts its request and frees its KV; a request that
outlives ``request_timeout_s`` (say, queued behind a weight update waiting for a quiet point) is
aborted and answered 504. Weight and control calls run on threads of their own (the event loop keeps
serving; reads cannot starve them) and answer the engine's ``WeightResult``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

from fastapi import HTTPException, Request
from fastapi.responses import StreamingResponse

from rollout.engine.lifecycle import Opener
from rollout.engine.templates import RenderLimits, render, template_variables
from rollout.outputs import RolloutOutput, WeightResult
from rollout.server.chat_sessions import ChatSessions
from rollout.server.encoding import JSONResponse, sse
from rollout.server.http import TRANSPORT
from rollout.server.metrics import ServerMetrics
from rollout.weights.loader import WeightLoadError
from rollout.weights.safetensors_io import FolderNotAllowed, PinnedFolder

logger = logging.getLogger(__name__)
CONTROL_THREADS = 8  # weight and control calls at once (each may wait for a quiet point)
READ_THREADS = 4  # stats and metrics reads at once
RENDER_THREADS = 2  # chat renderings (each bounded in time: rollout.engine.templates) and shapings at once
MIN_PENDING_BYTES = 4096  # the smallest --stream-max-pending-mb (a piece and its framing must fit)


@dataclass
class ServerConfig:
    api_key: Optional[str] = None
    admin_api_key: Optional[str] = None
    allowed_weight_dirs: list[str] = field(default_factory=list)
    max_body_bytes: int = 32 << 20
    request_timeout_s: Optional[float] = None  # None: no server-wide timeout (SGLang has none)
    served_model_name: Optional[str] = None
    # a stream reader that takes nothing for this long is dropped (its request aborted, its KV freed)
    stream_stall_timeout_s: float = 30.0
    # reported in /get_server_info (slime compares it with its launch arguments); memory release and
    # resume work either way here
    enable_memory_saver: bool = False
    # bytes of a stream's events waiting in the server for a reader that falls behind
    stream_max_pending_bytes: int = 8 << 20
    # /generate streams: each event carries only what is new since the sample's last one (SGLang's
    # --incremental-streaming-output); off: every event the whole output so far (SGLang's default)
    incremental_streaming_output: bool = False
    # the address the server listens on: a weight group the server hosts (TRL's) binds here when the
    # client names every interface ("0.0.0.0")
    host: str = "127.0.0.1"
    # /v1/chat/completions: tool calls ("auto": the chat template's format; "none"; "hermes"; "llama3_json")
    # and <think> reasoning ("auto": when the template has it; "none"; "think") parsed out of replies
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    # chat template text sent in a request (``chat_template``, in ``chat_template_kwargs`` or beside them) is
    # rendered only with this on (vLLM's --trust-request-chat-template); otherwise refused with a 400
    trust_request_chat_template: bool = False
    # the RL frameworks' pickled tensor handles on /update_weights_from_tensor (veRL's, slime's, miles' colocated
    # pushes), read by an allowlist that runs nothing (weight_sync.handles); off: refused with what to send
    tensor_handles: bool = True
    # one chat rendering's bounds (rollout.engine.templates.RenderLimits)
    render_timeout_s: float = 5.0
    render_max_chars: int = 8 << 20
    # the most ids /generate's top_logprobs_num may ask for at each position (a response's size grows with it);
    # -1: the whole vocabulary (a trainer's full-distribution check: trainer_bridge.grpo's probe)
    max_top_logprobs_num: int = 20


def result_json(result: WeightResult, **extra) -> JSONResponse:
    """A weight operation's result as the route answers it (plus ``extra`` fields): 200 on success,
    400 otherwise."""
    body = {k: v for k, v in dataclasses.asdict(result).items() if k != "value"}
    return JSONResponse({**body, **extra}, status_code=200 if result.success else 400)


def local_bucket_handle(request: Request, payload, field: str) -> dict:
    """A same-host bucket handle from a request body (one per TP rank in SGLang's form: every rank of
    this engine opens the one); 403 for a client on another host (a handle names memory here)."""
    if request.client is None or request.client.host not in ("127.0.0.1", "::1", "localhost"):
        raise HTTPException(403, "tensor handles name memory on this host: only same-host clients may send them")
    if isinstance(payload, list):
        if not payload:
            raise HTTPException(400, f"{field} is empty")
        payload = payload[0]
    return payload


def service_of(request: Request) -> EngineService:
    """The app's service (a FastAPI dependency)."""
    return request.app.state.service


class TextDeltas:
    """One streamed request's text sent so far, per sample (what an incremental stream sends next)."""

    def __init__(self):
        self.sent: dict[tuple[int, int], tuple[str, int]] = {}

    def __call__(self, o: RolloutOutput) -> tuple[str, int]:
        """(new text, index of the first new token) since this sample's last event. A trailing
        replacement character may still become a multi-byte character: it is held back until the
        next token (or the end), so sent text is never taken back."""
        text, ntok = self.sent.get((o.prompt_index, o.sample_index), ("", 0))
        now = o.text or ""
        stable = now if o.finish_reason is not None else now.rstrip("\ufffd")
        if not stable.startswith(text):
            stable = text  # cannot happen with the hold-back; never resend
        self.sent[(o.prompt_index, o.sample_index)] = (stable, len(o.output_token_ids))
        return stable[len(text):], ntok


class _ReaderGone(Exception):
    """The reader took nothing for the stall timeout."""


class _ReaderBoundStream(StreamingResponse):
    """Server-sent events for a reader that may stop reading.

    - The engine side keeps only the newest snapshot per sample while this waits
      (``RolloutEngine.async_generate``): a slow reader skips snapshots, it does not queue them.
    - The bytes waiting in the server for the reader — the connection's write buffer, read from the
      transport — stay within ``max_pending_bytes``: an event is handed to the socket in pieces, each
      only once the reader has taken enough of what waits (an event larger than the cap goes piece by
      piece, never whole).
    - A reader that takes nothing for ``stall_timeout_s`` is dropped: the events' iterator is closed,
      which aborts its requests and frees their KV, and the connection closes without the final event.

    Under a server whose protocol does not lend the transport (``rollout.server.http``), each event
    goes whole and only the stall timeout applies."""

    POLL_S = 0.02
    FRAMING = 32  # what HTTP/1.1 chunked encoding adds around each piece (size line and CRLFs)

    def __init__(self, content, config: ServerConfig, metrics: ServerMetrics, **kw):
        super().__init__(content, **kw)
        self.stall_timeout_s = config.stream_stall_timeout_s
        self.cap = max(MIN_PENDING_BYTES, config.stream_max_pending_bytes)
        self.metrics = metrics
        self._transport: Optional[asyncio.WriteTransport] = None
        self._pending = 0

    async def __call__(self, scope, receive, send) -> None:
        self._transport = scope.get("state", {}).get(TRANSPORT)
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._account(0)

    def _buffered(self) -> int:
        t = self._transport
        return 0 if t is None or t.is_closing() else t.get_write_buffer_size()

    def _account(self, pending: int) -> None:
        self.metrics.stream_pending(pending - self._pending, pending)
        self._pending = pending

    async def _write(self, send, body: bytes) -> None:
        """Hand ``body`` to the socket within the cap; ``_ReaderGone`` once the reader has taken
        nothing (the waiting bytes did not shrink, no piece was accepted) for the stall timeout."""
        loop = asyncio.get_running_loop()
        progress = loop.time()
        last = self._buffered()
        at = 0
        while at < len(body):
            buffered = self._buffered()
            if buffered < last:
                progress = loop.time()
            last = buffered
            room = self.cap - buffered - self.FRAMING
            if self._transport is None:
                room = len(body)
            elif room < min(len(body) - at, max(1, self.cap // 4)) or room < 1:  # wait for the reader
                self._account(buffered)
                if loop.time() - progress > self.stall_timeout_s:
                    raise _ReaderGone
                await asyncio.sleep(self.POLL_S)
                continue
            piece = body[at:at + room]
            left = self.stall_timeout_s - (loop.time() - progress)
            try:  # uvicorn's own flow control may hold the send until the buffer drains
                await asyncio.wait_for(send({"type": "http.response.body", "body": piece, "more_body": True}),
                                       max(left, 0.0))
            except (TimeoutError, asyncio.TimeoutError):
                raise _ReaderGone from None
            at += len(piece)
            progress = loop.time()
            last = self._buffered()
            self._account(last)

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                body = chunk if isinstance(chunk, bytes) else chunk.encode(self.charset)
                await self._write(send, body)
        except _ReaderGone:
            self.metrics.stream_dropped()
            logger.warning("dropped a stream reader that took nothing for %.0f s; its request is aborted",
                           self.stall_timeout_s)
            return
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]  # our async generator
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class EngineService:
    def __init__(self, engine, config: Optional[ServerConfig] = None):
        self.engine = engine
        self.config = config or ServerConfig()
        self.metrics = ServerMetrics(engine)
        self.model_name = self.config.served_model_name or os.path.basename(os.path.normpath(engine.config.model_path))
        self.allowed_dirs = [os.path.realpath(d) for d in self.config.allowed_weight_dirs]
        self._token_texts: dict[int, str] = {}  # bounded by the vocabulary
        self.sleeping: set[str] = set()  # what vLLM's /sleep released (and "paused"), until /wake_up
        # closed while vLLM's /pause?mode=wait lets the requests in flight finish: new ones wait here
        self.admission = asyncio.Event()
        self.admission.set()
        # the calls that make up a weight transaction (open, stage, publish, abort, continue) run in the
        # order they arrive (asyncio's lock wakes its waiters first come, first served)
        self._order = asyncio.Lock()
        # /v1/chat/completions turns named by a session id: ``self.chat_sessions``, made below
        self.weights_snapshot: Optional[str] = None  # /weights_checker's snapshot (a checksum)
        self.areal_meta = None  # AReaL's /areal_set_update_weight_meta, read by /areal_update_weights_xccl
        self.areal_lora_meta = None  # /areal_set_update_weight_meta_lora, read by /areal_update_weights_lora_xccl
        # Two pools instead of asyncio's one shared default (6 threads on 2 cores): the admin's calls
        # (an update waiting for a quiet point, /abort_request) and everyone's reads never queue
        # behind each other.
        self._control = ThreadPoolExecutor(CONTROL_THREADS, thread_name_prefix="rollout-control")
        self._reads = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="rollout-reads")
        self._renders = ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix="rollout-render")
        self.render_limits = RenderLimits(self.config.render_timeout_s, self.config.render_max_chars)
        self.chat_sessions = ChatSessions(engine, self.render_limits)

    # ------------------------------------------------------------------ generation

    async def generate(self, request: Request, kwargs: dict) -> list[RolloutOutput]:
        """All samples of a request, aborted if the client leaves or the timeout passes."""
        t0 = time.perf_counter()
        limit = self.config.request_timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        await self.admitted(request, deadline)
        try:
            task = asyncio.ensure_future(self.engine.async_generate(**kwargs))
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=1.0)
                if done:
                    break
                if await request.is_disconnected():
                    task.cancel()  # aborts the engine requests: their KV is freed
                    raise HTTPException(499, "client disconnected")
                if deadline is not None and time.monotonic() > deadline:
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
        limit = self.config.request_timeout_s
        await self.admitted(request, None if limit is None else time.monotonic() + limit)
        try:
            events = await self.engine.async_generate(stream=True, **kwargs)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        return _ReaderBoundStream(self._events(request.url.path, events, shape), self.config, self.metrics,
                                  media_type="text/event-stream")

    async def admitted(self, request: Request, deadline: Optional[float]) -> None:
        """Past the door vLLM's ``/pause?mode=wait`` closes while what is in flight finishes; 499 if the
        client leaves while it waits there, 504 past ``deadline`` (the request's timeout)."""
        while not self.admission.is_set():
            try:
                await asyncio.wait_for(self.admission.wait(), 0.5)
            except (TimeoutError, asyncio.TimeoutError):
                if await request.is_disconnected():
                    raise HTTPException(499, "client disconnected") from None
                if deadline is not None and time.monotonic() > deadline:
                    raise HTTPException(504, f"the request waited {self.config.request_timeout_s}s for a pause "
                                             "(mode=wait) to let it in; nothing ran") from None

    async def _events(self, route: str, events, shape) -> AsyncIterator[str]:
        t0 = time.perf_counter()
        last: dict = {}
        limit = self.config.request_timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        try:
            while True:
                try:  # a timed-out wait cancels the engine's iterator, which aborts the requests
                    snap = await asyncio.wait_for(events.__anext__(),
                                                  None if deadline is None else max(0.0, deadline - time.monotonic()))
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
        """A weight or control call that may wait (a quiet point, a transfer): off the event loop, on
        the control threads; its ``ValueError`` (bad input) answers 400."""
        try:
            return await self._run(self._control, fn, *args, **kwargs)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None

    async def read(self, fn, *args, **kwargs):
        """A read any key may ask for (stats, metrics): off the event loop, on threads of its own, so
        that reads piling up behind a waiting update never hold a thread a control call needs."""
        return await self._run(self._reads, fn, *args, **kwargs)

    async def render(self, fn, *args, **kwargs):
        """A chat rendering (``fn``: one that renders under ``render_limits``, such as ``render_chat``)
        off the event loop, on threads of its own; every failure a 400 naming what failed. A rendering
        that outlives its limit's check points is answered 400 at twice its limit (its thread ends at
        its next check)."""
        fut = asyncio.get_running_loop().run_in_executor(self._renders, functools.partial(fn, *args, **kwargs))
        try:
            return await asyncio.wait_for(fut, 2 * self.render_limits.max_seconds + 1.0)
        except (TimeoutError, asyncio.TimeoutError):
            raise HTTPException(400, "rendering the chat template took longer than its limit") from None
        except ValueError as exc:  # InputError (RenderError, template refusals, limits) included
            raise HTTPException(400, str(exc)) from None

    async def offload(self, fn, *args, **kwargs):
        """CPU work of a route (shaping a large answer) off the event loop, on the rendering threads."""
        return await self._run(self._renders, fn, *args, **kwargs)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: Optional[list] = None,
                    template_kwargs: Optional[dict] = None, chat_template: Optional[str] = None) -> list[int]:
        """A request's conversation as token ids: its ``chat_template_kwargs`` as template variables only,
        template text only with ``--trust-request-chat-template`` (``rollout.engine.templates``)."""
        tokenizer = self.engine.tokenizer
        variables, template = template_variables(tokenizer, template_kwargs, self.config.trust_request_chat_template,
                                                 chat_template)
        return render(tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools or None,
                      variables=variables, chat_template=template, limits=self.render_limits)

    @staticmethod
    async def _run(pool: ThreadPoolExecutor, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kwargs))

    async def apply_update(self, fn, *args, **kwargs) -> WeightResult:
        """A weight update (or a publish) off the event loop, counted in the metrics."""
        result = await self.call(fn, *args, **kwargs)
        self.metrics.weight_update(result)
        return result

    async def weight_update(self, fn, *args, **kwargs) -> JSONResponse:
        """``apply_update``, answered as its result (SGLang's shape)."""
        return result_json(await self.apply_update(fn, *args, **kwargs))

    def in_order(self) -> asyncio.Lock:
        """``async with svc.in_order():`` around a route's transaction call, entered before its first
        await: such calls run one at a time, in arrival order (a publish never overtakes the open it
        follows, an update call never runs before the transaction it belongs to is open)."""
        return self._order

    async def stages_for(self, family: Opener) -> bool:
        """Whether an update call of route family ``family`` stages into the open transaction: only into
        one its own family opened; one another family opened and left is aborted (the engine's
        ``WeightUpdateLifecycle.claim``, which also says when ``family``'s own expired)."""
        return await self.call(self.engine.claim_weight_update, family)

    async def resume(self) -> Optional[WeightResult]:
        """Continue generation; what was staged while paused is published first (its result, counted;
        None if nothing was staged). On a failed publish generation continues on the old weights. A
        transaction opened explicitly and still open is not published by a continue: generation goes
        on, and the answer is a failure naming it (never a success over work that was not applied)."""
        async with self._order:  # a continue is a transaction call: in arrival order
            result = await self.call(self.engine.continue_generation)
        if result is not None:
            self.metrics.weight_update(result)
            if not result.success:
                result = dataclasses.replace(result, message=f"the update staged while paused failed: {result.message}")
        lifecycle = self.engine.weight_update_lifecycle
        if lifecycle.opener() not in (None, Opener.PAUSED) and (result is None or result.success):
            return WeightResult.fail(f"nothing is published by a continue: {lifecycle.busy_message()}")
        return result

    async def update_from_disk(self, path: str, **kwargs) -> WeightResult:
        """Pin the folder (open it as a directory descriptor), check where the descriptor lies against
        ``--allowed-weight-dirs`` (403 outside), and update through it: the check and the read are of
        the same folder, however long the update waits for a quiet point and whatever ``path`` names
        meanwhile. 400 for a path no file can have. All of it on one control thread (opening a long
        or deep path takes seconds), which also closes the descriptor, so a client that leaves
        cannot close it under a running update."""
        if "\x00" in path:
            raise HTTPException(400, "model_path contains a NUL byte")

        return await self._pinned_update(path, self.engine.update_weights_from_disk, **kwargs)

    async def update_from_delta(self, path: str, **kwargs) -> WeightResult:
        """A delta patch folder, pinned and checked as ``update_from_disk`` pins and checks a checkpoint folder."""
        if "\x00" in path:
            raise HTTPException(400, "path contains a NUL byte")
        return await self._pinned_update(path, self.engine.update_weights_from_delta, **kwargs)

    async def _pinned_update(self, path: str, update, **kwargs) -> WeightResult:
        def pin_and_update() -> WeightResult:
            try:
                folder = PinnedFolder.open(path, self.allowed_dirs)
            except WeightLoadError as exc:
                return WeightResult.fail(str(exc))
            with folder:
                return update(folder, **kwargs)

        try:
            return await self.apply_update(pin_and_update)
        except FolderNotAllowed as exc:
            raise HTTPException(403, str(exc)) from None

    @property
    def context_len(self) -> int:
        return self.engine.context_len

    def token_text(self, token: int) -> Optional[str]:
        """One token's text as SGLang's ``return_text_in_logprobs`` gives it (the token decoded alone)."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.engine.tokenizer.decode([token])
        return text

    # ------------------------------------------------------------------ what the info routes say

    @property
    def dtype_name(self) -> str:
        return str(self.engine.dtype).replace("torch.", "")

    async def loads(self) -> dict:
        """SGLang's ``/v1/loads``: what slime polls after an abort until nothing runs or waits."""
        stats = await self.read(self.engine.get_stats)
        running, waiting = stats["num_running"], stats["num_waiting"]
        used = stats["num_blocks"] - stats["num_free_blocks"]
        return {"loads": [{"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
                           "num_total_reqs": running + waiting, "num_used_blocks": used,
                           "token_usage": used / max(1, stats["num_blocks"])}]}

    async def get_load(self) -> list[dict]:
        """SGLang's ``/get_load`` (one entry per data-parallel rank; one here): what sglang-router and
        SMG poll to balance load (they sum ``num_tokens``)."""
        stats = await self.read(self.engine.get_stats)
        running, waiting = stats["num_running"], stats["num_waiting"]
        block = self.engine.config.block_size
        used = stats["num_blocks"] - stats["num_free_blocks"]
        return [{"dp_rank": 0, "num_reqs": running + waiting, "num_running_reqs": running,
                 "num_waiting_reqs": waiting, "num_tokens": used * block, "num_used_tokens": used * block,
                 "max_total_num_tokens": stats["num_blocks"] * block}]

    def model_info(self) -> dict:
        engine, mc = self.engine, self.engine.model_config
        return {"model_path": engine.config.model_path, "tokenizer_path": engine.config.tokenizer_path
                or engine.config.model_path, "served_model_name": self.model_name, "architecture": mc.architecture,
                "is_generation": True, "vocab_size": mc.vocab_size, "dtype": self.dtype_name,
                "tp_size": engine.tp_size, "weight_version": engine.get_weight_version()}

    async def server_info(self) -> dict:
        engine, config = self.engine, self.config
        stats = await self.read(engine.get_stats)
        adapters = await self.read(engine.list_lora_adapters)
        tp = engine.tp_size
        return {"engine_config": dataclasses.asdict(engine.config), "served_model_name": self.model_name,
                "model_path": engine.config.model_path,
                # what slime's external-engine mode reads and compares with its own launch arguments
                "tensor_parallel_size": tp, "pp_size": 1, "pipeline_parallel_size": 1, "ep_size": 1,
                "moe_dp_size": 1, "dp_size": 1, "num_gpus": tp if engine.device.type == "cuda" else 0,
                "enable_memory_saver": config.enable_memory_saver,
                "enable_return_routed_experts": engine.config.outputs.return_routed_experts,
                # how meta_info.routed_experts' rows reshape (ours): [layers, top_k]; None for a dense model
                "routed_experts_shape": [engine.model_config.num_hidden_layers, engine.model_config.num_experts_per_tok]
                if engine.model_config.num_experts else None,
                "disaggregation_mode": "null", "disaggregation_bootstrap_port": None, "encoder_only": False,
                "stats": stats, "weight_version": engine.get_weight_version(),
                "dtype": self.dtype_name, "tp_size": engine.tp_size,
                "max_body_bytes": config.max_body_bytes, "request_timeout_s": config.request_timeout_s,
                "auth": config.api_key is not None, "admin_auth": config.admin_api_key is not None,
                "allowed_weight_dirs": self.allowed_dirs, "cpu": engine.cpu_kernels(),
                "lora_adapters": adapters}
