"""TRL's ``trl vllm-serve`` routes (every path ends with ``/``), as ``trl/generation/vllm_client.py``
calls them: health and world size, ``/generate/`` and ``/chat/`` (prompt ids, completion ids and
per-token logprobs with their token ids), and the weight path — ``/init_communicator/``, one
``/update_named_param/`` per parameter, ``/reset_prefix_cache/``, ``/close_communicator/``.

TRL's weight protocol differs from SGLang's and vLLM's: the server's ranks come first and the client
is the **last** rank of the group; the server hosts the rendezvous (rank 0 is the engine's first
rank); ``/init_communicator/`` and ``/update_named_param/`` answer at once and the work follows in the
background (the client joins the group, or broadcasts the parameter, after the answer), and after
each parameter's broadcast both sides meet at a barrier. Here those background calls run one after
another in the order they came; the parameters are staged, not applied one by one, and published
together at ``/reset_prefix_cache/`` (TRL's last call of a sync), which answers 400 naming what failed
if anything did — a half-updated model never serves.

The client's group: TRL's own client builds it with vLLM's ``StatelessProcessGroup`` and PyNccl (it
needs vLLM and two GPUs); over gloo a torch-only client that builds it with plain
``torch.distributed.init_process_group(init_method="tcp://server:port", rank=world_size - 1)`` and
calls ``dist.broadcast(t, src=world_size - 1)`` then ``dist.barrier()`` per parameter speaks the same
protocol (``tests/test_compat_vllm_clients.py``). The client sends ``host: "0.0.0.0"``; the rendezvous
then listens on the address the client reached the server at, never on every interface.
"""

from __future__ import annotations

import array
import asyncio
import base64
import contextlib
import math
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Optional

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import Field

from rollout.engine.lifecycle import Opener
from rollout.outputs import WeightResult
from rollout.server import protocol as P
from rollout.server.auth import admin, user
from rollout.server.encoding import JSONResponse
from rollout.server.service import EngineService, service_of
from rollout.server.vllm_routes import VllmSampling, rollout_outputs_by_prompt
from weight_sync.process_group import concrete_host, is_wildcard

router = APIRouter()
ADMIN = [Depends(admin)]
USER = [Depends(user)]
Svc = Depends(service_of)
TRL_GROUP = "trl-communicator"


class TrlChannel:
    """TRL's fire-and-forget weight calls, run one after another in arrival order; what failed is
    kept until the publish (``/reset_prefix_cache/``) reports it."""

    def __init__(self):
        self.tail: Optional[asyncio.Future] = None
        self.errors: list[str] = []

    def then(self, work: Callable[[], Awaitable[None]]) -> None:
        prev = self.tail

        async def run() -> None:
            if prev is not None:
                with contextlib.suppress(Exception):
                    await prev
            try:
                await work()
            except HTTPException as exc:
                self.errors.append(str(exc.detail))
            except Exception as exc:  # noqa: BLE001 - reported at the publish
                self.errors.append(repr(exc))

        self.tail = asyncio.ensure_future(run())

    async def drained(self) -> None:
        if self.tail is not None:
            with contextlib.suppress(Exception):
                await self.tail


def channel(request: Request) -> TrlChannel:
    state = request.app.state
    if getattr(state, "trl", None) is None:
        state.trl = TrlChannel()
    return state.trl


def _failed(result: WeightResult, errors: list[str], what: str) -> None:
    if not result.success:
        errors.append(f"{what}: {result.message}")


# ------------------------------------------------------------------ health, generation


@router.get("/health/")
async def health(svc: EngineService = Svc):
    if not svc.engine.health():
        raise HTTPException(503, "the engine loop is not running")
    return {"status": "ok"}


@router.get("/get_world_size/", dependencies=USER)
async def get_world_size(svc: EngineService = Svc):
    return {"world_size": svc.engine.tp_size}


