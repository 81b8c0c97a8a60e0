"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, so the
official ``openai`` client works unchanged (choice ``index`` = prompt index x n + sample index;
logprobs in OpenAI's shapes; streaming as ``chat.completion.chunk`` / ``text_completion`` events)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Optional

from fastapi import APIRouter, Depends, HTTPException, Request

from rollout.engine.tool_calls import StreamedReply, has_reasoning, parse_reply, parser_for_template
from rollout.outputs import RolloutOutput
from rollout.server import protocol as P
from rollout.server.auth import user
from rollout.server.encoding import openai_logprob
from rollout.server.service import EngineService, TextDeltas, service_of

DEFAULT_CHAT_MAX_TOKENS = 128
router = APIRouter()


def _sampling(body, max_tokens: Optional[int]) -> dict[str, Any]:
    sp: dict[str, Any] = {"n": body.n, "stop": body.stop, "stop_token_ids": body.stop_token_ids,
                          "ignore_eos": body.ignore_eos, "frequency_penalty": body.frequency_penalty,
                          "presence_penalty": body.presence_penalty, "min_new_tokens": body.min_tokens,
                          "speculative": body.speculative}
    if max_tokens is not None:
        sp["max_new_tokens"] = max_tokens
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty"):
        if getattr(body, name) is not None:
            sp[name] = getattr(body, name)
    if body.logit_bias:
        try:
            sp["logit_bias"] = P.token_logit_bias(body.logit_bias)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
    return sp


class _Tokens:
    """Token strings for logprobs (what OpenAI's ``token`` fields hold)."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self.tokenizer = tokenizer
        self.as_ids = as_ids  # vLLM's return_tokens_as_token_ids: "token_id:123"

    def __call__(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id])


def _usage(outs: list[RolloutOutput]) -> dict:
    prompt = sum({o.prompt_index: len(o.prompt_token_ids) for o in outs}.values())
    completion = sum(len(o.output_token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _index(o: RolloutOutput, n: int) -> int:
    return o.prompt_index * n + o.sample_index


def _top(token_str: _Tokens, top) -> dict:
    return {token_str(t): openai_logprob(lp) for t, lp in top}


def prompt_logprob_dicts(token_str, o: RolloutOutput, k: int) -> list[Optional[dict]]:
    """vLLM's ``prompt_logprobs``: null for the first token, then per position ``{token_id: {logprob,
    rank, decoded_token}}`` holding the prompt's own token (with its exact rank) and the top ``k``.
    The request must have asked for at least one top logprob (the ranks come with them)."""
    tops = o.input_top_logprobs or [[] for _ in o.input_logprobs]
    ranks = o.input_ranks or [None] * len(o.input_logprobs)
    out: list[Optional[dict]] = [None]
    for actual, lp, top, rank in zip(o.prompt_token_ids[1:], o.input_logprobs[1:], tops[1:], ranks[1:]):
        entry = {str(t): {"logprob": openai_logprob(v), "rank": r + 1, "decoded_token": token_str(t)}
                 for r, (t, v) in enumerate(top[:k])}
        if str(actual) not in entry:
            entry[str(actual)] = {"logprob": openai_logprob(lp), "rank": rank, "decoded_token": token_str(actual)}
        out.append(entry)
    return out


def _completion_logprobs(token_str: _Tokens, o: RolloutOutput, start: int = 0, echo: bool = False,
                         k: Optional[int] = None) -> dict:
    """OpenAI's completion logprobs from token ``start`` on (the top ``k`` of each, all asked for when
    None); with ``echo``, the prompt's tokens first (the first has no logprob: nothing precedes it)."""
    ids, lps = o.output_token_ids[start:], [openai_logprob(x) for x in o.output_logprobs[start:]]
    with_tops = bool(o.output_top_logprobs or (echo and o.input_top_logprobs))
    tops: Optional[list] = [_top(token_str, top[:k]) for top in o.output_top_logprobs[start:]] if with_tops else None
    if echo:
        prompt = o.prompt_token_ids
        scored = [None] * (len(prompt) - len(o.input_logprobs)) + [openai_logprob(x) for x in o.input_logprobs]
        ids, lps = prompt + ids, scored + lps
        if tops is not None:
            tops = [None] * (len(prompt) - len(o.input_top_logprobs)) + [
                _top(token_str, top) if top else None for top in o.input_top_logprobs] + tops
    tokens = [token_str(t) for t in ids]
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {"tokens": tokens, "token_logprobs": lps, "text_offset": offsets, "top_logprobs": tops or None}


