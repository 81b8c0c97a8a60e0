"""The weight routes (SGLang's names), the control routes (pause, continue, abort, flush, memory
release/resume) and the ops routes (health, model and server info, Prometheus metrics).

Weight and control routes need the admin key when one is set; ``update_weights_from_disk`` reads
only under ``allowed_weight_dirs``: the folder is opened once, checked where it lies, and read through
that descriptor (``EngineService.update_from_disk``); tensor handles come only from clients on this
host, as JSON or as the frameworks' pickled handles read by an allowlist that runs nothing
(``weight_sync.handles``)."""

from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import PlainTextResponse, Response

from rollout.engine.lifecycle import Opener
from rollout.server import protocol as P
from rollout.server.auth import admin, user
from rollout.server.encoding import JSONResponse
from rollout.server.service import EngineService, local_bucket_handle, result_json, service_of
from weight_sync import handles

router = APIRouter()
ADMIN = [Depends(admin)]
USER = [Depends(user)]
Svc = Depends(service_of)

# ------------------------------------------------------------------ weights


@router.post("/update_weights_from_disk", dependencies=ADMIN)
async def update_weights_from_disk(body: P.UpdateFromDiskRequest, svc: EngineService = Svc):
    return result_json(await svc.update_from_disk(body.model_path, load_format=body.load_format,
                                                  flush_cache=body.flush_cache, weight_version=body.weight_version,
                                                  recapture_cuda_graph=body.recapture_cuda_graph,
                                                  abort_all_requests=body.abort_all_requests))


@router.post("/update_weights_from_delta", dependencies=ADMIN)
async def update_weights_from_delta(body: P.UpdateFromDeltaRequest, svc: EngineService = Svc):
    """A delta patch folder (``weight_sync.delta``): pinned, checked under ``--allowed-weight-dirs`` (403
    outside), applied all or nothing against the base it names (``error_kind: "base"`` where the engine holds
    another: push in full)."""
    return result_json(await svc.update_from_delta(body.path, flush_cache=body.flush_cache,
                                                   abort_all_requests=body.abort_all_requests))


@router.post("/update_weights_from_delta_distributed", dependencies=ADMIN)
async def update_weights_from_delta_distributed(body: P.UpdateFromDeltaDistributedRequest, svc: EngineService = Svc):
    """A delta whose tensors the trainer broadcasts over the weight-update group; applied all or nothing against
    the base its header names (``error_kind: "base"`` where the engine holds another: push in full)."""
    return await svc.weight_update(svc.engine.update_weights_from_delta_distributed, body.header,
                                   body.names, body.dtypes, body.shapes, body.group_name,
                                   bucket_bytes=body.bucket_bytes, flush_cache=body.flush_cache,
                                   abort_all_requests=body.abort_all_requests)


@router.post("/update_weights_from_tensor", dependencies=ADMIN)
async def update_weights_from_tensor(body: P.UpdateFromTensorRequest, request: Request, svc: EngineService = Svc):
    """A same-host bucket handle (JSON), or SGLang's form: base64 of the frameworks' pickled tensor handles
    (slime's and miles' flattened buckets, veRL's per-rank tensors), one per TP rank, read by an allowlist
    that runs nothing (``weight_sync.handles``) and loaded as SGLang loads them: the tensors given, this
    bucket all or nothing (staged while paused or inside a bracket, copied then)."""
    handle = local_bucket_handle(request, body.serialized_named_tensors, "serialized_named_tensors")
    if not isinstance(handle, str):
        async with svc.in_order():
            return await svc.weight_update(svc.engine.update_weights_from_tensor, handle, load_format=None,
                                           flush_cache=body.flush_cache, weight_version=body.weight_version,
                                           abort_all_requests=body.abort_all_requests, partial=body.partial,
                                           transaction=await _staged(body, svc))
    if not svc.config.tensor_handles:
        raise HTTPException(400, P.PICKLED_TENSORS)
    try:  # every TP rank opens it and reads its own entry
        pickled = handles.handle(body.serialized_named_tensors)
    except handles.HandleError as exc:
        raise HTTPException(400, f"serialized_named_tensors: {exc}") from None
    async with svc.in_order():
        return await svc.weight_update(svc.engine.update_weights_from_tensor, pickled, load_format=None,
                                       flush_cache=body.flush_cache, weight_version=body.weight_version,
                                       abort_all_requests=body.abort_all_requests, partial=True,
                                       transaction=await _staged(body, svc))




