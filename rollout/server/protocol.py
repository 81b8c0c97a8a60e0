"""Request bodies of every route (pydantic: a bad body is a 400 naming the field), with SGLang's and
OpenAI's field names. Unknown top-level fields are ignored, as SGLang's dataclass bodies and
OpenAI-compatible servers ignore them (miles sends ``return_indexer_topk``, AReaL ``pp_rank``, the
router ``log_metrics``...); SGLang's fields for features this engine does not have are accepted at
their neutral value and refused, naming the feature, when asked for (``Neutral``).

Every body refuses what JSON parsers let through but nothing downstream can use: ``NaN`` and
``Infinity`` (Python's parser accepts them) in a number field, and strings holding a lone UTF-16
surrogate (``"\ud800"`` is valid JSON, but no tokenizer, path or UTF-8 encoder takes it)."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 256  # samples per prompt over HTTP


MAX_DEPTH = 64  # nesting of lists and objects in a body (tool schemas nest a dozen levels)


def _unusable(value: Any) -> Optional[str]:
    """Why a body cannot be used — a string (or key) holding a lone surrogate, or nesting deeper than
    ``MAX_DEPTH`` (renderers and encoders recurse) — naming where; None if it can. Walked without recursion."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return f"{path or 'body'} holds a lone UTF-16 surrogate (not text): send valid Unicode"
            continue
        if isinstance(v, (dict, list)) and depth >= MAX_DEPTH:
            return f"{path or 'body'} nests deeper than {MAX_DEPTH} levels"
        if isinstance(v, dict):
            for k, item in v.items():
                if isinstance(k, str):
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return (f"{path + '.' if path else ''}<a key> holds a lone UTF-16 surrogate (not text): send "
                                "valid Unicode")
                stack.append((item, f"{path}.{k}" if path else str(k), depth + 1))
        elif isinstance(v, list):  # numbers (token ids, shapes) need no look: only text and containers
            stack.extend((item, f"{path}.{i}" if path else str(i), depth + 1) for i, item in enumerate(v)
                         if isinstance(item, (str, dict, list)))
    return None