def _chat_logprobs(token_str: _Tokens, o: RolloutOutput, start: int = 0) -> dict:
    tops = o.output_top_logprobs[start:] if o.output_top_logprobs else [[] for _ in o.output_token_ids[start:]]
    content = []
    for t, lp, top in zip(o.output_token_ids[start:], o.output_logprobs[start:], tops):
        s = token_str(t)
        content.append({"token": s, "logprob": openai_logprob(lp), "bytes": list(s.encode()),
                        "top_logprobs": [{"token": token_str(i), "logprob": openai_logprob(v),
                                          "bytes": list(token_str(i).encode())} for i, v in top]})
    return {"content": content}


# ------------------------------------------------------------------ /v1/models


@router.get("/v1/models", dependencies=[Depends(user)])
async def models(svc: EngineService = Depends(service_of)):
    """The base model, then every LoRA adapter new requests can name (vLLM's cards: ``parent`` the base)."""
    base = {"id": svc.model_name, "object": "model", "created": 0, "owned_by": "rollout-worker",
            "root": svc.engine.config.model_path, "max_model_len": svc.context_len}
    adapters = await svc.read(svc.engine.list_lora_adapters)
    return {"object": "list", "data": [base] + [
        {"id": a["name"], "object": "model", "created": 0, "owned_by": "rollout-worker", "root": a["source"],
         "parent": svc.model_name, "max_model_len": svc.context_len} for a in adapters if a["current"]]}


def _adapter(svc: EngineService, model: Optional[str]) -> Optional[str]:
    """The LoRA adapter a request's ``model`` names (vLLM's convention), None for the base model (any
    other name, as before adapters existed here, so clients that send a model id keep working)."""
    return model if model is not None and model in svc.engine.lora_adapter_names() else None


# ------------------------------------------------------------------ /v1/completions


@router.post("/v1/completions", dependencies=[Depends(user)])
async def completions(body: P.CompletionRequest, request: Request, svc: EngineService = Depends(service_of)):
    svc.metrics.started(request.url.path)
    prompt = body.prompt
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
        source = dict(prompts=prompt)
    else:
        source = dict(input_ids=prompt)
    want_lp = body.logprobs is not None
    prompt_k = None if body.prompt_logprobs is None else (20 if body.prompt_logprobs < 0 else body.prompt_logprobs)
    if (body.echo or prompt_k is not None) and body.stream:
        raise HTTPException(400, "echo and prompt_logprobs are answered whole: send them without stream")
    kwargs = dict(**source, sampling_params=_sampling(body, body.max_tokens),
                  return_logprob=want_lp or prompt_k is not None,
                  top_logprobs_num=max(body.logprobs or 0, prompt_k or 0, int(prompt_k is not None)),
                  logprob_start_len=0 if (body.echo and want_lp) or prompt_k is not None else -1,
                  cache_salt=body.cache_salt, lora_path=_adapter(svc, body.model))
    cid, created, model, token_str = f"cmpl-{uuid.uuid4().hex}", int(time.time()), kwargs["lora_path"] or \
        svc.model_name, _Tokens(svc.engine.tokenizer, body.return_tokens_as_token_ids)
    if body.stream:
        delta = TextDeltas()

        def shape(o: RolloutOutput):
            piece, first = delta(o)
            yield {"id": cid, "object": "text_completion", "created": created, "model": model,
                   "choices": [{"index": _index(o, body.n), "text": piece, "finish_reason": o.finish_reason,
                                "logprobs": _completion_logprobs(token_str, o, first) if want_lp else None}]}
        return await svc.stream(request, kwargs, shape)
    outs = await svc.generate(request, kwargs)
    prompt_text = _prompt_texts(svc, prompt, outs) if body.echo else {}
    choices = [{"index": _index(o, body.n), "text": prompt_text.get(o.prompt_index, "") + (o.text or ""),
                "finish_reason": o.finish_reason,
                "logprobs": _completion_logprobs(token_str, o, echo=body.echo, k=body.logprobs) if want_lp else None}
               for o in outs]
    for c, o in zip(choices, outs):
        if prompt_k is not None:
            c["prompt_logprobs"] = prompt_logprob_dicts(token_str, o, prompt_k)
        if body.return_token_ids:  # vLLM's: what TRL's newest client reads
            c["prompt_token_ids"], c["token_ids"] = o.prompt_token_ids, o.output_token_ids
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": sorted(choices, key=lambda c: c["index"]), "usage": _usage(outs)}


