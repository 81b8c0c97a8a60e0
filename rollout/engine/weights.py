"""``EngineWeights``: the engine's side of every weight operation, owned by ``RolloutEngine``.

The engine's public methods (SGLang's names) build a typed message (``rollout.worker.messages``) and hand
it here. This object decides *when* it runs on the engine loop — an update at a quiet point (by
default once the running requests finish; new requests queue behind it; ``abort_all_requests``
aborts them first; after ``pause_generation`` the pause is the quiet point), staging and reads at
the next step boundary — runs it on every TP rank through the worker, and publishes a committed
update to the scheduler (``Scheduler.publish_weights``: version, prefix-cache epoch, flush). A
failed update returns ``success=False`` with the reason; the old weights keep serving under the
old version.

Tensors reach spawned TP ranks (other processes) through this engine's own bucket: shared memory
for CPU tensors, CUDA IPC for GPU tensors, each created once and reused by every update.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional, Union

from rollout.engine.lifecycle import WeightUpdateLifecycle
from rollout.engine.loop import EngineLoop
from rollout.outputs import WeightResult
from rollout.scheduler.scheduler import Scheduler
from rollout.weights.safetensors_io import PinnedFolder, SafetensorsFolder
from rollout.worker.messages import (
    ApplyDelta,
    ApplyHandle,
    ApplyTensors,
    ReceiveDelta,
    ReleaseMemory,
    StageHandle,
    StageTensors,
)
from rollout.worker.tp_worker import BaseTpWorker
from weight_sync.cuda_ipc import CudaIpcBucket
from weight_sync.delta import PATCH_HEADER, WeightDelta
from weight_sync.shm import SharedMemoryBucket

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def check_memory_tags(tags) -> tuple[str, ...]:
    if isinstance(tags, str):
        tags = [tags]
    tags = tuple(MEMORY_TAGS if tags is None else tags)
    bad = sorted(set(tags) - set(MEMORY_TAGS))
    if bad:
        raise ValueError(f"unknown memory tags {bad}; use a subset of {list(MEMORY_TAGS)}")
    return tags


def read_patch(path: Union[str, os.PathLike, PinnedFolder], max_bytes: int = 64 << 20) -> WeightDelta:
    """A delta patch folder (``weight_sync.delta.save_patch``) read through its pinned descriptor, as checkpoint
    folders are (regular files of the folder itself, headers checked before any tensor is read):
    ``delta.json`` (the header, at most ``max_bytes``) and the tensors of its ``*.safetensors`` files."""
    folder = path if isinstance(path, PinnedFolder) else PinnedFolder.open(path)
    try:
        with SafetensorsFolder(folder) as files:
            header = files.read_json(PATCH_HEADER, max_bytes)
            if not isinstance(header, dict):
                raise ValueError(f"{PATCH_HEADER} must hold a JSON object")
            return WeightDelta.from_parts(header, [(n, t.read()) for n, t in files.tensors()])
    finally:
        if folder is not path:
            folder.close()


class EngineWeights:
    def __init__(self, worker: BaseTpWorker, scheduler: Scheduler, loop: EngineLoop, ranks_in_other_processes: bool,
                 stage_paused_updates: bool = True, transaction_timeout_s: Optional[float] = None):
        self.worker = worker
        self.scheduler = scheduler
        self.loop = loop
        self.ranks_in_other_processes = ranks_in_other_processes
        self.shm: Optional[SharedMemoryBucket] = None
        self.ipc: Optional[CudaIpcBucket] = None
        # the multi-call transactions: who opened the open one, its version, its idle timeout
        self.lifecycle = WeightUpdateLifecycle(self.run, lambda: loop.call(lambda: loop.paused), stage_paused_updates,
                                               transaction_timeout_s)

    # ------------------------------------------------------------------ running messages

    def run(self, msg, quiet: bool = False, publish: Optional[tuple[Optional[str], bool]] = None,
            before=None) -> WeightResult:
        """Run ``msg`` on every rank on the loop — at the next step boundary, or at a quiet point
        (``quiet``) — after ``before()`` if given; with ``publish=(version, flush_cache)`` a success is
        published to the scheduler. The result carries the version published then and the wall time."""
        t0 = time.perf_counter()

        def on_loop() -> WeightResult:
            if before is not None:
                before()
            result = self.worker.run_weight_op(msg)
            if publish is not None and result.success:
                self.scheduler.publish_weights(*publish)
            return result.published(self.scheduler.weight_version, time.perf_counter() - t0)

        return self.loop.call(on_loop, quiet=quiet)

    def stage(self, msg) -> WeightResult:
        """A staging message into the open transaction, at the next step boundary; its outcome recorded by the
        lifecycle (a failure marks the transaction failed)."""
        return self.lifecycle.staged(self.run(msg))

    def update(self, msg, weight_version: Optional[str] = None, flush_cache: bool = True,
               abort_all_requests: bool = False) -> WeightResult:
        """An update: at a quiet point, published only if every rank committed."""
        if abort_all_requests:
            self.loop.abort(None)
        return self.run(msg, quiet=True, publish=(weight_version, flush_cache))

    def update_delta(self, delta: WeightDelta, flush_cache: bool = True, abort_all_requests: bool = False) -> WeightResult:
        """A delta push (``weight_sync.delta``) at a quiet point, published as ``delta.version`` only if every
        rank's result matches the trainer's; refused (``WeightResult.BASE``, nothing touched) where the engine
        serves another version than the delta's base, or while a transaction is open."""
        named = delta.named_tensors()
        msg = ApplyDelta(delta.header(), handle=self.write_bucket(named)) if self.ranks_in_other_processes and named \
            else ApplyDelta(delta.header(), tuple(named))
        return self._delta(delta.base_version, delta.version, lambda refuse: None if refuse else msg, flush_cache,
                           abort_all_requests)

    def update_delta_distributed(self, header: dict, spec: tuple, flush_cache: bool = True,
                                 abort_all_requests: bool = False) -> WeightResult:
        """A delta whose tensors the trainer broadcasts over a weight-update group (``spec``: names, dtypes,
        shapes, group name, bucket bytes); a refused one is still received (the sender is broadcasting)."""
        base, version = header.get("base_version"), header.get("version")
        if not isinstance(base, str) or not isinstance(version, str):
            raise ValueError("a delta header needs base_version and version (strings)")
        return self._delta(base, version, lambda refuse: ReceiveDelta(header, *spec, refuse=refuse), flush_cache,
                           abort_all_requests)

    def _delta(self, base: str, version: str, make, flush_cache: bool, abort_all_requests: bool) -> WeightResult:
        """The delta message ``make(None)`` at a quiet point, published as ``version`` if every rank applied it;
        ``make(why)`` where it is refused (None: nothing to run, the refusal returned as it is)."""
        busy = self.lifecycle.current() is not None
        if busy:
            why = f"a delta applies on its own: {self.lifecycle.busy_message()}"
            msg = make(why)
            return WeightResult.fail(why) if msg is None else self.run(msg)
        if abort_all_requests:
            self.loop.abort(None)
        t0 = time.perf_counter()

        def on_loop() -> WeightResult:
            held = self.scheduler.weight_version
            refused = None if held == base else (f"the engine serves version {held!r}, the delta applies to "
                                                 f"{base!r}; nothing was written: push in full")
            msg = make(refused)
            if msg is None:
                result = WeightResult.fail(refused or "", kind=WeightResult.BASE, held_version=held)
            else:
                result = self.worker.run_weight_op(msg)
                if result.success:
                    self.scheduler.publish_weights(version, flush_cache)
                elif refused is not None:
                    result = dataclasses.replace(result, detail={**result.detail, "held_version": held})
            return result.published(self.scheduler.weight_version, time.perf_counter() - t0)

        return self.loop.call(on_loop, quiet=True)

    def release(self, tags: tuple[str, ...], backup_weights: bool) -> WeightResult:
        """Free memory at a quiet point; released KV takes the prefix cache with it. Requests paused
        in place would lose the KV they hold: they are retracted first (recomputed on continue)."""
        def drop_kv_users() -> None:
            self.scheduler.retract_all()
            self.scheduler.flush_cache()
            self.scheduler.sessions.drop_all_kv()  # sessions keep their history, recomputed next turn

        return self.run(ReleaseMemory(tags, backup_weights), quiet=True,
                        before=drop_kv_users if "kv_cache" in tags else None)

    # ------------------------------------------------------------------ tensors -> a message

    def tensors_message(self, named: list, check_finite: bool = True, partial: bool = False, stage: bool = False):
        """The message that carries (name, tensor) pairs to every rank: the tensors themselves when
        every rank lives in this process, else this engine's own bucket (written here, once)."""
        if not self.ranks_in_other_processes:
            return StageTensors(tuple(named)) if stage else ApplyTensors(tuple(named), check_finite, partial)
        handle = self.write_bucket(named)
        return StageHandle(handle) if stage else ApplyHandle(handle, check_finite, partial)

    def write_bucket(self, named: list) -> dict:
        """(name, tensor) pairs into this engine's own bucket (shared memory, or CUDA IPC for GPU
        tensors, created once and reused): the handle spawned ranks open."""
        named = [(n, t.detach()) for n, t in named]
        if named and named[0][1].is_cuda:
            if self.ipc is None:
                self.ipc = CudaIpcBucket(named[0][1].device)
            return self.ipc.write(named)
        if self.shm is None:
            self.shm = SharedMemoryBucket()
        return self.shm.write(named)

    def close(self) -> None:
        for bucket in (self.shm, self.ipc):
            if bucket is not None:
                bucket.close()
        self.shm = self.ipc = None
