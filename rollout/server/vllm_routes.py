"""vLLM's native RL routes, as vLLM-side frameworks call them (prime-rl, SkyRL, TRL's async GRPO,
AReaL's vLLM backend): pause and resume with query strings, the weight-transfer engine
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights`` per tensor or packed,
``/finish_weight_update``: a thin adapter over the engine's ``WeightUpdateLifecycle``, opener
``Opener.VLLM``), tokens in and out (``/inference/v1/generate``, ``/tokenize``, ``/detokenize``), sleep and
wake-up, the prefix cache. SkyRL's ``/collective_rpc`` verbs are ``skyrl_routes``, prime-rl's own routes
``prime_rl_routes``, AReaL's ``areal_routes``.
``cache_salt`` partitions the prefix cache (prime-rl and SkyRL salt with the policy version).

Weights: vLLM's trainer is rank 0 of the transfer group (``init_info``: address, port, rank_offset,
world_size). On CUDA vLLM's own trainer side builds the group with vLLM's ``StatelessProcessGroup``
and PyNccl, which needs vLLM; here the group is a torch one — on gloo a trainer that builds it with
plain ``torch.distributed.init_process_group`` (or SGLang's recipe) joins (``weight_sync.process_group``).
Calls between ``/start_weight_update`` and ``/finish_weight_update`` are staged and published together;
a bare ``/update_weights`` applies its tensors at once (vLLM loads any subset), or stages while
generation is paused (published at ``/resume``). prime-rl's ``/update_weights {"weight_dir"}`` body is
``prime_rl_routes.update_from_weight_dir``.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any, Literal, Optional

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import Response
from pydantic import ConfigDict, Field

from rollout.engine.lifecycle import Opener
from rollout.outputs import RolloutOutput, WeightResult
from rollout.server import prime_rl_routes
from rollout.server import protocol as P
from rollout.server.auth import admin, user
from rollout.server.encoding import JSONResponse, openai_logprob
from rollout.server.encoding import vllm_error as _error
from rollout.server.openai_routes import prompt_logprob_dicts
from rollout.server.service import EngineService, service_of
from weight_sync.distributed import DIRECT, PACKED

router = APIRouter()
ADMIN = [Depends(admin)]
USER = [Depends(user)]
Svc = Depends(service_of)
VLLM_GROUP = "vllm-weight-transfer"  # the transfer group's name here (vLLM's has none)


# ------------------------------------------------------------------ pause, resume, world size


@router.post("/pause", dependencies=ADMIN)
async def pause(request: Request, mode: Literal["abort", "wait", "keep"] = "abort", clear_cache: bool = True,
                wait_for_inflight_requests: bool = False, svc: EngineService = Svc):
    """vLLM's modes: ``abort`` in-flight requests (partial outputs end with finish_reason "abort"),
    ``wait`` for them to finish, ``keep`` them frozen with their KV until ``/resume``. New requests
    queue meanwhile. ``clear_cache`` drops the prefix cache after an abort or wait (not with keep)."""
    if wait_for_inflight_requests:
        mode = "wait"
    if mode == "wait":  # new requests wait at the server's door while those in flight finish
        stats = await svc.read(svc.engine.get_stats)
        if stats["num_running"] + stats["num_waiting"] and await svc.read(svc.engine.is_paused):
            # what is in flight is frozen (an earlier pause kept it): it would never finish
            raise HTTPException(409, "generation is already paused with its requests kept: /resume first, or "
                                     "pause with mode=abort")
        svc.admission.clear()
        try:
            await _pause_once_idle(svc, request)
        finally:
            svc.admission.set()  # what waited now queues in the paused engine until /resume
    else:
        await svc.call(svc.engine.pause_generation, "in_place" if mode == "keep" else "abort")
    if clear_cache and mode != "keep":
        await svc.call(svc.engine.flush_cache)
    return {"status": "paused"}


async def _pause_once_idle(svc: EngineService, request: Request) -> None:
    """Pause once nothing runs or waits: the engine's quiet point, awaited as an event (no polling). 499 if the
    caller leaves first, 504 past the server's request timeout; either way the pause is withdrawn and nothing
    was paused (unless it had already taken effect: then it stands, as it would have a moment later)."""
    pending = svc.engine.pause_when_idle()
    paused = asyncio.get_running_loop().run_in_executor(None, pending.done.wait)
    left = asyncio.ensure_future(_disconnected(request))
    limit = svc.config.request_timeout_s
    try:
        done, _ = await asyncio.wait({paused, left}, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
    if paused not in done and pending.cancel():
        if left in done:
            raise HTTPException(499, "client disconnected")
        raise HTTPException(504, f"the requests in flight did not finish within {limit}s; nothing was paused")
    await paused
    pending.outcome()


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the server's ``http.disconnect``; this route reads no body)."""
    message = await request.receive()
    while message["type"] != "http.disconnect":
        message = await request.receive()