def _prompt_texts(svc: EngineService, prompt, outs: list[RolloutOutput]) -> dict[int, str]:
    """What ``echo`` puts before each completion: the prompt as sent (text), or its ids decoded."""
    if isinstance(prompt, str):
        return {0: prompt}
    if prompt and isinstance(prompt[0], str):
        return dict(enumerate(prompt))
    tokenizer = svc.engine.tokenizer
    if tokenizer is None:
        raise HTTPException(400, "echo of token-id prompts needs the model's tokenizer, which this server lacks")
    return {o.prompt_index: tokenizer.decode(o.prompt_token_ids) for o in outs}


# ------------------------------------------------------------------ /v1/chat/completions


def _messages(body: P.ChatCompletionRequest) -> list[dict]:
    """The request's messages as chat templates take them (text parts joined; tool calls' JSON
    arguments as objects, which templates render)."""
    messages = []
    for m in body.messages:
        content = m.content
        if isinstance(content, list):  # content parts: the text ones, joined
            content = "".join(part.text or "" for part in content if part.type == "text")
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        for name in ("tool_call_id", "name", "reasoning_content"):
            if getattr(m, name) is not None:
                msg[name] = getattr(m, name)
        messages.append(msg)
    return messages


def _template_call(call: dict) -> dict:
    fn = call.get("function") or call
    if not isinstance(fn, dict):
        raise HTTPException(400, "a tool call's function must be an object with a name and arguments")
    fn = dict(fn)
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            raise HTTPException(400, "a tool call's arguments must be a JSON object (or its JSON text)") from None
    return {**call, "function": fn} if "function" in call else fn


async def _chat_ids(svc: EngineService, body: P.ChatCompletionRequest) -> list[int]:
    return await svc.render(svc.render_chat, _messages(body), True, body.tools, body.chat_template_kwargs,
                            body.chat_template)


def _parsers(svc: EngineService, body: P.ChatCompletionRequest) -> tuple[Optional[str], bool]:
    """(tool-call parser or None, whether to split reasoning) for this request's replies."""
    if isinstance(body.tool_choice, dict) or body.tool_choice == "required":
        raise HTTPException(400, "tool_choice that forces a call needs constrained decoding, which this server does not "
                                 "have: send \"auto\" (or \"none\")")
    template = getattr(svc.engine.tokenizer, "chat_template", None) if svc.engine.tokenizer is not None else None
    cfg = svc.config
    parser = None
    if body.tools and body.tool_choice != "none" and cfg.tool_call_parser != "none":
        parser = parser_for_template(template) if cfg.tool_call_parser == "auto" else cfg.tool_call_parser
    reasoning = cfg.reasoning_parser == "think" or (cfg.reasoning_parser == "auto" and has_reasoning(template))
    return parser, reasoning


def _reply_text(svc: EngineService, o: RolloutOutput) -> str:
    """A reply's text for the parsers: special tokens kept (tool-call markers may be special tokens),
    the stop token that ended it left out."""
    ids = o.output_token_ids
    if o.finish_reason == "stop" and isinstance(o.matched_stop, int) and ids and ids[-1] == o.matched_stop:
        ids = ids[:-1]
    return svc.engine.tokenizer.decode(ids, skip_special_tokens=False)


def _reply(svc: EngineService, o: RolloutOutput, parser: Optional[str], reasoning: bool) -> tuple[dict, str]:
    """The assistant message of a reply (tool calls and reasoning parsed out when asked) and its
    finish reason ("tool_calls" when it called any)."""
    if parser is None and not reasoning:
        return {"role": "assistant", "content": o.text or ""}, o.finish_reason
    parsed = parse_reply(_reply_text(svc, o), parser, reasoning)
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning_content is not None:
        msg["reasoning_content"] = parsed.reasoning_content
    if parsed.tool_calls:
        msg["tool_calls"] = parsed.tool_calls
        return msg, "tool_calls"
    return msg, o.finish_reason


