"""SGLang's generation routes: ``/generate`` (whole or streamed, SGLang's output shape plus our
per-token weight versions) and ``/health_generate``."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable
from typing import Any, Optional

from fastapi import APIRouter, Depends, HTTPException, Request, Response

from rollout.outputs import RolloutOutput
from rollout.server import protocol as P
from rollout.server.auth import user
from rollout.server.service import EngineService, TextDeltas, service_of

router = APIRouter()


# AReaL reads "Abort before prefill" as "no token was generated" (CLIENTS.md 5.1)
ABORT_BEFORE_PREFILL = "Abort before prefill"
ABORT_DURING_DECODE = "Abort during decode (the client, abort_request or a weight update with abort_all_requests)"


def _finish(o: RolloutOutput) -> Optional[dict]:
    """SGLang's finish reason: ``{"type": "stop", "matched": id|str}``, ``{"type": "length", "length":
    n}``, ``{"type": "abort", "message": ...}``."""
    if o.finish_reason is None:
        return None
    out: dict[str, Any] = {"type": o.finish_reason}
    if o.matched_stop is not None:
        out["matched"] = o.matched_stop
    if o.finish_reason == "length":
        out["length"] = len(o.output_token_ids)
    if o.finish_reason == "abort":
        out["message"] = ABORT_DURING_DECODE if o.output_token_ids else ABORT_BEFORE_PREFILL
    return out


TokenText = Callable[[int], Optional[str]]


def _no_text(token: int) -> Optional[str]:
    return None


def sglang_item(o: RolloutOutput, return_logprob: bool, text_of: TokenText = _no_text) -> dict:
    """One sample as SGLang's ``/generate`` shapes it, plus our per-token weight versions; each
    logprob entry is ``[logprob, token_id, text]``, the text ``null`` unless ``text_of`` decodes it
    (``return_text_in_logprobs``)."""
    meta: dict[str, Any] = {
        "id": o.rid, "prompt_index": o.prompt_index, "sample_index": o.sample_index, "finish_reason": _finish(o),
        "prompt_tokens": len(o.prompt_token_ids), "completion_tokens": len(o.output_token_ids),
        "cached_tokens": o.num_cached_tokens, "weight_version": o.weight_version,
        "output_weight_versions": o.output_weight_versions, "e2e_latency": o.latency_s,
    }
    if o.spec_verify_ct is not None:  # SGLang's, under speculative decoding (slime and miles read them)
        meta.update(spec_verify_ct=o.spec_verify_ct, spec_draft_token_num=o.spec_draft_token_num,
                    spec_accept_token_num=o.spec_accept_token_num)
    if o.lora_name is not None:  # the adapter and its version the request ran on (ours)
        meta["lora_name"], meta["lora_version"] = o.lora_name, o.lora_version
    if return_logprob:
        meta["logprob_mode"] = o.logprob_mode
        meta["output_token_logprobs"] = [[lp, t, text_of(t)] for lp, t in zip(o.output_logprobs, o.output_token_ids)]
        meta["output_top_logprobs"] = [[[lp, t, text_of(t)] for t, lp in top] for top in o.output_top_logprobs]
        start = len(o.prompt_token_ids) - len(o.input_logprobs)
        meta["input_token_logprobs"] = [[lp, t, text_of(t)]
                                        for lp, t in zip(o.input_logprobs, o.prompt_token_ids[start:])]
        meta["input_top_logprobs"] = [[[lp, t, text_of(t)] for t, lp in top] for top in o.input_top_logprobs]
    if o.output_token_sampling_mask:  # SGLang's names
        meta["output_token_sampling_mask"] = o.output_token_sampling_mask
        meta["output_token_sampling_logprobs"] = o.output_token_sampling_logprobs
    if o.routed_experts is not None:  # SGLang's: base64 of int32 [positions, layers, top_k], once finished
        meta["routed_experts"] = routed_experts_base64(o.routed_experts)
        meta["routed_experts_start_len"] = o.routed_experts_start_len
    return {"text": o.text, "output_ids": o.output_token_ids, "meta_info": meta}


def routed_experts_base64(experts) -> str:
    """SGLang's wire form of routed experts: the int32 values, little-endian, row-major, in base64."""
    return base64.b64encode(experts.numpy().astype("<i4", copy=False).tobytes()).decode("ascii")


