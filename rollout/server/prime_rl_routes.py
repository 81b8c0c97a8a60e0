"""prime-rl's routes: ``/reload_weights`` (the weights the server started from, at a from-scratch start) and
``/update_weights {"weight_dir"}`` (a checkpoint folder read like ``/update_weights_from_disk``, under the
same allowed directories; the route itself is vLLM's, ``vllm_routes``, which hands that body here)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from rollout.server.auth import admin
from rollout.server.encoding import vllm_error as _error
from rollout.server.service import EngineService, service_of

router = APIRouter()
ADMIN = [Depends(admin)]
Svc = Depends(service_of)


async def update_from_weight_dir(weight_dir: str, svc: EngineService):
    """prime-rl's ``/update_weights {"weight_dir": path}``: the folder, all or nothing."""
    async with svc.in_order():
        result = await svc.update_from_disk(weight_dir)
    return {"status": "ok"} if result.success else _error(400, result.message)


@router.post("/reload_weights", dependencies=ADMIN)
async def reload_weights(svc: EngineService = Svc):
    """prime-rl's (older) reset at a from-scratch start: the weights the server started from, under its
    starting version label, the prefix cache reset (``RolloutEngine.reload_weights``; the body is ignored)."""
    async with svc.in_order():
        result = await svc.apply_update(svc.engine.reload_weights)
    return {"status": "ok", "weight_version": result.weight_version} if result.success else _error(400, result.message)
