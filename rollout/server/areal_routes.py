"""AReaL's routes (its vLLM server extension, ``areal_*``): pause and continue (update calls in between stage
into the paused engine's transaction, ``Opener.PAUSED``, published by the continue), its weight-update group,
tensor metadata then one receive per push, checkpoint folders, LoRA adapters by name and version."""

from __future__ import annotations

from typing import Any, Literal, Optional

from fastapi import APIRouter, Body, Depends, HTTPException
from pydantic import Field

from rollout.outputs import WeightResult
from rollout.server import protocol as P
from rollout.server.auth import admin
from rollout.server.encoding import JSONResponse
from rollout.server.service import EngineService, service_of
from rollout.weights.safetensors_io import FolderNotAllowed

router = APIRouter()
ADMIN = [Depends(admin)]
Svc = Depends(service_of)


class ArealGroupRequest(P.Lenient):
    master_address: str
    master_port: int = Field(ge=1, le=65535)  # AReaL sends a string
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    backend: Optional[Literal["gloo", "nccl"]] = None
    group_name: str = "update_weight_group"
    timeout_s: float = Field(60.0, gt=0, le=3600)  # AReaL sends none: the documented 60 s, end to end


class ArealMetaRequest(P.Lenient):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "update_weight_group"


class ArealDiskRequest(P.Lenient):
    model_path: str
    load_format: Optional[str] = "auto"
    abort_all_requests: bool = False


def _areal(result: WeightResult) -> JSONResponse:
    """AReaL's answers: ``{"success", "message"}``, 400 on failure."""
    return JSONResponse({"success": result.success, "message": result.message},
                        status_code=200 if result.success else 400)


@router.post("/areal_pause_generation", dependencies=ADMIN)
async def areal_pause_generation(svc: EngineService = Svc):
    await svc.call(svc.engine.pause_generation, "abort")
    return {"success": True, "message": "Generation paused and all requests aborted"}


@router.post("/areal_continue_generation", dependencies=ADMIN)
async def areal_continue_generation(svc: EngineService = Svc):
    result = await svc.resume()
    if result is not None and not result.success:
        return JSONResponse({"success": False, "message": f"generation continues on the old weights: "
                             f"{result.message}"}, status_code=400)
    return {"success": True, "message": "Generation continued"}


@router.post("/areal_init_weights_update_group", dependencies=ADMIN)
async def areal_init_weights_update_group(body: ArealGroupRequest, svc: EngineService = Svc):
    return _areal(await svc.call(svc.engine.init_weights_update_group, body.master_address, body.master_port,
                                 body.rank_offset, body.world_size, body.group_name, body.backend, body.timeout_s))


@router.post("/areal_set_update_weight_meta", dependencies=ADMIN)
async def areal_set_update_weight_meta(body: ArealMetaRequest, svc: EngineService = Svc):
    """What the next ``/areal_update_weights_xccl`` receives (one broadcast per tensor, in this order)."""
    if not (len(body.names) == len(body.dtypes) == len(body.shapes)):
        raise HTTPException(400, "names, dtypes and shapes must have the same length")
    svc.areal_meta = body
    return {"success": True, "message": f"metadata of {len(body.names)} tensors set"}


@router.post("/areal_update_weights_xccl", dependencies=ADMIN)
async def areal_update_weights_xccl(svc: EngineService = Svc):
    """Aborts what runs (as AReaL's server does), then receives the tensors the metadata announced."""
    meta = svc.areal_meta
    if meta is None:
        raise HTTPException(400, "no weight metadata: call /areal_set_update_weight_meta first")
    return _areal(await svc.apply_update(svc.engine.update_weights_from_distributed, meta.names,
                                         [d.removeprefix("torch.") for d in meta.dtypes], meta.shapes,
                                         meta.group_name, abort_all_requests=True))


@router.post("/areal_update_weights", dependencies=ADMIN)
async def areal_update_weights(body: ArealDiskRequest, svc: EngineService = Svc):
    return _areal(await svc.update_from_disk(body.model_path, abort_all_requests=True))


class ArealLoraMetaRequest(P.Lenient):
    """AReaL's ``/areal_set_update_weight_meta_lora`` body (also sent again to
    ``/areal_update_weights_lora_xccl``; older AReaL sends ``{}`` there)."""

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "update_weight_group"
    lora_name: str = Field(min_length=1, max_length=256)  # "<name>-v<version>"
    lora_int_id: Optional[int] = None
    lora_target_modules: Any = None
    lora_rank: int = Field(ge=1)
    lora_alpha: float
    lora_bias: Optional[str] = "none"
    base_model_name: Optional[str] = None

    def peft_config(self) -> dict:
        """The adapter's peft config, from the fields AReaL sends."""
        return {"peft_type": "LORA", "r": self.lora_rank, "lora_alpha": self.lora_alpha,
                "target_modules": self.lora_target_modules, "bias": self.lora_bias or "none"}


class ArealLoraDiskRequest(P.Lenient):
    lora_model_path: str = Field(min_length=1)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: Optional[int] = None
    base_model_name: Optional[str] = None
    load_format: Optional[str] = "auto"
    abort_all_requests: bool = False


@router.post("/areal_set_update_weight_meta_lora", dependencies=ADMIN)
async def areal_set_update_weight_meta_lora(body: ArealLoraMetaRequest, svc: EngineService = Svc):
    """What the next ``/areal_update_weights_lora_xccl`` receives: the adapter's tensors (one broadcast
    each, in this order) and its name and config."""
    if not (len(body.names) == len(body.dtypes) == len(body.shapes)):
        raise HTTPException(400, "names, dtypes and shapes must have the same length")
    svc.areal_lora_meta = body
    return {"success": True, "message": f"LoRA metadata of {len(body.names)} tensors set for {body.lora_name!r}"}


@router.post("/areal_update_weights_lora_xccl", dependencies=ADMIN)
async def areal_update_weights_lora_xccl(body: Optional[dict[str, Any]] = Body(None), svc: EngineService = Svc):
    """Receives the adapter the metadata announced (the body, when AReaL sends it again, wins) and
    loads it as ``lora_name``: AReaL's ``<name>-v<version>`` replaces the name's older versions, which
    stay routable to it (``lora_versioned_names``). Running requests are not aborted: each finishes
    on the version it started with."""
    meta = svc.areal_lora_meta
    if body and body.get("names"):
        meta = ArealLoraMetaRequest.model_validate(body)  # a bad body: 400 naming the fields (the app's handler)
    if meta is None:
        raise HTTPException(400, "no LoRA metadata: call /areal_set_update_weight_meta_lora first")
    return _areal(await svc.call(svc.engine.load_lora_adapter_from_distributed, meta.lora_name, meta.peft_config(),
                                 meta.names, [d.removeprefix("torch.") for d in meta.dtypes], meta.shapes,
                                 meta.group_name))


@router.post("/areal_update_weights_lora", dependencies=ADMIN)
async def areal_update_weights_lora(body: ArealLoraDiskRequest, svc: EngineService = Svc):
    """A saved adapter folder (under ``--allowed-weight-dirs``) loaded as ``lora_name``."""
    if body.abort_all_requests:
        await svc.call(svc.engine.abort_request, None, True)
    try:
        result = await svc.call(svc.engine.load_lora_adapter, body.lora_name, body.lora_model_path, False,
                                svc.allowed_dirs)
    except FolderNotAllowed as exc:
        raise HTTPException(403, str(exc)) from None
    return _areal(result)