class TrlSampling(P.Lenient):
    n: int = Field(1, ge=1, le=P.MAX_N)
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = Field(16, ge=0)
    logprobs: Optional[int] = Field(0, ge=0, le=20)
    truncate_prompt_tokens: Optional[int] = None
    structured_outputs_regex: Optional[str] = None
    guided_decoding_regex: Optional[str] = None
    generation_kwargs: dict[str, Any] = Field(default_factory=dict)

    def vllm(self) -> VllmSampling:
        if self.structured_outputs_regex or self.guided_decoding_regex:
            raise HTTPException(400, "structured outputs (a regex) are not supported by this server")
        fields = {"n": self.n, "repetition_penalty": self.repetition_penalty, "temperature": self.temperature,
                  "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p, "max_tokens": self.max_tokens,
                  "logprobs": self.logprobs, "truncate_prompt_tokens": self.truncate_prompt_tokens,
                  **self.generation_kwargs}
        unknown = sorted(set(self.generation_kwargs) - set(VllmSampling.model_fields))
        if unknown:
            raise HTTPException(400, f"generation_kwargs {unknown} are not sampling parameters this server knows")
        try:
            return VllmSampling(**fields)
        except ValueError as exc:
            raise HTTPException(400, f"invalid sampling parameters: {exc}") from None


class TrlGenerateRequest(TrlSampling):
    prompts: list[str] | list[list[int]] = Field(min_length=1)
    images: Optional[list[Any]] = None


class TrlChatRequest(TrlSampling):
    messages: list[list[P.ChatMessage]] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    tools: Optional[list[Any]] = None


async def _generate(svc: EngineService, request: Request, ids: list[list[int]], body: TrlSampling) -> dict:
    """TRL's answer: ``prompt_ids`` per prompt, ``completion_ids`` per completion (prompt-major, n each),
    and per completion token its logprobs by rank — the top ``logprobs`` and the sampled token if it
    is not among them (``logprobs: 0``: the sampled token alone) — with ``logprob_token_ids``."""
    sp = body.vllm()
    k = sp.logprobs
    kwargs = dict(input_ids=ids, sampling_params=[sp.ours(len(p), svc.context_len) for p in ids],
                  return_logprob=k is not None, top_logprobs_num=k or 0)
    outs = await svc.generate(request, kwargs)
    by_prompt = rollout_outputs_by_prompt(outs)
    completions = [o for i in sorted(by_prompt) for o in by_prompt[i]]
    logprobs, token_ids = [], []
    for o in completions:
        per_lp, per_id = [], []
        tops = o.output_top_logprobs or [[] for _ in o.output_token_ids]
        for t, lp, top in zip(o.output_token_ids, o.output_logprobs, tops):
            ranked = list(top[:k or 0])
            if all(i != t for i, _ in ranked):
                ranked.append((t, lp))
            per_lp.append([v if v == v and abs(v) != float("inf") else None for _, v in ranked])
            per_id.append([i for i, _ in ranked])
        logprobs.append(per_lp)
        token_ids.append(per_id)
    return {"prompt_ids": [by_prompt[i][0].prompt_token_ids for i in sorted(by_prompt)],
            "completion_ids": [o.output_token_ids for o in completions],
            "logprobs": logprobs if k is not None else None, "logprob_token_ids": token_ids if k is not None else None}


@router.post("/generate/", dependencies=USER)
async def generate(body: TrlGenerateRequest, request: Request, svc: EngineService = Svc):
    svc.metrics.started(request.url.path)
    if body.images and any(img is not None for img in body.images):
        raise HTTPException(400, "images are not supported by this server (a text-only model)")
    if isinstance(body.prompts[0], str):
        tokenizer = svc.engine.tokenizer
        if tokenizer is None:
            raise HTTPException(400, "this server has no tokenizer: send prompts as token ids")
        ids = [tokenizer.encode(p) for p in body.prompts]
    else:
        ids = [list(p) for p in body.prompts]
    return await _generate(svc, request, ids, body)


@router.post("/chat/", dependencies=USER)
async def chat(body: TrlChatRequest, request: Request, svc: EngineService = Svc):
    svc.metrics.started(request.url.path)
    if body.tools:
        raise HTTPException(400, "tools in chat templates are not supported by this server")
    ids = []
    for conversation in body.messages:
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str) else "".join(
            p.text or "" for p in (m.content or []) if p.type == "text")} for m in conversation]
        ids.append(await svc.render(svc.render_chat, messages, True, None, body.chat_template_kwargs))
    return await _generate(svc, request, ids, body)


