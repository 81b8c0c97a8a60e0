"""SkyRL's weight-sync verbs over vLLM's ``/collective_rpc`` (``skyrl_start_weight_update``,
``update_weights_nccl``, ``skyrl_finish_weight_update``): each mapped onto vLLM's phased routes
(``vllm_routes``), so a SkyRL push is the lifecycle's ``Opener.VLLM`` sequence."""

from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter, Depends, HTTPException
from pydantic import Field

from rollout.server import protocol as P
from rollout.server.auth import admin
from rollout.server.encoding import JSONResponse
from rollout.server.service import EngineService, service_of
from rollout.server.vllm_routes import (
    FinishUpdateRequest,
    StartUpdateRequest,
    UpdateWeightsRequest,
    finish_weight_update,
    start_weight_update,
    update_weights,
)

router = APIRouter()
ADMIN = [Depends(admin)]
Svc = Depends(service_of)


class CollectiveRpcRequest(P.Lenient):
    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: Optional[float] = None


_RPC = ("skyrl_start_weight_update", "update_weights_nccl", "skyrl_finish_weight_update")


@router.post("/collective_rpc", dependencies=ADMIN)
async def collective_rpc(body: CollectiveRpcRequest, svc: EngineService = Svc):
    """SkyRL's weight-sync verbs over vLLM's ``/collective_rpc``, mapped onto the routes above; vLLM
    answers each worker's result (``{"results": [...]}``). Methods we do not run are refused."""
    kw = body.kwargs
    if body.method == "skyrl_start_weight_update":
        answer = await start_weight_update(StartUpdateRequest(**kw), svc)
    elif body.method == "update_weights_nccl":
        info = kw.get("update_info", body.args[0] if body.args else None)
        try:
            request = UpdateWeightsRequest(update_info=info)
        except ValueError as exc:
            raise HTTPException(400, f"update_weights_nccl: update_info: {exc}") from None
        answer = await update_weights(request, svc)
    elif body.method == "skyrl_finish_weight_update":
        answer = await finish_weight_update(FinishUpdateRequest(**kw), svc)
    else:
        raise HTTPException(400, f"collective_rpc method {body.method!r} is not run by this server (CUDA IPC and "
                                 f"worker extensions are vLLM's); supported: {', '.join(_RPC)}")
    if isinstance(answer, JSONResponse) and answer.status_code != 200:
        return answer
    return {"results": [None] * svc.engine.tp_size}