class Body(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        why = _unusable(data)
        if why is not None:
            raise ValueError(why)
        return data


class Lenient(Body):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# ---------------------------------------------------------------------------------------------
# generation

def _unset(value: Any) -> bool:
    """SGLang's neutral values: nothing, false, empty, or a per-prompt list of those."""
    if isinstance(value, list):
        return all(_unset(v) for v in value)
    return value is None or value is False or value == "" or value == {}


# SGLang GenerateReqInput fields whose feature this engine does not have -> what to say when set
NOT_HERE = {
    "image_data": "multimodal input is not supported (text-only Llama-family models)",
    "video_data": "multimodal input is not supported (text-only Llama-family models)",
    "audio_data": "multimodal input is not supported (text-only Llama-family models)",
    "input_embeds": "input_embeds are not supported: send text or input_ids",
    "token_ids_logprob": "token_ids_logprob is not supported: use top_logprobs_num",
    "return_hidden_states": "hidden states are not returned by this engine",
    "return_entropy": "return_entropy is not supported",
    "return_bytes": "return_bytes is not supported",
    "lora_id": "lora_id is SGLang's internal adapter id: name the adapter in lora_path",
    "custom_logit_processor": "custom logit processors are not supported (they would run pickled code)",
    "bootstrap_host": "prefill/decode disaggregation is not supported",
    "bootstrap_port": "prefill/decode disaggregation is not supported",
    "bootstrap_room": "prefill/decode disaggregation is not supported",
    "background": "background requests are not supported: wait for the answer or stream it",
}


class SessionParams(Lenient):
    """SGLang's ``session_params``: ``id`` names the session; a turn appends to its history. Branching
    (``rid`` of an earlier turn), ``offset``/``replace`` rewrites and ``drop_previous_output`` are
    not supported: a session here is one linear conversation."""

    id: str = Field(min_length=1)
    rid: Optional[str] = None
    offset: Optional[int] = None
    replace: Optional[bool] = None
    drop_previous_output: Optional[bool] = None

    @model_validator(mode="after")
    def _linear(self) -> SessionParams:
        branching = [n for n in ("rid", "offset", "replace", "drop_previous_output") if getattr(self, n)]
        if branching:
            raise ValueError(f"session_params {branching}: sessions here are linear (each turn appends); "
                             "open another session to branch")
        return self


class OpenSessionRequest(Lenient):
    capacity_of_str_len: Optional[int] = None  # SGLang's; the context limit bounds a session here
    session_id: Optional[str] = Field(None, min_length=1)
    timeout_s: Optional[float] = Field(None, gt=0)


class CloseSessionRequest(Lenient):
    session_id: str = Field(min_length=1)


class GenerateRequest(Lenient):
    """SGLang's ``GenerateReqInput``. Per-prompt lists of ``return_logprob``, ``logprob_start_len`` and
    ``top_logprobs_num`` are accepted when every prompt asks the same; ``sampling_params`` may differ
    per prompt. ``model`` (the router adds it), ``log_metrics``, ``no_logs``, ``priority``,
    ``modalities``, ``data_parallel_rank``, ``conversation_id``, ``custom_labels`` are accepted and
    change nothing here."""

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    return_logprob: Optional[Union[bool, list[bool]]] = False
    top_logprobs_num: Optional[Union[int, list[int]]] = 0
    logprob_start_len: Optional[Union[int, list[int]]] = -1
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: Optional[Union[str, list[str]]] = None
    return_sampling_mask: Optional[bool] = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    token_ids_logprob: Any = None
    return_hidden_states: Any = False
    return_routed_experts: Union[bool, list[bool]] = False
    routed_experts_start_len: Union[int, list[int]] = 0  # SGLang's: the first position whose experts return
    return_entropy: Any = False
    return_bytes: Any = False
    # a loaded LoRA adapter's name (SGLang's), or one per prompt (null: the base weights)
    lora_path: Optional[Union[str, list[Optional[str]]]] = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    background: Any = False
    # SGLang's session turn: {"id": the session from /open_session}; the input appends to its history.
    # A batch: one per prompt (null: not a turn), as SGLang's list form
    session_params: Optional[Union[SessionParams, list[Optional[SessionParams]]]] = None
    # SGLang's prefix-cache partition key (vLLM's cache_salt): cached KV is reused only within it
    extra_key: Optional[Union[str, list[Optional[str]]]] = None

    @model_validator(mode="after")
    def _supported(self) -> GenerateRequest:
        asked = [name for name in NOT_HERE if not _unset(getattr(self, name))]
        if asked:
            raise ValueError("; ".join(f"{name}: {NOT_HERE[name]}" for name in asked))
        # top_logprobs_num's upper bound is the server's (ServerConfig.max_top_logprobs_num), checked by the route
        for name, low, high in (("top_logprobs_num", 0, None), ("logprob_start_len", -1, None)):
            value = getattr(self, name)
            values = value if isinstance(value, list) else [value]
            if any(v is not None and (v < low or (high is not None and v > high)) for v in values):
                raise ValueError(f"{name} must be >= {low}" + (f" and <= {high}" if high is not None else ""))
        return self

    def session_ids(self) -> Union[str, list[Optional[str]], None]:
        """The engine's ``session_id`` argument: one id, or one per prompt."""
        if isinstance(self.session_params, list):
            return [p.id if p is not None else None for p in self.session_params]
        return self.session_params.id if self.session_params is not None else None

    def one(self, name: str, default: Any) -> Any:
        """A per-request value that SGLang allows per prompt: the one value every prompt asks for."""
        value = getattr(self, name)
        if isinstance(value, list):
            distinct = {v for v in value if v is not None}
            if len(distinct) > 1:
                raise ValueError(f"{name}: every prompt of one request must ask the same here (got {sorted(distinct)}); "
                                 "send prompts that differ in separate requests")
            value = distinct.pop() if distinct else None
        return default if value is None else value


def token_logit_bias(bias: dict[str, float], field_name: str = "logit_bias") -> dict[int, float]:
    """OpenAI's and vLLM's ``logit_bias`` (token ids as JSON object keys) as ours."""
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        raise ValueError(f"{field_name} keys must be token ids") from None


class OpenAISampling(Lenient):
    """The sampling fields both OpenAI routes share (plus vLLM/SGLang extensions: top_k, min_p,
    repetition_penalty, stop_token_ids, ignore_eos, min_tokens)."""

    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    n: int = Field(1, ge=1, le=MAX_N)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    stream: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    cache_salt: Optional[str] = None  # vLLM's prefix-cache partition (prime-rl salts with the policy version)
    return_token_ids: bool = False  # vLLM's: prompt and completion token ids in the answer
    return_tokens_as_token_ids: bool = False  # vLLM's: logprob tokens as "token_id:123" (AReaL, TRL read them)
    speculative: bool = True  # ours (SamplingParams.speculative): false keeps the request out of speculation


class CompletionRequest(OpenAISampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=0)
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False
    prompt_logprobs: Optional[int] = Field(None, ge=-1, le=20)  # vLLM's: per prompt position (TRL's teacher scoring)


class ContentPart(Lenient):
    """One part of a message's content; the text ones are read (``{"type": "text", "text": ...}``)."""

    type: str
    text: Optional[str] = None


class ChatMessage(Lenient):
    role: str
    content: Union[str, list[ContentPart], None] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's calls (OpenAI's shape)
    tool_call_id: Optional[str] = None  # a tool result's call
    name: Optional[str] = None
    reasoning_content: Optional[str] = None


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=0)
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    chat_template_kwargs: Optional[dict[str, Any]] = None  # template variables (enable_thinking, ...)
    chat_template: Optional[str] = None  # vLLM's: rendered only with --trust-request-chat-template
    tools: Optional[list[dict[str, Any]]] = None  # rendered by the chat template
    tool_choice: Optional[Union[str, dict[str, Any]]] = None  # "auto" / "none"; forcing a call is refused
    # a chat session (also SkyRL's X-Session-ID header): token-exact turns, the history's KV kept
    session_id: Optional[str] = Field(None, min_length=1)