class SequenceLogprobsRequest(P.Lenient):
    sequences: list[list[int]] = Field(min_length=1)
    prompt_lengths: list[int]
    top_logprobs: int = Field(100, ge=1, le=1000)
    temperature: float = Field(1.0, gt=0)
    response_format: Literal["binary", "json"] = "binary"


@router.post("/get_sequence_logprobs/", dependencies=USER)
async def get_sequence_logprobs(body: SequenceLogprobsRequest, request: Request, svc: EngineService = Svc):
    """TRL's teacher scoring (distillation): for each sequence, from ``prompt_lengths[i]`` on, the top
    ``top_logprobs`` logprobs at ``temperature`` (sorted, padded with -inf and token id 0) and the
    actual token's; ``binary`` packs them as base64 arrays of shape (sequences, longest completion, k)."""
    svc.metrics.started(request.url.path)
    if len(body.prompt_lengths) != len(body.sequences):
        raise HTTPException(400, f"{len(body.prompt_lengths)} prompt_lengths for {len(body.sequences)} sequences")
    if any(not 1 <= n < len(s) for n, s in zip(body.prompt_lengths, body.sequences)):
        raise HTTPException(400, "each prompt length must be at least 1 and shorter than its sequence")
    k = body.top_logprobs

    async def score(seq: list[int], start: int):
        kwargs = dict(input_ids=[seq], sampling_params={"max_new_tokens": 0, "temperature": body.temperature},
                      return_logprob=True, top_logprobs_num=k, logprob_start_len=start)
        return (await svc.generate(request, kwargs))[0]

    outs = await asyncio.gather(*(score(s, n) for s, n in zip(body.sequences, body.prompt_lengths)))
    # a thousand positions by a thousand top logprobs take seconds to shape: never on the event loop
    return await svc.offload(_sequence_logprobs_answer, body, outs)


def _sequence_logprobs_answer(body: SequenceLogprobsRequest, outs) -> JSONResponse:
    """The answer, serialized here (off the event loop) too."""
    return JSONResponse(_sequence_logprobs(body, outs))


def _sequence_logprobs(body: SequenceLogprobsRequest, outs) -> dict:
    k = body.top_logprobs
    lps, ids, actual, actual_ids = [], [], [], []
    for o, seq, start in zip(outs, body.sequences, body.prompt_lengths):
        tops = o.input_top_logprobs[-(len(seq) - start):]
        lps.append([[v for _, v in top] + [-math.inf] * (k - len(top)) for top in tops])
        ids.append([[t for t, _ in top] + [0] * (k - len(top)) for top in tops])
        actual.append([[v if v is not None else -math.inf] for v in o.input_logprobs[-(len(seq) - start):]])
        actual_ids.append([[t] for t in seq[start:]])
    if body.response_format == "json":
        return {"logprobs": _finite(lps), "logprob_token_ids": ids, "actual_logprobs": _finite(actual),
                "actual_token_ids": actual_ids}
    lengths = [len(x) for x in lps]
    longest = max(lengths)

    def packed(rows, width, fill, code: str) -> str:
        """(sequences, longest, width) little-endian float32 ("f") or int32 ("i"), row-major, padded."""
        flat = array.array(code)
        for r in rows:
            for pos in r:
                flat.extend(pos)
            flat.extend([fill] * (width * (longest - len(r))))
        if sys.byteorder != "little":
            flat.byteswap()
        return base64.b64encode(flat.tobytes()).decode("ascii")

    return {"shape": [len(lps), longest, k], "completion_lengths": lengths,
            "logprobs_b64": packed(lps, k, -math.inf, "f"), "token_ids_b64": packed(ids, k, 0, "i"),
            "actual_logprobs_b64": packed(actual, 1, -math.inf, "f"),
            "actual_token_ids_b64": packed(actual_ids, 1, 0, "i")}


def _finite(rows):
    """JSON has no -inf: a position past the top list (or ruled out) is null."""
    return [[[v if math.isfinite(v) else None for v in pos] for pos in seq] for seq in rows]


# ------------------------------------------------------------------ the weight path


class InitCommunicatorRequest(P.Lenient):
    host: str
    port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2)
    client_device_uuid: Optional[str] = None