async def _staged(body, svc: EngineService) -> bool:
    """Over HTTP a call stages into an open ``/begin_weight_update`` transaction even without
    ``transaction: true``: miles sends its bucket calls plain inside its bracket. One another protocol
    opened and left is aborted first (``EngineService.stages_for``)."""
    return await svc.stages_for(Opener.SGLANG) or body.transaction


@router.post("/init_weights_update_group", dependencies=ADMIN)
async def init_weights_update_group(body: P.InitGroupRequest, svc: EngineService = Svc):
    return result_json(await svc.call(svc.engine.init_weights_update_group, body.master_address, body.master_port,
                                      body.rank_offset, body.world_size, body.group_name, body.backend,
                                      body.timeout_s))


@router.post("/update_weights_from_distributed", dependencies=ADMIN)
async def update_weights_from_distributed(body: P.UpdateFromDistributedRequest, svc: EngineService = Svc):
    async with svc.in_order():
        return await svc.weight_update(svc.engine.update_weights_from_distributed, body.names, body.dtypes,
                                       body.shapes, body.group_name, flush_cache=body.flush_cache,
                                       weight_version=body.weight_version, load_format=body.load_format,
                                       bucket_bytes=body.bucket_bytes, abort_all_requests=body.abort_all_requests,
                                       partial=body.partial, transaction=await _staged(body, svc),
                                       point_to_point=body.point_to_point)


@router.post("/destroy_weights_update_group", dependencies=ADMIN)
async def destroy_weights_update_group(body: Optional[P.GroupNameRequest] = None, svc: EngineService = Svc):
    """SGLang's; no body (legacy SkyRL's teardown): the default group."""
    body = body or P.GroupNameRequest()
    return result_json(await svc.call(svc.engine.destroy_weights_update_group, body.group_name))


@router.post("/begin_weight_update", dependencies=ADMIN)
async def begin_weight_update(body: P.BeginUpdateRequest, svc: EngineService = Svc):
    async with svc.in_order():
        return result_json(await svc.call(svc.engine.begin_weight_update, body.weight_version, Opener.SGLANG))


@router.post("/commit_weight_update", dependencies=ADMIN)
async def commit_weight_update(body: P.CommitUpdateRequest, svc: EngineService = Svc):
    async with svc.in_order():
        return await svc.weight_update(svc.engine.commit_weight_update, flush_cache=body.flush_cache,
                                       partial=body.partial, abort_all_requests=body.abort_all_requests,
                                       by=Opener.SGLANG)


@router.post("/abort_weight_update", dependencies=ADMIN)
async def abort_weight_update(svc: EngineService = Svc):
    async with svc.in_order():
        return result_json(await svc.call(svc.engine.abort_weight_update))


@router.post("/get_weights_by_name", dependencies=ADMIN)
async def get_weights_by_name(body: P.GetWeightsRequest, svc: EngineService = Svc):
    return await svc.call(svc.engine.get_weights_by_name, body.name, body.truncate_size)


@router.post("/weights_checker", dependencies=ADMIN)
async def weights_checker(body: P.WeightsCheckerRequest, svc: EngineService = Svc):
    """SGLang's weight check (slime's and miles' check mode): ``snapshot`` keeps a checksum of every
    weight, ``compare`` answers whether the weights equal the snapshot (400 if not), ``checksum``
    returns it. ``reset_tensors`` (overwrite the served weights with noise) is refused: a push is
    verified by comparing against a snapshot taken of the weights it should deliver."""
    if body.action == "reset_tensors":
        raise HTTPException(400, "reset_tensors is not run by this server (it would serve noise until the next "
                                 "update): compare against a snapshot of the weights the push should deliver, or "
                                 "against weight_sync.checksum_named_tensors on the trainer")
    checksum = await svc.call(svc.engine.get_weights_checksum)
    if body.action == "snapshot":
        svc.weights_snapshot = checksum
        return {"success": True, "message": "snapshot taken", "checksum": checksum}
    if body.action == "checksum":
        return {"success": True, "message": "checksum", "checksum": checksum}
    if svc.weights_snapshot is None:
        raise HTTPException(400, "no snapshot: call /weights_checker {\"action\": \"snapshot\"} first")
    same = checksum == svc.weights_snapshot
    return JSONResponse({"success": same, "message": "the weights equal the snapshot" if same else
                         "the weights differ from the snapshot", "checksum": checksum,
                         "snapshot": svc.weights_snapshot}, status_code=200 if same else 400)