@router.post("/resume", dependencies=ADMIN)
async def resume(svc: EngineService = Svc):
    """Resume; update calls staged while paused are published first (a failed publish answers 400:
    generation continues on the old weights)."""
    result = await svc.resume()
    if result is not None:
        if not result.success:
            return _error(400, f"generation resumed on the old weights: {result.message}")
    return {"status": "resumed"}


@router.get("/is_paused", dependencies=USER)
async def is_paused(svc: EngineService = Svc):
    return {"is_paused": await svc.read(svc.engine.is_paused)}


@router.get("/get_world_size", dependencies=USER)
async def get_world_size(include_dp: bool = True, svc: EngineService = Svc):
    """The engine's ranks (TP; no data or pipeline parallelism here): a trainer sizes its transfer
    group as this + 1."""
    return {"world_size": svc.engine.tp_size}


# ------------------------------------------------------------------ the weight-transfer engine


class InitInfo(P.Lenient):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(1, ge=1)
    world_size: int = Field(ge=2)
    timeout_s: float = Field(60.0, gt=0, le=3600)


class InitTransferRequest(P.Lenient):
    init_info: InitInfo


class UpdateInfo(P.Lenient):
    """vLLM's ``NCCLWeightTransferUpdateInfo``: names with dtypes (no ``torch.`` prefix) and shapes,
    one broadcast per tensor, or ``packed`` chunks of ``packed_buffer_size_bytes``."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = False
    packed_buffer_size_bytes: int = Field(1 << 30, gt=0)
    packed_num_buffers: int = Field(2, ge=1)  # the receiver's pipelining depth; the wire layout is the same
    is_checkpoint_format: bool = True
    # vLLM's sparse_nccl (``SparseNCCLWeightTransferUpdateInfo``): per tensor, this many int32 flat indices into
    # the checkpoint tensor, then as many values, each one broadcast
    num_updates_list: Optional[list[int]] = None


class UpdateWeightsRequest(P.Lenient):
    """vLLM's ``{"update_info": ...}``, or prime-rl's ``{"weight_dir": path}`` (a checkpoint folder)."""

    update_info: Optional[UpdateInfo] = None
    weight_dir: Optional[str] = None


class StartUpdateRequest(P.Lenient):
    is_checkpoint_format: bool = True


class FinishUpdateRequest(P.Lenient):
    weight_version: Optional[str] = None


def _answer(result: WeightResult, message: str) -> JSONResponse:
    if not result.success:
        return _error(400, result.message)
    return JSONResponse({"message": message, "weight_version": result.weight_version})


@router.post("/init_weight_transfer_engine", dependencies=ADMIN)
async def init_weight_transfer_engine(body: InitTransferRequest, svc: EngineService = Svc):
    """Join the trainer's transfer group (the trainer is rank 0, this engine's ranks from
    ``rank_offset``); the call returns once the group stands (the trainer joins meanwhile). A group
    from an earlier call is replaced."""
    i = body.init_info
    await svc.call(svc.engine.destroy_weights_update_group, VLLM_GROUP)  # "no such group" is fine
    result = await svc.call(svc.engine.init_weights_update_group, i.master_address, i.master_port, i.rank_offset,
                            i.world_size, VLLM_GROUP, None, i.timeout_s)
    return _answer(result, "Weight transfer initialized")


@router.post("/start_weight_update", dependencies=ADMIN)
async def start_weight_update(body: Optional[StartUpdateRequest] = None, svc: EngineService = Svc):
    """Open a transaction: the ``/update_weights`` calls that follow stage; nothing serves from them
    until ``/finish_weight_update`` publishes them together."""
    if body is not None and not body.is_checkpoint_format:
        raise HTTPException(400, "is_checkpoint_format=false (vLLM's fused parameter names) is not supported: send "
                                 "checkpoint (Hugging Face) names")
    async with svc.in_order():
        result = await svc.call(svc.engine.begin_weight_update, None, Opener.VLLM)  # refused while one is open
    return _answer(result, "Weight update started")


@router.post("/update_weights", dependencies=ADMIN)
async def update_weights(body: UpdateWeightsRequest, svc: EngineService = Svc):
    if body.update_info is None:
        if body.weight_dir is None:
            raise HTTPException(400, "send update_info (vLLM's names, dtype_names, shapes, packed) or weight_dir "
                                     "(a checkpoint folder to read)")
        return await prime_rl_routes.update_from_weight_dir(body.weight_dir, svc)
    info = body.update_info
    if not info.is_checkpoint_format:
        raise HTTPException(400, "is_checkpoint_format=false (vLLM's fused parameter names) is not supported")
    if not (len(info.names) == len(info.dtype_names) == len(info.shapes)):
        raise HTTPException(400, f"names ({len(info.names)}), dtype_names ({len(info.dtype_names)}) and shapes "
                                 f"({len(info.shapes)}) must have the same length")
    if info.num_updates_list is not None:
        return await _sparse_update(info, svc)
    async with svc.in_order():
        staged = await svc.stages_for(Opener.VLLM)
        result = await svc.apply_update(
            svc.engine.update_weights_from_distributed, info.names, [d.removeprefix("torch.") for d in info.dtype_names],
            info.shapes, VLLM_GROUP, load_format=PACKED if info.packed else DIRECT,
            bucket_bytes=info.packed_buffer_size_bytes if info.packed else None, partial=True, transaction=staged)
    return {"message": "Weights updated"} if result.success else _error(400, result.message)


async def _sparse_update(info: UpdateInfo, svc: EngineService):
    """vLLM's sparse patches (``num_updates_list``): staged between start and finish, or applied at once."""
    if info.packed:
        raise HTTPException(400, "sparse updates (num_updates_list) are never packed: send packed=false")
    if len(info.num_updates_list or []) != len(info.names) or any(k < 0 for k in info.num_updates_list or []):
        raise HTTPException(400, f"num_updates_list needs one count (>= 0) per name ({len(info.names)})")
    async with svc.in_order():
        staged = await svc.stages_for(Opener.VLLM)
        result = await svc.apply_update(
            svc.engine.update_weights_from_sparse_distributed, info.names,
            [d.removeprefix("torch.") for d in info.dtype_names], info.shapes, info.num_updates_list, VLLM_GROUP,
            transaction=staged)
    return {"message": "Weights updated"} if result.success else _error(400, result.message)