class NamedParamRequest(P.Lenient):
    name: str
    dtype: str
    shape: list[int]


@router.post("/init_communicator/", dependencies=ADMIN)
async def init_communicator(body: InitCommunicatorRequest, request: Request, svc: EngineService = Svc):
    """Answers at once; the engine's ranks (0 .. tp-1) then host and join the group while the client
    joins as the last rank."""
    tp = svc.engine.tp_size
    if body.world_size != tp + 1:
        raise HTTPException(400, f"world_size={body.world_size}: this server has {tp} rank(s), so the group is "
                                 f"{tp + 1} (the client is the last rank)")
    host = body.host
    if is_wildcard(host):  # however it is spelled: the address the client reached us at, never every interface
        host = (request.scope.get("server") or (svc.config.host,))[0] or svc.config.host
        if is_wildcard(host):
            raise HTTPException(400, "the server listens on every interface and the client named none: start the "
                                     "server with --host set to one address")
    try:
        host = concrete_host(host)
    except ValueError as exc:
        raise HTTPException(400, f"host: {exc}") from None
    ch = channel(request)
    ch.errors.clear()

    async def join() -> None:
        await svc.call(svc.engine.destroy_weights_update_group, TRL_GROUP)  # a stale group from an earlier run
        result = await svc.call(svc.engine.init_weights_update_group, host, body.port, 0, body.world_size,
                                TRL_GROUP, None, 60.0, body.world_size - 1)
        _failed(result, ch.errors, "init_communicator")

    ch.then(join)
    return {"message": "Request received, initializing communicator"}


@router.post("/update_named_param/", dependencies=ADMIN)
async def update_named_param(body: NamedParamRequest, request: Request, svc: EngineService = Svc):
    """Answers at once; the parameter's broadcast is then received (staged) and both sides meet at a
    barrier. Published with the others at ``/reset_prefix_cache/``."""
    ch = channel(request)
    dtype = body.dtype.removeprefix("torch.")

    async def receive() -> None:
        if not await svc.stages_for(Opener.TRL):  # the sync's first parameter: open TRL's transaction
            _failed(await svc.call(svc.engine.begin_weight_update, None, Opener.TRL), ch.errors, "opening the update")
        try:
            result = await svc.call(svc.engine.update_weights_from_distributed, [body.name], [dtype], [body.shape],
                                    TRL_GROUP, partial=True, transaction=True)
            _failed(result, ch.errors, body.name)
        finally:  # the client waits at the barrier whatever happened here
            _failed(await svc.call(svc.engine.weights_update_group_barrier, TRL_GROUP), ch.errors,
                    f"barrier after {body.name}")

    ch.then(receive)
    return {"message": "Request received, updating named parameter"}


@router.post("/reset_prefix_cache/", dependencies=ADMIN)
async def reset_prefix_cache(request: Request, svc: EngineService = Svc):
    """TRL's last call of a sync: waits for the parameters still arriving, publishes them together
    (400 naming what failed, and nothing published, if anything did), then drops the prefix cache."""
    ch = channel(request)
    await ch.drained()
    errors, ch.errors = ch.errors, []
    if svc.engine.open_weight_update() is Opener.TRL:
        if errors:
            await svc.call(svc.engine.abort_weight_update, Opener.TRL)
        else:
            result = await svc.apply_update(svc.engine.commit_weight_update, partial=True, by=Opener.TRL)
            _failed(result, errors, "publishing the update")
    if errors:
        return JSONResponse({"message": "Request received, resetting prefix cache status: False", "errors": errors,
                             "detail": "the weight update failed; the old weights keep serving: " + "; ".join(errors)},
                            status_code=400)
    await svc.call(svc.engine.flush_cache)
    return {"message": "Request received, resetting prefix cache status: True"}


@router.post("/close_communicator/", dependencies=ADMIN)
async def close_communicator(request: Request, svc: EngineService = Svc):
    ch = channel(request)
    await ch.drained()
    await svc.call(svc.engine.abort_weight_update, Opener.TRL)  # TRL's own transaction only, if one is open
    await svc.call(svc.engine.destroy_weights_update_group, TRL_GROUP)
    return {"message": "Request received, closing communicator"}
