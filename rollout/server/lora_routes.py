"""LoRA adapter routes under the field's names (``RolloutEngine.load_lora_adapter`` and its kin).

SGLang's ``/load_lora_adapter``, ``/unload_lora_adapter``, ``/load_lora_adapter_from_tensors`` and
``/load_lora_adapter_from_distributed`` (miles' adapter push over the weight-update group) answer
SGLang's ``{"success", "error_message", "loaded_adapters"}`` (200, or 400 on failure);
prime-rl and AReaL send the first to vLLM servers too, so both families get it. vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` answer as vLLM does: a plain-text success
line, 400 for a name already loaded unless ``load_inplace`` (which loads a new version), 404 for
unloading a name that is not loaded. SkyRL's ``/skyrl/v1/load_lora_adapter`` loads in place.
Adapter folders are read only under ``--allowed-weight-dirs`` (403 outside), pinned and read through
the pin as weight folders are; tensors come as a same-host bucket handle, never a pickle. Requests
name an adapter as ``lora_path`` on ``/generate`` and as ``model`` on the OpenAI routes.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field, model_validator

from rollout.outputs import WeightResult
from rollout.server import protocol as P
from rollout.server.auth import admin
from rollout.server.encoding import JSONResponse
from rollout.server.service import EngineService, local_bucket_handle, result_json, service_of
from rollout.weights.safetensors_io import FolderNotAllowed

router = APIRouter()
ADMIN = [Depends(admin)]
Svc = Depends(service_of)


class LoadLoraRequest(P.Lenient):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)
    pinned: bool = False  # SGLang's
    load_inplace: bool = False  # vLLM's


class UnloadLoraRequest(P.Lenient):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: Optional[int] = None  # vLLM's, ignored: names identify adapters here


class LoadLoraTensorsRequest(P.Lenient):
    """SGLang's ``load_lora_adapter_from_tensors``: ``serialized_tensors`` as a same-host bucket handle
    (``weight_sync.SharedMemoryBucket().write(named)``, plain JSON), never SGLang's pickled form."""

    lora_name: str = Field(min_length=1, max_length=256)
    config_dict: dict[str, Any]
    serialized_tensors: Union[dict[str, Any], list[dict[str, Any]]]
    pinned: bool = False
    load_format: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _no_pickles(cls, data: Any) -> Any:
        return P.refuse_pickles(data, "serialized_tensors")


class LoadLoraDistributedRequest(P.Lenient):
    """SGLang's (and miles') ``load_lora_adapter_from_distributed``: the adapter's tensors come as
    broadcasts over a weight-update group (``init_weights_update_group``), described here."""

    lora_name: str = Field(min_length=1, max_length=256)
    config_dict: dict[str, Any]
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    pinned: bool = False
    upsert: bool = True  # miles': refresh a loaded name in place (here: always a new version of it)
    added_tokens_config: Optional[dict[str, Any]] = None
    load_format: Optional[Literal["direct", "flattened_bucket", "rollout_bucket", "packed"]] = None
    bucket_bytes: Optional[int] = Field(None, gt=0)
    weight_version: Optional[str] = None


def _loaded(result: WeightResult, svc: EngineService) -> dict:
    adapters = result.detail.get("loaded_adapters")
    if adapters is None:
        adapters = svc.engine.list_lora_adapters()
    return {a["name"]: a["source"] for a in adapters if a["current"]}


def _sglang(result: WeightResult, svc: EngineService) -> JSONResponse:
    """The result as the weight routes answer it, with SGLang's ``error_message`` and ``loaded_adapters``."""
    return result_json(result, error_message=None if result.success else result.message,
                       loaded_adapters=_loaded(result, svc))


async def _load_folder(svc: EngineService, body: LoadLoraRequest) -> WeightResult:
    if "\x00" in body.lora_path:
        raise HTTPException(400, "lora_path contains a NUL byte")
    try:
        return await svc.call(svc.engine.load_lora_adapter, body.lora_name, body.lora_path, body.pinned,
                                      svc.allowed_dirs)
    except FolderNotAllowed as exc:
        raise HTTPException(403, str(exc)) from None