@router.post("/finish_weight_update", dependencies=ADMIN)
async def finish_weight_update(body: Optional[FinishUpdateRequest] = None, svc: EngineService = Svc):
    """Publish what the calls since ``/start_weight_update`` staged, on every rank or none, under
    ``weight_version`` (else the server's next version)."""
    async with svc.in_order():
        result = await svc.apply_update(svc.engine.commit_weight_update, partial=True,
                                        weight_version=body.weight_version if body else None, by=Opener.VLLM)
    return _answer(result, "Weight update finished")


@router.get("/weight_info", dependencies=USER)
async def weight_info(svc: EngineService = Svc):
    return {"weight_version": svc.engine.get_weight_version()}


# ------------------------------------------------------------------ sleep and wake up, prefix cache


@router.post("/sleep", dependencies=ADMIN)
async def sleep(level: int = Query(1, ge=0, le=2), tags: Optional[list[str]] = Query(None),
                svc: EngineService = Svc):
    """vLLM's sleep: level 1 keeps a host copy of the weights (restored at wake-up) and drops the KV;
    level 2 drops both (the weights must be pushed again after wake-up); level 0 only pauses.
    Generation is paused (aborting what runs) until ``/wake_up``; a bad ``tags`` is refused before
    anything is paused or aborted."""
    tags = _memory_tags(tags)
    await svc.call(svc.engine.pause_generation, "abort")
    if level == 0:
        svc.sleeping = {"paused"}
        return Response(status_code=200)
    result = await svc.call(svc.engine.release_memory_occupation, tags, level == 1)
    if not result.success:
        await svc.resume()
        return _error(400, result.message)
    svc.sleeping = set(tags or ("weights", "kv_cache"))
    return Response(status_code=200)


