"""CUDA-IPC buckets: weights between processes on one GPU machine without pickling or host copies.

The sender owns one ``CudaIpcBucket``: a device buffer allocated once (grown only when a bigger
update comes) and exported once; every ``write`` copies a flattened bucket into it (device to
device) and returns the same plain-JSON handle (hex IPC handles + metadata). A receiver maps a
buffer once per export and keeps the mapping while the sender keeps exporting the same buffer;
a new export (the sender grew its buffer) replaces the old mapping, so the number of open
mappings stays at one per sender however many updates arrive.

This is the GPU counterpart of ``weight_sync.shm`` (shared memory, CPU). Handles carry only
numbers and hex strings: nothing is unpickled.
"""

from __future__ import annotations

import threading
import uuid
import weakref
from typing import Optional

import torch

from weight_sync.layout import TensorMeta, layout, pack, views

KIND = "cuda_ipc"
_FIELDS = ("device", "handle", "size_bytes", "offset_bytes", "ref_counter_handle", "ref_counter_offset",
           "event_handle", "event_sync_required")
_local_exports: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # owner id -> bucket in this process


def _hex(value) -> Optional[str]:
    return value.hex() if isinstance(value, (bytes, bytearray)) else None


def _export(buffer: torch.Tensor) -> dict:
    """The IPC description of ``buffer``'s allocation (``_share_cuda_``: what torch's own CUDA
    tensor sharing sends), as JSON-able fields."""
    parts = dict(zip(_FIELDS, buffer.untyped_storage()._share_cuda_()))
    for key in ("handle", "ref_counter_handle", "event_handle"):
        parts[key] = _hex(parts[key])
    return {k: (v if isinstance(v, (str, type(None), bool)) else int(v)) for k, v in parts.items()}


class CudaIpcBucket:
    """Sender side: ``write(named_tensors) -> handle`` for ``engine.update_weights_from_tensor``."""

    def __init__(self, device: Optional[torch.device] = None, capacity_bytes: int = 0):
        device = torch.device("cuda" if device is None else device)
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.owner = uuid.uuid4().hex
        self.buffer: Optional[torch.Tensor] = None
        self.generation = 0
        self._ipc: Optional[dict] = None
        self.exports = 0  # how many times an IPC handle was created (once per buffer)
        _local_exports[self.owner] = self
        if capacity_bytes:
            self._ensure(capacity_bytes)

    def _ensure(self, nbytes: int) -> None:
        if self.buffer is not None and self.buffer.numel() >= nbytes:
            return
        self.buffer = None
        self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        self._ipc = _export(self.buffer)
        self.generation += 1
        self.exports += 1

    def write(self, named_tensors: list[tuple[str, torch.Tensor]]) -> dict:
        """Copy the tensors in (one device copy each), wait for the copies, return the handle."""
        metas, total = layout((n, t.dtype, tuple(t.shape)) for n, t in named_tensors)
        self._ensure(total)
        with torch.cuda.device(self.device):
            pack(self.buffer[:total], metas, named_tensors)
            torch.cuda.current_stream().synchronize()  # the receiver reads on its own stream
        return {"kind": KIND, "owner": self.owner, "generation": self.generation, "ipc": dict(self._ipc),
                "nbytes": total, "metadata": [m.to_dict() for m in metas]}

    def close(self) -> None:
        _local_exports.pop(self.owner, None)
        self.buffer, self._ipc = None, None


class _Mappings:
    """The receiver's open mappings: one per sender (owner), replaced when it re-exports."""

    def __init__(self):
        self.lock = threading.Lock()
        self.by_owner: dict[str, tuple[int, torch.UntypedStorage]] = {}

    def storage(self, handle: dict) -> torch.UntypedStorage:
        owner, generation = str(handle["owner"]), int(handle["generation"])
        with self.lock:
            cached = self.by_owner.get(owner)
            if cached is not None and cached[0] == generation:
                return cached[1]
            self.by_owner.pop(owner, None)  # the old mapping closes when its last view goes
            ipc = handle["ipc"]
            args = [int(ipc["device"]), bytes.fromhex(ipc["handle"]), int(ipc["size_bytes"]),
                    int(ipc["offset_bytes"]), bytes.fromhex(ipc["ref_counter_handle"]),
                    int(ipc["ref_counter_offset"]),
                    bytes.fromhex(ipc["event_handle"]) if ipc.get("event_handle") else None,
                    bool(ipc["event_sync_required"])]
            torch.cuda._lazy_init()
            storage = torch.UntypedStorage._new_shared_cuda(*args)
            self.by_owner[owner] = (generation, storage)
            return storage

    def __len__(self) -> int:
        return len(self.by_owner)


mappings = _Mappings()


class OpenedIpcBucket:
    """A receiver's (name, view) pairs over a sender's exported buffer. Synchronize the stream
    that copied out of it before answering the sender (it reuses the buffer); ``close()`` drops
    the views, the mapping stays open for the sender's next update."""

    def __init__(self, handle: dict):
        if not torch.cuda.is_available():
            raise ValueError("a CUDA-IPC handle needs CUDA in the receiving process; on CPU send a "
                             "weight_sync.SharedMemoryBucket handle")
        metas = [TensorMeta.from_dict(m) for m in handle["metadata"]]
        nbytes = int(handle["nbytes"])
        local = _local_exports.get(str(handle["owner"]))
        if local is not None:  # the exporting process itself cannot open its own IPC handle
            if local.generation != int(handle["generation"]) or local.buffer is None:
                raise ValueError("the CUDA-IPC handle is stale: the sender has re-exported its buffer")
            buffer = local.buffer
        else:
            storage = mappings.storage(handle)
            buffer = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),),
                                                                                    (1,))
        if nbytes > buffer.numel():
            raise ValueError(f"handle says {nbytes} bytes but the exported buffer holds {buffer.numel()}")
        self.named_tensors = views(buffer[:nbytes], metas)

    def close(self) -> None:
        self.named_tensors = []
