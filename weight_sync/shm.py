"""Shared-memory buckets: weights between processes on one machine (CPU) without pickling.

The sender owns one ``SharedMemoryBucket`` (created once, reused for every update, grown only
when a bigger update comes) and writes a flattened bucket into it; the handle it passes on is
plain JSON (segment name + metadata). The receiver maps the segment and reads zero-copy views.
"""

from __future__ import annotations

import uuid
from multiprocessing import resource_tracker, shared_memory
from typing import Optional

import torch

from weight_sync.bucket import TensorMeta, layout, views

_CREATED_HERE: set[str] = set()  # segments this process owns (its tracker entry must stay)


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
        _CREATED_HERE.add(self.shm._name)

    def write(self, named_tensors: list[tuple[str, torch.Tensor]]) -> dict:
        """Copy the tensors in (one copy each) and return the JSON-able handle for the receiver."""
        metas, total = layout((n, t.dtype, tuple(t.shape)) for n, t in named_tensors)
        self._ensure(total)
        for (_, dst), (_, src) in zip(views(self.buffer[:total], metas), named_tensors):
            dst.copy_(src)
        return {"shm_name": self.shm.name, "nbytes": total, "metadata": [m.to_dict() for m in metas]}

    def close(self) -> None:
        if self.shm is not None:
            self.buffer = None
            self.shm.close()
            self.shm.unlink()
            _CREATED_HERE.discard(self.shm._name)
            self.shm = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class OpenedBucket:
    """A receiver's mapping of a sender's segment; ``close()`` after the views are dropped."""

    def __init__(self, handle: dict):
        try:
            self.shm = shared_memory.SharedMemory(name=str(handle["shm_name"]))
        except FileNotFoundError:
            raise ValueError(f"shared-memory segment {handle.get('shm_name')!r} does not exist") from None
        # The sender owns the segment: keep this process's tracker from unlinking it at exit.
        if self.shm._name not in _CREATED_HERE:
            resource_tracker.unregister(self.shm._name, "shared_memory")
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


def open_shared_bucket(handle: dict) -> OpenedBucket:
    return OpenedBucket(handle)