def _memory_tags(tags: Optional[list[str]]) -> Optional[list[str]]:
    if not tags:
        return None
    bad = [t for t in tags if t not in ("weights", "kv_cache")]
    if bad:
        raise HTTPException(400, f"tags {bad}: use weights and/or kv_cache")
    return list(dict.fromkeys(tags))


@router.post("/wake_up", dependencies=ADMIN)
async def wake_up(tags: Optional[list[str]] = Query(None), svc: EngineService = Svc):
    """Resume what ``/sleep`` released (``tags``: only those); generation continues once nothing is
    asleep."""
    tags = _memory_tags(tags)
    asleep = sorted(svc.sleeping - {"paused"})
    waking = [t for t in (tags or asleep) if t in asleep]
    if waking:
        result = await svc.call(svc.engine.resume_memory_occupation, waking)
        if not result.success:
            return _error(400, result.message)
    svc.sleeping -= set(waking) | ({"paused"} if not tags else set())
    if not svc.sleeping - {"paused"}:
        svc.sleeping = set()
        await svc.resume()
    return Response(status_code=200)


@router.get("/is_sleeping", dependencies=USER)
async def is_sleeping(svc: EngineService = Svc):
    return {"is_sleeping": bool(svc.sleeping)}


class ResetCacheRequest(P.Lenient):
    reset_running_requests: bool = False
    reset_external: bool = False


@router.post("/reset_prefix_cache", dependencies=ADMIN)
async def reset_prefix_cache(request: Request, svc: EngineService = Svc):
    """Drop every cached prefix no request holds. Cached KV is keyed by the weight version it was
    computed under, so a prefix is never reused across a weight update either way; KV that running
    requests hold is theirs until they finish (``reset_running_requests`` is accepted; nothing is
    preempted)."""
    raw = await request.body()
    if raw.strip():
        try:
            ResetCacheRequest.model_validate_json(raw)
        except ValueError as exc:
            raise HTTPException(400, f"invalid body: {exc}") from None
    await svc.call(svc.engine.flush_cache)
    return Response(status_code=200)


# ------------------------------------------------------------------ tokens in, tokens out


class VllmSampling(P.Body):
    """vLLM's ``SamplingParams`` fields the RL clients send; an unknown key is refused by name (a
    misspelt sampling parameter must not be ignored)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    n: int = Field(1, ge=1, le=P.MAX_N)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[list[str] | str] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = Field(None, ge=0)
    min_tokens: int = Field(0, ge=0)
    logprobs: Optional[int] = Field(None, ge=-1, le=20)
    prompt_logprobs: Optional[int] = Field(None, ge=-1, le=20)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    detokenize: bool = True
    extra_args: Optional[dict[str, Any]] = None
    # features we do not have: accepted unset, refused when asked for
    bad_words: Optional[list[str]] = None
    truncate_prompt_tokens: Optional[int] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_decoding: Optional[dict[str, Any]] = None
    logits_processors: Optional[list[Any]] = None

    def ours(self, prompt_len: int, context_len: int) -> dict[str, Any]:
        for name in ("bad_words", "truncate_prompt_tokens", "structured_outputs", "guided_decoding",
                     "logits_processors"):
            if getattr(self, name):
                raise HTTPException(400, f"sampling_params.{name} is not supported by this server")
        sp: dict[str, Any] = {
            "n": self.n, "stop": self.stop, "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
            "no_stop_trim": self.include_stop_str_in_output, "min_new_tokens": self.min_tokens,
            "max_new_tokens": self.max_tokens if self.max_tokens is not None else max(context_len - prompt_len, 0),
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty}
        for name in ("temperature", "top_p", "min_p", "seed", "repetition_penalty", "allowed_token_ids"):
            if getattr(self, name) is not None:
                sp[name] = getattr(self, name)
        if self.top_k is not None and self.top_k > 0:  # vLLM's 0 and -1: no top-k
            sp["top_k"] = self.top_k
        if self.logit_bias:
            try:
                sp["logit_bias"] = P.token_logit_bias(self.logit_bias, "sampling_params.logit_bias")
            except ValueError as exc:
                raise HTTPException(400, str(exc)) from None
        return sp


class TokensRequest(P.Lenient):
    """vLLM's ``/inference/v1/generate`` body."""

    token_ids: list[int] = Field(min_length=1)
    sampling_params: VllmSampling = Field(default_factory=VllmSampling)
    model: Optional[str] = None
    request_id: Optional[str] = None
    stream: bool = False
    cache_salt: Optional[str] = None
    priority: int = 0
    features: Optional[dict[str, Any]] = None
    kv_transfer_params: Optional[dict[str, Any]] = None