@router.post("/v1/chat/completions", dependencies=[Depends(user)])
async def chat_completions(body: P.ChatCompletionRequest, request: Request, svc: EngineService = Depends(service_of)):
    svc.metrics.started(request.url.path)
    # 0 is a limit like any other (a prefill-only request), not "unset"
    max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None),
                      DEFAULT_CHAT_MAX_TOKENS)
    session_key = request.headers.get("x-session-id") or body.session_id
    if session_key is not None:
        return await _session_turn(svc, body, request, session_key, max_tokens)
    ids = await _chat_ids(svc, body)
    kwargs = dict(input_ids=[ids], sampling_params=_sampling(body, max_tokens), return_logprob=body.logprobs,
                  top_logprobs_num=body.top_logprobs or 0, cache_salt=body.cache_salt,
                  lora_path=_adapter(svc, body.model))
    cid, created, model, token_str = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), kwargs["lora_path"] or \
        svc.model_name, _Tokens(svc.engine.tokenizer, body.return_tokens_as_token_ids)
    parser, reasoning = _parsers(svc, body)
    if body.stream:
        delta = TextDeltas()
        started: set[int] = set()
        replies: dict[int, StreamedReply] = {}  # with a tool-call parser: per choice, calls held until complete

        def shape(o: RolloutOutput):
            piece, first = delta(o)
            i = _index(o, body.n)
            d: dict[str, Any] = {"content": piece}
            finish = o.finish_reason
            if parser is not None:
                reply = replies.setdefault(i, StreamedReply(parser))
                d["content"], calls = reply.feed(_reply_text(svc, o), o.finish_reason is not None)
                if calls:  # OpenAI's streamed shape: each call whole, by its index
                    d["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
                    finish = "tool_calls"
            if i not in started:
                started.add(i)
                d["role"] = "assistant"
            yield {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [{"index": i, "delta": d, "finish_reason": finish,
                                "logprobs": _chat_logprobs(token_str, o, first) if body.logprobs else None}]}
        return await svc.stream(request, kwargs, shape)
    outs = await svc.generate(request, kwargs)
    choices = []
    for o in outs:
        message, finish = _reply(svc, o, parser, reasoning)
        choices.append({"index": _index(o, body.n), "message": message, "finish_reason": finish,
                        "logprobs": _chat_logprobs(token_str, o) if body.logprobs else None})
    extra: dict[str, Any] = {}
    if body.return_token_ids:  # vLLM's: the rendered prompt's ids and each choice's
        extra["prompt_token_ids"] = ids
        for c, o in zip(choices, outs):
            c["token_ids"] = o.output_token_ids
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": sorted(choices, key=lambda c: c["index"]), "usage": _usage(outs), **extra}


async def _session_turn(svc: EngineService, body: P.ChatCompletionRequest, request: Request, key: str,
                        max_tokens: int):
    """A turn of chat session ``key`` (``rollout.server.chat_sessions``): only the new messages are
    rendered and appended; ``prompt_token_ids`` is the whole conversation as the engine holds it."""
    if body.n != 1 or body.stream:
        raise HTTPException(400, "a chat session turn takes n=1 and no stream")
    if body.chat_template is not None:
        raise HTTPException(400, "a chat session renders with the model's chat template: send no chat_template")
    messages = _messages(body)
    parser, reasoning = _parsers(svc, body)
    session, turn = await svc.render(svc.chat_sessions.turn_input, key, messages, body.chat_template_kwargs or {},
                                     body.tools)
    kwargs = dict(input_ids=[turn.token_ids], sampling_params=_sampling(body, max_tokens), return_logprob=body.logprobs,
                  top_logprobs_num=body.top_logprobs or 0, session_id=session.engine_session,
                  lora_path=_adapter(svc, body.model))
    outs = await svc.generate(request, kwargs)
    o = outs[0]
    svc.chat_sessions.record(session, messages, o)
    token_str = _Tokens(svc.engine.tokenizer, body.return_tokens_as_token_ids)
    message, finish = _reply(svc, o, parser, reasoning)
    choice = {"index": 0, "message": message, "finish_reason": finish,
              "logprobs": _chat_logprobs(token_str, o) if body.logprobs else None, "token_ids": o.output_token_ids}
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": kwargs["lora_path"] or svc.model_name, "choices": [choice], "usage": _usage(outs),
            "prompt_token_ids": o.prompt_token_ids, "session_id": key, "session_restarted": turn.restarted,
            "render_mode": turn.mode, "cached_tokens": o.num_cached_tokens}


@router.post("/finish_session", dependencies=[Depends(user)])
async def finish_session(body: P.FinishSessionRequest, svc: EngineService = Depends(service_of)):
    """SkyRL's: the chat session's history and KV are freed."""
    closed = await svc.read(svc.chat_sessions.close, body.session_id)
    return {"success": closed, "session_id": body.session_id}