@router.post("/load_lora_adapter", dependencies=ADMIN)
async def load_lora_adapter(body: LoadLoraRequest, svc: EngineService = Svc):
    return _sglang(await _load_folder(svc, body), svc)


@router.post("/unload_lora_adapter", dependencies=ADMIN)
async def unload_lora_adapter(body: UnloadLoraRequest, svc: EngineService = Svc):
    return _sglang(await svc.call(svc.engine.unload_lora_adapter, body.lora_name), svc)


@router.post("/load_lora_adapter_from_tensors", dependencies=ADMIN)
async def load_lora_adapter_from_tensors(body: LoadLoraTensorsRequest, request: Request, svc: EngineService = Svc):
    from weight_sync.shm import open_bucket

    handle = local_bucket_handle(request, body.serialized_tensors, "serialized_tensors")

    def load() -> WeightResult:
        try:
            bucket = open_bucket(handle)
        except (ValueError, KeyError, TypeError, OSError, RuntimeError) as exc:
            return WeightResult.fail(f"cannot read the tensor bucket: {exc}")
        try:
            return svc.engine.load_lora_adapter_from_tensors(body.lora_name, bucket.named_tensors, body.config_dict,
                                                             body.pinned)
        finally:
            bucket.close()

    return _sglang(await svc.call(load), svc)


@router.post("/load_lora_adapter_from_distributed", dependencies=ADMIN)
async def load_lora_adapter_from_distributed(body: LoadLoraDistributedRequest, svc: EngineService = Svc):
    """The answer comes once every broadcast has arrived; a refused adapter is still received (drained),
    so the trainer's broadcasts complete. ``added_tokens_config`` (an adapter that adds tokens) is
    refused: adapters here cannot change the vocabulary."""
    if body.added_tokens_config:
        raise HTTPException(400, "added_tokens_config: adapters that add tokens are not supported (the vocabulary "
                                 "and embeddings are the base model's); send the adapter without it")
    return _sglang(await svc.call(svc.engine.load_lora_adapter_from_distributed, body.lora_name, body.config_dict,
                                  body.names, body.dtypes, body.shapes, body.group_name, body.load_format,
                                  body.bucket_bytes, body.pinned, body.weight_version), svc)


def _current(svc: EngineService) -> set[str]:
    return set(svc.engine.lora_adapter_names())


async def _vllm_load(svc: EngineService, body: LoadLoraRequest) -> PlainTextResponse:
    result = await _load_folder(svc, body)
    if not result.success:
        raise HTTPException(400, result.message)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/load_lora_adapter", dependencies=ADMIN)
async def vllm_load_lora_adapter(body: LoadLoraRequest, svc: EngineService = Svc):
    if not body.load_inplace and body.lora_name in _current(svc):
        raise HTTPException(400, f"The lora adapter '{body.lora_name}' has already been loaded. If you want to load "
                                 "the adapter in place, set 'load_inplace' to True.")
    return await _vllm_load(svc, body)


@router.post("/skyrl/v1/load_lora_adapter", dependencies=ADMIN)
async def skyrl_load_lora_adapter(body: LoadLoraRequest, svc: EngineService = Svc):
    """SkyRL's: the adapter's new weights under the same name (a new version, in place)."""
    return await _vllm_load(svc, body)


@router.post("/v1/unload_lora_adapter", dependencies=ADMIN)
async def vllm_unload_lora_adapter(body: UnloadLoraRequest, svc: EngineService = Svc):
    if body.lora_name not in _current(svc):
        raise HTTPException(404, f"The lora adapter '{body.lora_name}' cannot be found.")
    result = await svc.call(svc.engine.unload_lora_adapter, body.lora_name)
    if not result.success:
        raise HTTPException(400, result.message)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
