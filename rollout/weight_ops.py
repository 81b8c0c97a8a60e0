"""Weight operations on one TP rank (the runner does the tensor work; the worker routes).

Every update is all-or-nothing across the TP group: each rank validates its part (names,
shapes, dtypes, finiteness, coverage) without touching the model, then all ranks vote (a sum
all-reduce of failures on the TP group); only a unanimous vote changes the weights (an in-place
copy, or the shadow the update was written into becomes live). A rejected update leaves every
rank's weights exactly as they were.

Memory cost per path: in-process tensors, shared-memory and CUDA-IPC buckets are validated where
they lie and copied once (no staging); safetensors files are checked from their headers, then streamed a
tensor at a time (the finite check reads each tensor once more); the distributed path writes each
bucket into a shadow of this rank's weights (one copy of its shard, kept between updates) plus two
bucket-sized receive buffers, because a sender can die midway; a multi-call transaction stages
what it receives until commit.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from collections.abc import Iterable

import torch

from rollout.layers.linear import copy_slices
from rollout.loader import (
    WeightLoadError,
    apply_load,
    iter_safetensors,
    nonfinite_names,
    plan_load,
    rejection_message,
    safetensors_files,
    weight_name_map,
)
from weight_sync.bucket import ALIGN, dtype_from_name
from weight_sync.checksum import checksum_named_tensors
from weight_sync.distributed import WeightGroupError, broadcast, make_group, one_cpu_thread, receive_buckets
from weight_sync.shm import open_bucket

_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def validate_safetensors_file(path: str) -> None:
    """Check a file's header, offsets and size before any byte of it is trusted."""
    size = os.path.getsize(path)
    name = os.path.basename(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightLoadError(f"{name}: truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            raise WeightLoadError(f"{name}: header length {n} exceeds the file ({size} bytes): corrupt or truncated")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise WeightLoadError(f"{name}: header is not valid JSON ({exc})") from None
    data_len = size - 8 - n
    spans = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise WeightLoadError(f"{name}: header entry {key!r} is malformed") from None
        if dtype not in _ST_ITEMSIZE:
            raise WeightLoadError(f"{name}: {key} has unsupported dtype {dtype}")
        numel = 1
        for s in shape:
            numel *= s
        if not (0 <= begin <= end <= data_len) or end - begin != numel * _ST_ITEMSIZE[dtype]:
            raise WeightLoadError(f"{name}: {key} has bad offsets [{begin}, {end}) for shape {shape} {dtype} "
                                  f"in {data_len} data bytes (corrupt or truncated file)")
        spans.append((begin, end))
    spans.sort()
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        raise WeightLoadError(f"{name}: tensors overlap in the data region")
    if spans and spans[-1][1] != data_len:
        raise WeightLoadError(f"{name}: {data_len - spans[-1][1]} unexpected bytes after the last tensor")


def _with_bucket(handle: dict, device: torch.device, use, on_error) -> dict:
    """Open a sender's bucket (shared memory or CUDA IPC), hand its (name, view) pairs to
    ``use``, wait for the copies out of it (the sender reuses the buffer), close it."""
    if not isinstance(handle, dict):
        return on_error(f"a bucket handle is a dict, got {type(handle).__name__}")
    try:
        opened = open_bucket(handle)
    except (ValueError, KeyError, TypeError, OSError, RuntimeError) as exc:
        return on_error(f"cannot read the {handle.get('kind', 'shared_memory')} bucket: {exc}")
    try:
        out = use(opened.named_tensors)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out
    finally:
        opened.close()


class WeightOpsMixin:
    """Mixed into ``TpModelWorker``: needs ``model_runner``, ``tp_state`` and ``device``."""

    def _vote(self, ok: bool) -> bool:
        """True only if every TP rank is ok (every rank must call this, in the same order)."""
        if self.tp_state.tp_size == 1:
            return ok
        failures = torch.tensor([0.0 if ok else 1.0], device=self.device)
        self.tp_state.comm.all_reduce(failures)
        return float(failures.item()) == 0.0

    def apply_named_tensors(self, named_tensors: Iterable, *, strict_dtype: bool = True, check_finite: bool = True,
                            require_complete: bool = True) -> dict:
        error = None
        try:
            plan = plan_load(self.model_runner.model, named_tensors, strict_dtype=strict_dtype,
                             check_finite=check_finite, require_complete=require_complete)
        except (WeightLoadError, OSError, RuntimeError, ValueError) as exc:
            plan, error = None, str(exc)
        if not self._vote(error is None):
            return {"success": False, "message": error or "another TP rank rejected the update; nothing was loaded",
                    "num_bytes": 0}
        report = apply_load(plan)
        if require_complete:
            self.model_runner.weights_valid = True
        return {"success": True, "message": f"loaded {report.num_tensors} tensors", "num_bytes": report.num_bytes}

    # ------------------------------------------------------------------ multi-call transactions

    def begin_transaction(self) -> dict:
        """Start staging an update that arrives in several calls; the model changes only at commit."""
        self._txn: dict = {}
        self._txn_error: str | None = None
        return {"success": True, "message": "transaction started"}

    def _stage(self, named_tensors, copy: bool) -> dict:
        txn = self.__dict__.get("_txn")
        if txn is None:
            return {"success": False, "message": "no open transaction: call begin_weight_update first"}
        named = list(named_tensors)
        try:  # names, shapes and dtypes fail early; finiteness and coverage are checked at commit
            plan_load(self.model_runner.model, named, strict_dtype=True, require_complete=False)
            dup = sorted(set(n for n, _ in named) & set(txn))
            if dup:
                raise WeightLoadError(f"weights given twice in one transaction: {', '.join(dup[:8])}")
        except (WeightLoadError, ValueError) as exc:
            self._txn_error = self._txn_error or str(exc)
            return {"success": False, "message": str(exc)}
        for name, t in named:
            txn[name] = t.to(self.device, copy=True) if copy else t
        return {"success": True, "message": f"staged {len(named)} tensors ({len(txn)} in the transaction)"}

    def stage_named_tensors(self, named_tensors, copy: bool = False) -> dict:
        return self._stage(named_tensors, copy)

    def stage_from_handle(self, handle: dict) -> dict:
        def on_error(message: str) -> dict:
            self._txn_error = self.__dict__.get("_txn_error") or message
            return {"success": False, "message": message}

        # the sender reuses its buffer for the next bucket: stage a copy
        return _with_bucket(handle, self.device, lambda named: self._stage(named, copy=True), on_error)

    def commit_transaction(self, check_finite: bool = True, partial: bool = False) -> dict:
        txn, error = self.__dict__.pop("_txn", None), self.__dict__.pop("_txn_error", None)
        if txn is None or error is not None:
            self._vote(False)
            why = error or "no open transaction: call begin_weight_update first"
            return {"success": False, "message": f"transaction discarded: {why}", "num_bytes": 0}
        return self.apply_named_tensors(list(txn.items()), strict_dtype=True, check_finite=check_finite,
                                        require_complete=not partial)

    def abort_transaction(self) -> dict:
        self.__dict__.pop("_txn", None)
        self.__dict__.pop("_txn_error", None)
        return {"success": True, "message": "transaction discarded"}

    def update_weights_from_handle(self, handle: dict, **kwargs) -> dict:
        def on_error(message: str) -> dict:
            self._vote(False)  # the other ranks still vote: they must learn this rank failed
            return {"success": False, "message": message, "num_bytes": 0}

        return _with_bucket(handle, self.device, lambda named: self.apply_named_tensors(named, **kwargs), on_error)

    def update_weights_from_disk(self, model_path: str, check_finite: bool = True) -> dict:
        try:
            for path in safetensors_files(model_path):
                validate_safetensors_file(path)
            named = list(iter_safetensors(model_path))
        except (WeightLoadError, OSError, ValueError) as exc:
            self._vote(False)
            return {"success": False, "message": str(exc), "num_bytes": 0}
        # Checkpoints may be saved in another precision: cast on copy, like the initial load.
        return self.apply_named_tensors(named, strict_dtype=False, check_finite=check_finite)

    def release_memory(self, tags: list[str], backup_weights: bool = False) -> dict:
        if "weights" in tags:
            self.__dict__.pop("_receive_pool", None)  # the distributed path's receive buffers go too
        return self.model_runner.release_memory(tags, backup_weights)

    def resume_memory(self, tags: list[str]) -> dict:
        return self.model_runner.resume_memory(tags)

    # ------------------------------------------------------------------ weight-update groups

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str | None = None, timeout_s: float = 60.0) -> dict:
        groups = self.__dict__.setdefault("_update_groups", {})
        if group_name in groups:
            return {"success": False, "message": f"weight update group {group_name!r} already exists; destroy it first"}
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        rank = rank_offset + self.tp_rank
        try:
            groups[group_name] = make_group(master_address, master_port, rank, world_size, backend, timeout_s,
                                            group_name)
        except WeightGroupError as exc:
            return {"success": False, "message": str(exc)}
        return {"success": True, "message": f"joined weight update group {group_name!r} as rank {rank}/{world_size}"}

    def destroy_weights_update_group(self, group_name: str) -> dict:
        groups = self.__dict__.setdefault("_update_groups", {})
        if groups.pop(group_name, None) is None:
            return {"success": False, "message": f"no weight update group {group_name!r}"}
        return {"success": True, "message": f"destroyed weight update group {group_name!r}"}

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list, group_name: str,
                                        bucket_bytes: int, load_format: str = "flattened_bucket",
                                        check_finite: bool = True, partial: bool = False,
                                        transaction: bool = False) -> dict:
        """Receive the sender's buckets (a sender can die midway, so nothing live is touched until
        every rank has everything): names, shapes, dtypes and coverage are validated before the
        first byte; each bucket is written into the shadow weights as it lands, while the next is
        on the wire; a unanimous vote makes the shadow live. A bucket call of a multi-call
        transaction stages its buckets instead."""
        groups = self.__dict__.setdefault("_update_groups", {})
        runner = self.model_runner
        t_start = time.perf_counter()
        error, specs = None, []
        if group_name not in groups:
            error = f"no weight update group {group_name!r}: call init_weights_update_group first"
        elif not (len(names) == len(dtypes) == len(shapes)):
            error = "names, dtypes and shapes must have the same length"
        else:
            try:
                specs = [(n, dtype_from_name(d) if isinstance(d, str) else d, tuple(int(x) for x in s))
                         for n, d, s in zip(names, dtypes, shapes)]
            except (ValueError, TypeError) as exc:
                error = str(exc)
        bucket_bytes = 1 if load_format == "direct" else bucket_bytes
        if transaction:  # a bucket call of a multi-call transaction: receive and stage only
            staged = []
            if error is None:
                try:
                    staged = receive_buckets(groups[group_name], specs, bucket_bytes, self.device, group_name)
                except WeightGroupError as exc:
                    groups.pop(group_name, None)
                    error = f"{exc}; the group was torn down, re-initialise it"
            if error is not None:
                self._txn_error = self.__dict__.get("_txn_error") or error
                return {"success": False, "message": error}
            return self._stage(staged, copy=False)
        if error is None:
            error = self._receive_into_shadow(groups, group_name, specs, bucket_bytes, check_finite, partial)
        t_received = time.perf_counter()
        if not self._vote(error is None):
            return {"success": False, "message": error or "another TP rank rejected the update; nothing was loaded",
                    "num_bytes": 0}
        runner.commit_shadow()
        if not partial:
            runner.weights_valid = True
        nbytes = sum(d.itemsize * math.prod(s) for _, d, s in specs)
        return {"success": True, "message": f"loaded {len(specs)} tensors", "num_bytes": nbytes,
                "receive_s": t_received - t_start, "commit_s": time.perf_counter() - t_received,
                "received_in_place_bytes": self._placed_bytes}

    def _receive_into_shadow(self, groups, group_name, specs, bucket_bytes, check_finite, partial) -> str | None:
        """Receive every bucket; write it into the shadow weights unless the update is already
        rejected (then it is only drained, so the sender still completes). Returns the error."""
        runner = self.model_runner
        rejected = None
        if runner.weights_released:
            rejected = "the weights are released: call resume_memory_occupation(['weights']) before updating"
        else:
            try:
                plan_load(runner.model, [(n, torch.empty(s, dtype=d, device="meta")) for n, d, s in specs],
                          strict_dtype=True, require_complete=not partial)
            except WeightLoadError as exc:
                rejected = str(exc)
        if rejected is None and partial:
            runner.prepare_shadow()
        name_map = weight_name_map(runner.model)
        nonfinite: list[str] = []
        self._placed_bytes = 0

        def place(metas, total):
            """The shadow's bytes for this bucket when its tensors lie there exactly as the bucket
            lays them out (whole tensors, same order, no padding): received in place."""
            if rejected is not None:
                return None
            dst0 = name_map[metas[0].name].slice.dst
            for m in metas:
                sl = name_map[m.name].slice
                if sl.dim is not None or sl.zero_tail is not None or m.nbytes % ALIGN or sl.dst.dtype != dst0.dtype \
                        or not sl.dst.is_contiguous() \
                        or (sl.dst.storage_offset() - dst0.storage_offset()) * dst0.element_size() != m.offset:
                    return None
            return runner.shadow_bytes(dst0, total)

        def write_bucket(named, placed: bool):
            if rejected is not None:
                return
            if check_finite:
                nonfinite.extend(nonfinite_names(named))
            if placed:
                self._placed_bytes += sum(v.numel() * v.element_size() for _, v in named)
                return
            with one_cpu_thread(self.device):  # the transfer's own threads keep the cores busy
                copy_slices([(view, name_map[name].slice) for name, view in named], where=runner.shadow_view)

        try:
            receive_buckets(groups[group_name], specs, bucket_bytes, self.device, group_name, write_bucket,
                            pool=self.__dict__.setdefault("_receive_pool", []), place=place)
        except WeightGroupError as exc:
            groups.pop(group_name, None)  # tear down only this group; re-initialising it works
            return f"{exc}; the group was torn down, re-initialise it"
        if rejected is None and nonfinite:
            rejected = rejection_message([f"{n}: contains NaN or Inf values" for n in nonfinite])
        return rejected

    def probe_weights_update_group(self, group_name: str, nbytes: int) -> float:
        """Seconds to receive one bare broadcast of ``nbytes`` (the raw transport, for benchmarks)."""
        buf = self.__dict__.get("_probe_buf")
        if buf is None or buf.numel() != nbytes:  # reused, like the update's receive buffers
            self._probe_buf = buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        t0 = time.perf_counter()
        broadcast(self.__dict__["_update_groups"][group_name], buf)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ reading weights back

    def get_full_weight(self, name: str) -> torch.Tensor:
        """The full Hugging Face tensor ``name`` (collective over the TP group)."""
        target = weight_name_map(self.model_runner.model).get(name)
        if target is None:
            raise KeyError(f"unknown weight name {name!r}")
        param = target.param
        local = param.local_part(param, target.shard_id) if hasattr(param, "local_part") else param.data
        if self.tp_state.tp_size == 1:
            parts = [local]
        else:
            parts = self.tp_state.comm.all_gather(local.contiguous(), self.tp_state.tp_size)
        full = param.full_from_parts(parts, target.shard_id) if hasattr(param, "full_from_parts") else parts[0]
        return full.detach().clone()

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self.get_full_weight(name).flatten()[:truncate_size].float().cpu().tolist()

    def weights_checksum(self) -> str:
        names = sorted(n for n in weight_name_map(self.model_runner.model)
                       if not (n == "lm_head.weight" and self.model_config.tie_word_embeddings))
        return checksum_named_tensors((n, self.get_full_weight(n)) for n in names)