def _k(requested: Optional[int], vocab: int) -> Optional[int]:
    """vLLM's logprobs counts: None none, -1 the whole vocabulary (capped here at 20)."""
    if requested is None:
        return None
    return min(vocab, 20) if requested < 0 else requested


@router.post("/inference/v1/generate", dependencies=USER)
async def generate_tokens(body: TokensRequest, request: Request, svc: EngineService = Svc):
    """Token ids in, token ids out (vLLM's disaggregated-serving API, SkyRL's and prime-rl's
    generation route): ``choices[i].token_ids``, ``finish_reason``, ``logprobs.content[j].logprob``
    with ``sampling_params.logprobs``; ``prompt_logprobs`` with ``sampling_params.prompt_logprobs``.
    ``X-Session-ID`` (SkyRL's sticky routing) is accepted."""
    return await _generate_tokens(body, request, svc, routed=False)


class SkyrlTokensRequest(TokensRequest):
    """``/skyrl/v1/generate``'s body: vLLM's, and SkyRL's evidence switches (refused here when set)."""

    return_full_logprobs: bool = False
    return_sample_support: bool = False


@router.post("/skyrl/v1/generate", dependencies=USER)
async def skyrl_generate(body: SkyrlTokensRequest, request: Request, svc: EngineService = Svc):
    """SkyRL's generation route when routed experts are on (its routing replay): ``/inference/v1/generate``'s
    answer with each choice's ``routed_experts`` packed as SkyRL reads it — ``{"data": base64, "shape":
    [positions, layers, top_k], "dtype"}`` in the smallest of uint8 / int16 / int32 that holds the ids, the
    positions those of prompt + outputs but the last. Needs a server started with
    ``--enable-return-routed-experts``."""
    if not svc.engine.config.outputs.return_routed_experts:
        raise HTTPException(400, "/skyrl/v1/generate returns routed experts: start the server with "
                                 "--enable-return-routed-experts (a mixture-of-experts model)")
    if body.return_full_logprobs or body.return_sample_support:
        raise HTTPException(400, "return_full_logprobs and return_sample_support are not served here: send neither")
    return await _generate_tokens(body, request, svc, routed=True)


def packed_routed_experts(experts) -> dict:
    """SkyRL's envelope: ``data`` first (its reader cuts the base64 out of the raw body by that prefix)."""
    top = int(experts.max()) if experts.numel() else 0
    dtype = "uint8" if top < 2**8 else "int16" if top < 2**15 else "int32"
    data = experts.numpy().astype(dtype, copy=False)
    return {"data": base64.b64encode(data.tobytes()).decode("ascii"), "shape": list(data.shape), "dtype": dtype}