class FinishSessionRequest(Lenient):
    session_id: str = Field(min_length=1)


# ---------------------------------------------------------------------------------------------
# weights and control (SGLang's fields)

class UpdateFromDiskRequest(Lenient):
    model_path: str
    load_format: str = "auto"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    recapture_cuda_graph: bool = False


class UpdateFromDeltaRequest(Lenient):
    """A delta patch folder (``weight_sync.delta.save_patch``: ``delta.json`` naming its base, ``delta.safetensors``)
    under ``--allowed-weight-dirs``; published as the version its header names."""

    path: str
    flush_cache: bool = True
    abort_all_requests: bool = False


class UpdateFromDeltaDistributedRequest(Lenient):
    """A delta push over the weight-update group: its header (``WeightDelta.header()``) and its tensors'
    names, dtypes and shapes, broadcast by the trainer in ``rollout_bucket`` buckets of ``bucket_bytes``."""

    header: dict
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    bucket_bytes: int = 128 << 20
    flush_cache: bool = True
    abort_all_requests: bool = False


PICKLED_TENSORS = (
    "serialized_named_tensors holds strings: base64 of a pickled MultiprocessingSerializer payload (SGLang's "
    "colocated form, sent by slime, miles and veRL). Not read here: this server never unpickles a payload in general; "
    "it reads the frameworks' tensor handles by an allowlist on /update_weights_from_tensor only, unless started with "
    "--no-tensor-handles. Send a same-host bucket handle instead, plain JSON: "
    "weight_sync.SharedMemoryBucket().write(named_tensors) on CPU, weight_sync.CudaIpcBucket(device).write("
    "named_tensors) on GPU (README: colocated trainers)")


