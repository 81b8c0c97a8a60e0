"""Request bodies of every route (pydantic: a bad body is a 400 naming the field), with SGLang's and
OpenAI's field names. Unknown fields are refused, except on the OpenAI routes, where clients send
fields we do not use (they are ignored, as OpenAI-compatible servers do).

Every body refuses what JSON parsers let through but nothing downstream can use: ``NaN`` and
``Infinity`` (Python's parser accepts them) in a number field, and strings holding a lone UTF-16
surrogate (``"\ud800"`` is valid JSON, but no tokenizer, path or UTF-8 encoder takes it)."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 256  # samples per prompt over HTTP


def _lone_surrogate(value: Any, path: str = "") -> Optional[str]:
    """The path of the first string (or key) in ``value`` holding a lone surrogate, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            where = f"{path}.{k}" if path else str(k)
            if isinstance(k, str) and _lone_surrogate(k) is not None:
                return (path + "." if path else "") + "<a key>"
            found = _lone_surrogate(v, where)
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _lone_surrogate(v, f"{path}.{i}" if path else str(i))
            if found:
                return found
    return None


class Body(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        where = _lone_surrogate(data)
        if where is not None:
            raise ValueError(f"{where} holds a lone UTF-16 surrogate (not text): send valid Unicode")
        return data


class Strict(Body):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# ---------------------------------------------------------------------------------------------
# generation

class GenerateRequest(Strict):
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=20)
    logprob_start_len: int = Field(-1, ge=-1)
    stream: bool = False
    rid: Optional[Union[str, list[str]]] = None
    return_sampling_mask: Optional[bool] = None


class Lenient(Body):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


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


class CompletionRequest(OpenAISampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=0)
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False


class ContentPart(Lenient):
    """One part of a message's content; the text ones are read (``{"type": "text", "text": ...}``)."""

    type: str
    text: Optional[str] = None


class ChatMessage(Lenient):
    role: str
    content: Union[str, list[ContentPart], None] = None


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=0)
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)


# ---------------------------------------------------------------------------------------------
# weights and control (SGLang's fields)

class UpdateFromDiskRequest(Strict):
    model_path: str
    load_format: str = "auto"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    recapture_cuda_graph: bool = False


class UpdateFromTensorRequest(Strict):
    """A same-host bucket handle (``weight_sync.SharedMemoryBucket.write`` / ``CudaIpcBucket.write``):
    plain JSON, never a pickle. SGLang sends one payload per TP rank; our ranks all open the one."""

    serialized_named_tensors: Union[dict[str, Any], list[dict[str, Any]]]
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    partial: bool = False
    transaction: bool = False


class InitGroupRequest(Strict):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Optional[Literal["gloo", "nccl"]] = None
    timeout_s: float = Field(60.0, gt=0, le=3600)


class UpdateFromDistributedRequest(Strict):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    load_format: Literal["flattened_bucket", "direct"] = "flattened_bucket"
    bucket_bytes: Optional[int] = Field(None, gt=0)
    partial: bool = False
    transaction: bool = False


class GroupNameRequest(Strict):
    group_name: str = "weight_update_group"


class GetWeightsRequest(Strict):
    name: str
    truncate_size: int = Field(100, ge=0, le=1_000_000)


class VersionRequest(Strict):
    new_version: str = Field(min_length=1)


class BeginUpdateRequest(Strict):
    weight_version: Optional[str] = None


class CommitUpdateRequest(Strict):
    flush_cache: bool = True
    partial: bool = False
    abort_all_requests: bool = False


class PauseRequest(Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class AbortRequest(Strict):
    rid: Optional[str] = None
    abort_all: bool = False


class MemoryRequest(Strict):
    tags: Optional[list[Literal["weights", "kv_cache", "cuda_graph"]]] = None


class ReleaseRequest(MemoryRequest):
    backup_weights: bool = False