# the per-output-token lists of meta_info, sliced to the new tokens in an incremental stream
_PER_TOKEN = ("output_token_logprobs", "output_top_logprobs", "output_weight_versions",
              "output_token_sampling_mask", "output_token_sampling_logprobs")


def _incremental(return_logprob: bool, text_of: TokenText):
    """SGLang's incremental stream: ``text`` and ``output_ids`` (and the per-token lists of
    ``meta_info``) hold only what is new since the sample's last event; counts stay totals."""
    deltas = TextDeltas()

    def shape(o: RolloutOutput):
        text, first = deltas(o)
        item = sglang_item(o, return_logprob, text_of)
        item["text"], item["output_ids"] = text, item["output_ids"][first:]
        meta = item["meta_info"]
        for name in _PER_TOKEN:
            if name in meta and meta[name] is not None:
                meta[name] = meta[name][first:]
        return [item]

    return shape


@router.post("/generate", dependencies=[Depends(user)])
async def generate(body: P.GenerateRequest, request: Request, svc: EngineService = Depends(service_of)):
    svc.metrics.started(request.url.path)
    if (body.text is None) == (body.input_ids is None):
        raise HTTPException(400, "pass exactly one of text or input_ids")
    try:
        return_logprob = bool(body.one("return_logprob", False))
        top_n = body.one("top_logprobs_num", 0) or 0
        cap = svc.config.max_top_logprobs_num
        if cap >= 0 and top_n > cap:
            raise ValueError(f"top_logprobs_num must be <= {cap} on this server (its --max-top-logprobs-num; -1 "
                             "allows the whole vocabulary)")
        kwargs = dict(prompts=body.text, input_ids=body.input_ids, sampling_params=body.sampling_params or {},
                      return_logprob=return_logprob, top_logprobs_num=top_n,
                      logprob_start_len=body.one("logprob_start_len", -1), rid=body.rid,
                      return_sampling_mask=body.return_sampling_mask, cache_salt=body.one("extra_key", None),
                      session_id=body.session_ids(), lora_path=body.lora_path,
                      return_routed_experts=body.one("return_routed_experts", False),
                      routed_experts_start_len=body.one("routed_experts_start_len", 0))
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from None
    text_of = svc.token_text if body.return_text_in_logprobs else _no_text
    if body.return_text_in_logprobs and svc.engine.tokenizer is None:
        raise HTTPException(400, "return_text_in_logprobs needs a tokenizer; this server has none")
    if body.stream:
        if svc.config.incremental_streaming_output:
            return await svc.stream(request, kwargs, _incremental(return_logprob, text_of))
        return await svc.stream(request, kwargs, lambda o: [sglang_item(o, return_logprob, text_of)])
    outs = await svc.generate(request, kwargs)
    items = [sglang_item(o, return_logprob, text_of) for o in outs]
    single = isinstance(body.text, str) or (body.input_ids is not None and body.input_ids
                                            and isinstance(body.input_ids[0], int))
    return items[0] if single and len(items) == 1 else items


@router.post("/open_session", dependencies=[Depends(user)])
async def open_session(body: P.OpenSessionRequest, svc: EngineService = Depends(service_of)):
    """SGLang's: the new session's id (a JSON string). Turns: ``/generate`` with ``session_params:
    {"id": ...}`` and the tokens (or text) they append."""
    return await svc.call(svc.engine.open_session, body.session_id, body.timeout_s)


@router.post("/close_session", dependencies=[Depends(user)])
async def close_session(body: P.CloseSessionRequest, svc: EngineService = Depends(service_of)):
    await svc.call(svc.engine.close_session, body.session_id)
    return Response(status_code=200)


@router.get("/session_info", dependencies=[Depends(user)])
async def session_info(session_id: str, svc: EngineService = Depends(service_of)):
    """The session's history as token ids (what a trainer trains on), its turns and cached tokens."""
    return await svc.call(svc.engine.session_info, session_id)


@router.get("/health_generate", dependencies=[Depends(user)])
async def health_generate(request: Request, svc: EngineService = Depends(service_of)):
    kwargs = dict(input_ids=[[0]], sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                  return_logprob=False, rid=f"health-{uuid.uuid4().hex[:8]}")
    outs = await svc.generate(request, kwargs)
    return {"status": "ok", "output_ids": outs[0].output_token_ids}