@router.api_route("/get_weight_version", methods=["GET", "POST"], dependencies=USER)
async def get_weight_version(svc: EngineService = Svc):
    return {"weight_version": svc.engine.get_weight_version()}


@router.post("/update_weight_version", dependencies=ADMIN)
async def update_weight_version(body: P.VersionRequest, svc: EngineService = Svc):
    if body.abort_all_requests:
        await svc.call(svc.engine.abort_request, None, True)
    await svc.call(svc.engine.update_weight_version, body.new_version)
    return {"success": True, "message": "version updated", "new_version": body.new_version,
            "weight_version": svc.engine.get_weight_version()}


# ------------------------------------------------------------------ control


@router.api_route("/flush_cache", methods=["GET", "POST"], dependencies=ADMIN)
async def flush_cache(svc: EngineService = Svc):
    """SGLang's: plain text, 200 once flushed, 400 while requests run or wait (clients poll it)."""
    if await svc.call(svc.engine.flush_cache, only_when_idle=True):
        return PlainTextResponse("Cache flushed.\n")
    return PlainTextResponse("Cache not flushed: requests are running or waiting (SGLang answers the same 400; "
                             "poll until 200, or pause generation first).\n", status_code=400)


@router.post("/pause_generation", dependencies=ADMIN)
async def pause_generation(body: P.PauseRequest, svc: EngineService = Svc):
    await svc.call(svc.engine.pause_generation, body.mode)
    return {"success": True, "message": f"generation paused ({body.mode})"}


@router.post("/continue_generation", dependencies=ADMIN)
async def continue_generation(svc: EngineService = Svc):
    """Resumes generation; update calls staged while paused are published first (a failed publish
    answers 400 with the reason: generation continues on the old weights)."""
    result = await svc.resume()
    if result is not None:
        if not result.success:
            return JSONResponse({"success": False, "message": f"generation continues on the old weights: "
                                 f"{result.message}"}, status_code=400)
    return {"success": True, "message": "generation continues",
            **({"weight_version": result.weight_version} if result is not None else {})}


@router.post("/abort_request", dependencies=ADMIN)
async def abort_request(body: P.AbortRequest, svc: EngineService = Svc):
    """SGLang's: 200 with an empty body; ``rid`` "" (or none) without ``abort_all`` aborts nothing."""
    if body.abort_all or body.rid:
        await svc.call(svc.engine.abort_request, body.rid, body.abort_all, body.prefix)
    return Response(status_code=200)


@router.post("/release_memory_occupation", dependencies=ADMIN)
async def release_memory_occupation(body: P.ReleaseRequest, svc: EngineService = Svc):
    return result_json(await svc.call(svc.engine.release_memory_occupation, body.tags, body.backup_weights))


@router.post("/resume_memory_occupation", dependencies=ADMIN)
async def resume_memory_occupation(body: P.MemoryRequest, svc: EngineService = Svc):
    return result_json(await svc.call(svc.engine.resume_memory_occupation, body.tags))


# ------------------------------------------------------------------ ops


@router.get("/health")
async def health(svc: EngineService = Svc):
    if not svc.engine.health():  # the engine loop died: nothing will be generated
        raise HTTPException(503, "the engine loop is not running")
    return {"status": "ok"}


@router.get("/get_model_info", dependencies=USER)
@router.get("/model_info", dependencies=USER)  # SGLang's newer name (miles reads it)
async def get_model_info(svc: EngineService = Svc):
    return svc.model_info()


@router.get("/get_server_info", dependencies=USER)
@router.get("/server_info", dependencies=USER)  # SGLang's newer name (slime tries it first)
async def get_server_info(svc: EngineService = Svc):
    return await svc.server_info()


@router.get("/v1/loads", dependencies=USER)
async def loads(svc: EngineService = Svc):
    """SGLang's load report (``?include=core`` accepted): running and waiting requests."""
    return await svc.loads()


@router.get("/get_load", dependencies=USER)
async def get_load(svc: EngineService = Svc):
    return await svc.get_load()


@router.get("/metrics", dependencies=USER)
async def prometheus_metrics(svc: EngineService = Svc):
    body, content_type = await svc.read(svc.metrics.render)
    return Response(body, media_type=content_type)


@router.get("/", response_class=PlainTextResponse, dependencies=USER)
async def root():
    return "rollout-worker server: see /docs for the routes\n"
