"""Shared-memory buckets: weights between processes on one machine (CPU) without pickling.

The sender owns one ``SharedMemoryBucket`` (created once, reused for every update, grown only
when a bigger update comes) and writes a flattened bucket into it; the handle it passes on is
plain JSON (segment name + metadata). The receiver maps the segment and reads zero-copy views.
"""

from __future__ import annotations

import contextlib
import uuid
from multiprocessing import resource_tracker, shared_memory
from typing import Optional

import torch

from weight_sync import cuda_ipc, handles
from weight_sync.layout import TensorMeta, layout, pack, views

KIND = "shared_memory"


class SharedMemoryBucket:
    def __init__(self, capacity_bytes: int = 0, prefix: str = "rollout-weights"):
        self.prefix = prefix
        self.shm: Optional[shared_memory.SharedMemory] = None
        self.buffer: Optional[torch.Tensor] = None
        if capacity_bytes:
            self._ensure(capacity_bytes)

    def _ensure(self, nbytes: int) -> None:
        if self.shm is not None and self.shm.size >= nbytes:
            return
        self.close()
        self.shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1),
                                              name=f"{self.prefix}-{uuid.uuid4().hex[:12]}")
        self.buffer = torch.frombuffer(self.shm.buf, dtype=torch.uint8)

    def write(self, named_tensors: list[tuple[str, torch.Tensor]]) -> dict:
        """Copy the tensors in (one copy each) and return the JSON-able handle for the receiver."""
        metas, total = layout((n, t.dtype, tuple(t.shape)) for n, t in named_tensors)
        self._ensure(total)
        pack(self.buffer[:total], metas, named_tensors)
        return {"kind": KIND, "shm_name": self.shm.name, "nbytes": total, "metadata": [m.to_dict() for m in metas]}

    def close(self) -> None:
        if self.shm is not None:
            self.buffer = None
            self.shm.close()
            self.shm.unlink()
            self.shm = None

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter teardown: best effort only
            self.close()


class OpenedBucket:
    """A receiver's mapping of a sender's segment; ``close()`` after the views are dropped."""

    def __init__(self, handle: dict):
        self.shm = _attach(str(handle["shm_name"]))
        metas = [TensorMeta.from_dict(m) for m in handle["metadata"]]
        nbytes = int(handle.get("nbytes", self.shm.size))
        if nbytes > self.shm.size:
            raise ValueError(f"handle says {nbytes} bytes but the segment holds {self.shm.size}")
        buffer = torch.frombuffer(self.shm.buf, dtype=torch.uint8)[:nbytes]
        self.named_tensors = views(buffer, metas)

    def close(self) -> None:
        self.named_tensors = []  # views must be gone before the mapping can close
        try:
            self.shm.close()
        except BufferError:  # a view still referenced from a cycle
            import gc

            gc.collect()
            self.shm.close()


def _attach(name: str) -> shared_memory.SharedMemory:
    """Map an existing segment without registering it with this process's resource tracker: the
    sender owns it, and the tracker would otherwise unlink it when this process exits."""
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        raise ValueError(f"shared-memory segment {name!r} does not exist") from None
    finally:
        resource_tracker.register = register


def open_shared_bucket(handle: dict) -> OpenedBucket:
    return OpenedBucket(handle)


def open_bucket(handle: dict, tp_rank: int = 0):
    """Open a sender's handle: shared memory (``SharedMemoryBucket``), CUDA IPC (``CudaIpcBucket``) or the
    frameworks' pickled tensor handles (``weight_sync.handles``: this TP rank's entry). The result has
    ``named_tensors`` and ``close()``."""
    kind = handle.get("kind", KIND)
    if kind == KIND:
        return OpenedBucket(handle)
    if kind == cuda_ipc.KIND:
        return cuda_ipc.OpenedIpcBucket(handle)
    if kind == handles.KIND:
        return handles.OpenedPayload(handle, tp_rank)
    raise ValueError(f"unknown bucket handle kind {kind!r}: expected {KIND!r}, {cuda_ipc.KIND!r} or {handles.KIND!r}")