async def _generate_tokens(body: TokensRequest, request: Request, svc: EngineService, routed: bool):
    svc.metrics.started(request.url.path)
    if body.stream:
        raise HTTPException(400, "stream is not supported on /inference/v1/generate here; send stream: false")
    if body.features:
        raise HTTPException(400, "features (multimodal inputs) are not supported by this server")
    if body.priority:
        raise HTTPException(400, "priority scheduling is not supported by this server; send priority 0")
    sp = body.sampling_params
    vocab = svc.engine.model_config.vocab_size
    out_k, prompt_k = _k(sp.logprobs, vocab), _k(sp.prompt_logprobs, vocab)
    want = out_k is not None or prompt_k is not None
    kwargs = dict(input_ids=[body.token_ids], sampling_params=sp.ours(len(body.token_ids), svc.context_len),
                  return_logprob=want, top_logprobs_num=max(out_k or 0, prompt_k or 0, int(prompt_k is not None)),
                  logprob_start_len=0 if prompt_k is not None else -1, cache_salt=body.cache_salt,
                  return_routed_experts=routed)
    outs = await svc.generate(request, kwargs)
    token_str = svc.token_text
    choices = []
    for o in sorted(outs, key=lambda o: o.sample_index):
        logprobs = None
        if out_k is not None:
            tops = o.output_top_logprobs or [[] for _ in o.output_token_ids]
            logprobs = {"content": [_content(token_str, t, lp, top[:out_k])
                                    for t, lp, top in zip(o.output_token_ids, o.output_logprobs, tops)]}
        choices.append({"index": o.sample_index, "logprobs": logprobs, "finish_reason": o.finish_reason or "stop",
                        "token_ids": o.output_token_ids})
        if routed:
            choices[-1]["routed_experts"] = packed_routed_experts(o.routed_experts) \
                if o.routed_experts is not None else None
    prompt_logprobs = prompt_logprob_dicts(token_str, outs[0], prompt_k) if prompt_k is not None else None
    return {"request_id": body.request_id or f"generate-tokens-{uuid.uuid4().hex}", "choices": choices,
            "prompt_logprobs": prompt_logprobs, "kv_transfer_params": None}


def _content(token_str, token: int, lp: float, top: list[tuple[int, float]]) -> dict:
    s = token_str(token)
    return {"token": s, "logprob": openai_logprob(lp), "bytes": list(s.encode()),
            "top_logprobs": [{"token": token_str(t), "logprob": openai_logprob(v),
                              "bytes": list(token_str(t).encode())} for t, v in top]}


class TokenizeRequest(P.Lenient):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[P.ChatMessage]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    chat_template: Optional[str] = None  # rendered only with --trust-request-chat-template
    tools: Optional[list[Any]] = None


@router.post("/tokenize", dependencies=USER)
async def tokenize(body: TokenizeRequest, svc: EngineService = Svc):
    """vLLM's: a prompt (special tokens added unless ``add_special_tokens`` is false) or chat
    messages rendered with the model's template."""
    tokenizer = svc.engine.tokenizer
    if tokenizer is None:
        raise HTTPException(400, "this server has no tokenizer: send token ids")
    if (body.prompt is None) == (body.messages is None):
        raise HTTPException(400, "send either prompt or messages")
    if body.tools:
        raise HTTPException(400, "tools in chat templates are not supported by this server")
    if body.prompt is not None:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        if body.continue_final_message:
            raise HTTPException(400, "continue_final_message is not supported by this server")
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str) else "".join(
            p.text or "" for p in (m.content or []) if p.type == "text")} for m in body.messages]
        ids = await svc.render(svc.render_chat, messages, body.add_generation_prompt, None, body.chat_template_kwargs,
                               body.chat_template)
    return {"count": len(ids), "max_model_len": svc.context_len, "tokens": list(ids),
            "token_strs": tokenizer.convert_ids_to_tokens(list(ids)) if body.return_token_strs else None}


class DetokenizeRequest(P.Lenient):
    model: Optional[str] = None
    tokens: list[int]


@router.post("/detokenize", dependencies=USER)
async def detokenize(body: DetokenizeRequest, svc: EngineService = Svc):
    tokenizer = svc.engine.tokenizer
    if tokenizer is None:
        raise HTTPException(400, "this server has no tokenizer")
    vocab = svc.engine.model_config.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise HTTPException(400, f"tokens must be ids in [0, {vocab})")
    return {"prompt": tokenizer.decode(body.tokens)}


@router.get("/liveness", dependencies=USER)
async def liveness(svc: EngineService = Svc):
    """prime-rl's probe of the engine loop."""
    if not svc.engine.health():
        raise HTTPException(503, "the engine loop is not running")
    return {"status": "ok"}


def rollout_outputs_by_prompt(outs: list[RolloutOutput]) -> dict[int, list[RolloutOutput]]:
    by: dict[int, list[RolloutOutput]] = {}
    for o in sorted(outs, key=lambda o: (o.prompt_index, o.sample_index)):
        by.setdefault(o.prompt_index, []).append(o)
    return by
