"""miles' own route: the end of its bracket (``/begin_weight_update`` ... ``/end_weight_update``, the opener
``Opener.SGLANG`` shared with SGLang's ``/begin_weight_update`` route; the bucket calls in between stage into
it). Its other calls are SGLang's (``control_routes``, ``sglang_routes``)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from rollout.engine.lifecycle import Opener
from rollout.server.auth import admin
from rollout.server.service import EngineService, service_of

router = APIRouter()
ADMIN = [Depends(admin)]
Svc = Depends(service_of)


@router.post("/end_weight_update", dependencies=ADMIN)
async def end_weight_update(svc: EngineService = Svc):
    """Publish what the calls since ``/begin_weight_update`` staged, on every rank or none (refused, aborting
    nothing, when the open transaction is another protocol's)."""
    async with svc.in_order():
        return await svc.weight_update(svc.engine.commit_weight_update, partial=True, by=Opener.SGLANG)