def refuse_pickles(data: Any, field_name: str) -> Any:
    """A body whose ``field_name`` holds SGLang's pickled tensors (strings) is refused unread."""
    payload = data.get(field_name) if isinstance(data, dict) else None
    if isinstance(payload, str) or (isinstance(payload, list) and any(isinstance(p, str) for p in payload)):
        raise ValueError(PICKLED_TENSORS.replace("serialized_named_tensors", field_name))
    return data


class UpdateFromTensorRequest(Lenient):
    """A same-host bucket handle (``weight_sync.SharedMemoryBucket.write`` / ``CudaIpcBucket.write``,
    plain JSON), or SGLang's own form — base64 strings of the frameworks' pickled tensor handles, one per
    TP rank — read by ``weight_sync.handles`` (an allowlist that runs nothing) unless the server was
    started with ``--no-tensor-handles``."""

    serialized_named_tensors: Union[dict[str, Any], list[dict[str, Any]], str, list[str]]
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    partial: bool = False
    transaction: bool = False


class InitGroupRequest(Lenient):
    """SGLang's body; ``master_port`` may be a string (AReaL sends one), ``pp_rank`` (AReaL) and
    ``override_existing`` (SkyRL) are ignored."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Optional[Literal["gloo", "nccl"]] = None
    timeout_s: float = Field(60.0, gt=0, le=3600)


class UpdateFromDistributedRequest(Lenient):
    @model_validator(mode="before")
    @classmethod
    def _one_tensor_schema(cls, data: Any) -> Any:
        """SGLang's older one-tensor body (``name``, ``dtype``, ``shape``; legacy SkyRL sends one request per
        tensor, each applied as it arrives): read as a list of one, a partial update unless it says otherwise."""
        if isinstance(data, dict) and "name" in data and "names" not in data:
            if not isinstance(data["name"], str) or not isinstance(data.get("dtype"), str) or \
                    not isinstance(data.get("shape"), list):
                raise ValueError("the one-tensor body takes name (a string), dtype (a string) and shape (a list of "
                                 "integers)")
            data = {**{k: v for k, v in data.items() if k not in ("name", "dtype", "shape")},
                    "names": [data["name"]], "dtypes": [data["dtype"]], "shapes": [data["shape"]]}
            data.setdefault("partial", True)
        return data

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    # SGLang's: None (one broadcast per tensor) or "flattened_bucket"; ours: "rollout_bucket"
    load_format: Optional[Literal["direct", "flattened_bucket", "rollout_bucket"]] = None
    bucket_bytes: Optional[int] = Field(None, gt=0)
    point_to_point: bool = False  # ours: the trainer sends to this engine's ranks alone (a catch-up push)
    partial: bool = False
    transaction: bool = False


class GroupNameRequest(Lenient):
    group_name: str = "weight_update_group"


class GetWeightsRequest(Lenient):
    name: str
    truncate_size: int = Field(100, ge=0, le=1_000_000)


class WeightsCheckerRequest(Lenient):
    """SGLang's ``/weights_checker``; miles adds ``allow_quant_error``, ``selector``, ``skip_tensor_list``
    (accepted; every weight is checked)."""

    action: Literal["snapshot", "compare", "checksum", "reset_tensors"]


class VersionRequest(Lenient):
    new_version: str = Field(min_length=1)
    abort_all_requests: bool = False  # miles sends it (false)


class BeginUpdateRequest(Lenient):
    weight_version: Optional[str] = None


class CommitUpdateRequest(Lenient):
    flush_cache: bool = True
    partial: bool = False
    abort_all_requests: bool = False


class PauseRequest(Lenient):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class AbortRequest(Lenient):
    """SGLang's body (``rid`` "" or missing and ``abort_all`` false aborts nothing); ``prefix`` (miles'
    multi-LoRA abort) aborts every request whose id starts with ``rid``."""

    rid: Optional[str] = None
    abort_all: bool = False
    prefix: bool = False


class MemoryRequest(Lenient):
    tags: Optional[list[Literal["weights", "kv_cache", "cuda_graph"]]] = None


class ReleaseRequest(MemoryRequest):
    backup_weights: bool = False
