"""The engine's weight API (SGLang's names), mixed into ``RolloutEngine``.

Every update runs on the engine loop at a quiet point: by default it waits until the running
requests finish (new requests queue behind it); ``abort_all_requests=True`` aborts them first
(their partial outputs are returned); after ``pause_generation`` the pause is the quiet point
(``in_place`` keeps running requests and their KV, so their later tokens carry the new version).
The TP ranks vote; the new version is published, and the prefix cache re-keyed (and flushed when
asked), only after every rank has committed. A failed update returns ``success=False`` with the
reason and the engine keeps serving the old weights under the old version.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Union

from rollout.outputs import UpdateWeightsResult
from weight_sync.bucket import FlattenedTensorBucket
from weight_sync.cuda_ipc import CudaIpcBucket
from weight_sync.shm import SharedMemoryBucket

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class EngineWeightsMixin:
    # ------------------------------------------------------------------ routing

    def _worker_call(self, method: str, *args, reply_timeout_s: Optional[float] = None, **kwargs) -> Any:
        """Run a worker method on every TP rank of this engine (rank 0's result)."""
        from rollout.tp_group import TpWorkerGroup

        if isinstance(self.worker, TpWorkerGroup):
            return self.worker.call_all(method, *args, reply_timeout_s=reply_timeout_s, **kwargs)
        target = getattr(self.worker, "worker", self.worker)  # external leader wraps its worker
        return getattr(target, method)(*args, **kwargs)

    def _run_update(self, fn, abort_all_requests: bool) -> Any:
        """On the loop thread at a quiet point (or directly on an external follower)."""
        if self.is_follower:
            return fn()
        if abort_all_requests:
            self.abort_request(abort_all=True)
        return self._call(fn, quiet=True)

    def _commit(self, out: dict, weight_version: Optional[str], flush_cache: bool, t0: float,
                recapture_cuda_graph: bool = False) -> UpdateWeightsResult:
        sched = self.scheduler
        # per-phase seconds, bytes received in place
        self._last_update_detail = {k: v for k, v in out.items() if k.endswith(("_s", "_bytes"))}
        if out["success"]:
            sched.weights_epoch += 1  # prefix-cache keys change: no KV from older weights is ever matched
            if weight_version is not None:
                sched.weight_version = str(weight_version)
            if flush_cache:
                sched.block_manager.flush()
            runner = self.worker.model_runner
            if runner.graph_runner is not None and (recapture_cuda_graph or runner.graph_runner.needs_recapture()):
                runner.graph_runner.recapture()
        return UpdateWeightsResult(out["success"], out["message"], sched.weight_version, time.perf_counter() - t0,
                                   out.get("num_bytes", 0))

    # ------------------------------------------------------------------ updates

    def update_weights_from_tensor(self, named_tensors: Union[list, FlattenedTensorBucket, dict],
                                   load_format: Optional[str] = None, flush_cache: bool = True,
                                   weight_version: Optional[str] = None, abort_all_requests: bool = False,
                                   check_finite: bool = True, partial: bool = False,
                                   transaction: bool = False) -> Union[UpdateWeightsResult, dict]:
        """Load full tensors under Hugging Face names, all-or-nothing.

        named_tensors: a list of (name, tensor) (``load_format`` None or "direct"), a
        ``FlattenedTensorBucket`` ("flattened_bucket"), or a handle from another process on this
        machine: ``weight_sync.SharedMemoryBucket.write`` (CPU) or ``weight_sync.CudaIpcBucket.write``
        (GPU; the sender's buffer is exported once and mapped once, however many updates follow).
        Dtypes must equal the engine's; every weight must be present unless ``partial``.
        """
        t0 = time.perf_counter()
        kw = dict(strict_dtype=True, check_finite=check_finite, require_complete=not partial)
        if isinstance(named_tensors, FlattenedTensorBucket):
            named_tensors = named_tensors.named_tensors()
        if transaction:  # stage one bucket of an open transaction; returns {"success", "message"}
            if isinstance(named_tensors, dict):
                return self._staging_call("stage_from_handle", named_tensors)
            named = list(named_tensors)
            if self.config.tp_size > 1 and self._ext is None:
                return self._staging_call("stage_from_handle", self._write_bucket(named))
            return self._staging_call("stage_named_tensors", named, copy=False)
        if isinstance(named_tensors, dict):
            handle = named_tensors

            def fn():
                return self._commit(self._worker_call("update_weights_from_handle", handle, **kw), weight_version,
                                    flush_cache, t0)
        else:
            named = list(named_tensors)
            if load_format not in (None, "direct", "flattened_bucket"):
                raise ValueError(f"load_format={load_format!r}: use None/'direct', 'flattened_bucket' or pass a "
                                 "shared-memory handle")
            if self.config.tp_size > 1 and self._ext is None:
                # Spawned ranks live in other processes: hand them the tensors through shared memory
                # (CPU tensors) or CUDA IPC (GPU tensors).
                def fn():
                    return self._commit(self._worker_call("update_weights_from_handle", self._write_bucket(named),
                                                          **kw), weight_version, flush_cache, t0)
            else:
                def fn():
                    return self._commit(self._worker_call("apply_named_tensors", named, **kw), weight_version,
                                        flush_cache, t0)
        return self._run_update(fn, abort_all_requests)

    # ------------------------------------------------------------------ multi-call transactions

    def begin_weight_update(self, weight_version: Optional[str] = None) -> dict:
        """Open a transaction: the following ``update_weights_from_tensor(..., transaction=True)`` /
        ``update_weights_from_distributed(..., transaction=True)`` calls only stage (the engine keeps
        serving the old weights); ``commit_weight_update`` applies everything on every rank, or nothing."""
        self._txn_version = weight_version
        return self._staging_call("begin_transaction")

    def commit_weight_update(self, flush_cache: bool = True, check_finite: bool = True, partial: bool = False,
                             abort_all_requests: bool = False) -> UpdateWeightsResult:
        t0 = time.perf_counter()
        version = getattr(self, "_txn_version", None)

        def fn():
            return self._commit(self._worker_call("commit_transaction", check_finite, partial), version,
                                flush_cache, t0)
        return self._run_update(fn, abort_all_requests)

    def abort_weight_update(self) -> dict:
        return self._staging_call("abort_transaction")

    def _staging_call(self, method: str, *args, **kwargs) -> dict:
        """Staging touches no weight: it runs at the next step boundary, not at a quiet point."""
        if self.is_follower:
            return self._worker_call(method, *args, **kwargs)
        return self._call(lambda: self._worker_call(method, *args, **kwargs))

    def _write_bucket(self, named: list) -> dict:
        """Write tensors for the spawned ranks into this engine's own bucket (created once, reused by
        every update): shared memory for CPU tensors, CUDA IPC for GPU tensors."""
        named = [(n, t.detach()) for n, t in named]
        if named and named[0][1].is_cuda:
            if self._ipc is None:
                self._ipc = CudaIpcBucket(named[0][1].device)
            return self._ipc.write(named)
        if self._shm is None:
            self._shm = SharedMemoryBucket()
        return self._shm.write(named)

    def update_weights_from_disk(self, model_path: str, load_format: str = "auto", flush_cache: bool = True,
                                 weight_version: Optional[str] = None, recapture_cuda_graph: bool = False,
                                 abort_all_requests: bool = False, check_finite: bool = True) -> UpdateWeightsResult:
        """Load a Hugging Face safetensors folder (sharded or not), validated from its headers first."""
        if load_format not in ("auto", "safetensors"):
            raise ValueError(f"load_format={load_format!r}: only safetensors folders are loaded ('auto')")
        t0 = time.perf_counter()

        def fn():
            out = self._worker_call("update_weights_from_disk", str(model_path), check_finite=check_finite)
            return self._commit(out, weight_version, flush_cache, t0, recapture_cuda_graph)

        return self._run_update(fn, abort_all_requests)

    # ------------------------------------------------------------------ process-group updates

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: Optional[str] = None, timeout_s: float = 60.0) -> dict:
        """Join the trainer's weight-update group (engine TP rank r is rank ``rank_offset + r``).
        Fails with a clear message (naming the group) if nobody joins within ``timeout_s``."""
        def fn():
            return self._worker_call("init_weights_update_group", master_address, int(master_port), int(rank_offset),
                                     int(world_size), group_name, backend, timeout_s, reply_timeout_s=timeout_s + 5)
        return fn() if self.is_follower else self._call(fn)

    def destroy_weights_update_group(self, group_name: str) -> dict:
        def fn():
            return self._worker_call("destroy_weights_update_group", group_name)
        return fn() if self.is_follower else self._call(fn)

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list, group_name: str,
                                        flush_cache: bool = True, weight_version: Optional[str] = None,
                                        load_format: str = "flattened_bucket", bucket_bytes: Optional[int] = None,
                                        abort_all_requests: bool = False, check_finite: bool = True,
                                        partial: bool = False, transaction: bool = False):
        """Receive tensors broadcast by the trainer (``weight_sync.WeightUpdateSender.send`` with the same
        ``bucket_bytes``), staged until all arrived, then committed on every TP rank or on none."""
        from weight_sync.distributed import DEFAULT_BUCKET_BYTES

        t0 = time.perf_counter()
        kw = dict(load_format=load_format, check_finite=check_finite, partial=partial)
        if transaction:  # one bucket call of an open transaction: receive and stage only
            return self._staging_call("update_weights_from_distributed", list(names), list(dtypes),
                                      [list(s) for s in shapes], group_name, bucket_bytes or DEFAULT_BUCKET_BYTES,
                                      transaction=True, **kw)

        def fn():
            out = self._worker_call("update_weights_from_distributed", list(names), list(dtypes),
                                    [list(s) for s in shapes], group_name, bucket_bytes or DEFAULT_BUCKET_BYTES,
                                    reply_timeout_s=120, **kw)
            return self._commit(out, weight_version, flush_cache, t0)

        return self._run_update(fn, abort_all_requests)

    # ------------------------------------------------------------------ checks

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first ``truncate_size`` values of the full Hugging Face tensor ``name`` (gathered over TP)."""
        if self.is_follower:
            return self._worker_call("get_weights_by_name", name, truncate_size)
        return self._call(lambda: self._worker_call("get_weights_by_name", name, truncate_size))

    def get_weights_checksum(self) -> str:
        """sha256 of every weight in Hugging Face form; equals
        ``weight_sync.checksum_named_tensors(state_dict_items, dtype=engine dtype)`` on the trainer."""
        if self.is_follower:
            return self._worker_call("weights_checksum")
        return self._call(lambda: self._worker_call("weights_checksum"))

    def get_weight_version(self) -> str:
        return self.scheduler.weight_version

    def update_weight_version(self, weight_version: str) -> None:
        def fn():
            self.scheduler.weight_version = str(weight_version)
        self._call(fn)

    # ------------------------------------------------------------------ quiescence

    def pause_generation(self, mode: str = "abort") -> None:
        """abort: abort running requests; retract: send them back to the queue (KV dropped, recomputed
        later); in_place: keep them and their KV. New requests queue until ``continue_generation``."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode={mode!r}: use one of {PAUSE_MODES}")

        def fn():
            if mode == "abort":
                self.scheduler.abort(None)
            elif mode == "retract":
                self.scheduler.retract_all()
            self._paused = True
        self._call(fn)

    def continue_generation(self) -> None:
        def fn():
            self._paused = False
        self._call(fn)

    # ------------------------------------------------------------------ memory (colocated training)

    def release_memory_occupation(self, tags: Optional[list[str]] = None, backup_weights: bool = False) -> dict:
        """Free ``tags`` ⊆ {weights, kv_cache, cuda_graph} (None: all) at a quiet point. Released
        KV drops the prefix cache. ``backup_weights`` keeps a host copy that resume restores;
        without it, generation is refused until resume and a full weight update."""
        tags = self._check_tags(tags)

        def fn():
            if "kv_cache" in tags:
                self.scheduler.block_manager.flush()
            return self._worker_call("release_memory", tags, backup_weights)
        return self._run_update(fn, False)

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> dict:
        tags = self._check_tags(tags)
        return self._run_update(lambda: self._worker_call("resume_memory", tags), False)

    @staticmethod
    def _check_tags(tags) -> list[str]:
        tags = list(MEMORY_TAGS if tags is None else tags)
        bad = sorted(set(tags) - set(MEMORY_TAGS))
        if bad:
            raise ValueError(f"unknown memory tags {bad}; use a subset of {list(MEMORY_TAGS)}")
        return tags

    def _check_memory_ready(self) -> None:
        runner = self.worker.model_runner
        if runner.weights_released or runner.kv_released:
            released = [t for t, r in (("weights", runner.weights_released), ("kv_cache", runner.kv_released)) if r]
            raise RuntimeError(f"engine memory is released ({', '.join(released)}): call "
                               f"resume_memory_occupation() before generating")
        if not runner.weights_valid:
            raise RuntimeError("weights were released without a backup: push a full weight update "
                               "(update_weights_from_tensor/disk/distributed) before generating")
