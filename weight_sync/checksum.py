"""One checksum over a whole set of weights, computed the same way by trainer and engine."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Optional

import torch


def checksum_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]],
                           dtype: Optional[torch.dtype] = None) -> str:
    """sha256 over (name, dtype, shape, bytes) in name order; ``dtype`` casts first (the engine's)."""
    h = hashlib.sha256()
    for name, t in sorted(named_tensors, key=lambda x: x[0]):
        t = t.detach()
        if dtype is not None:
            t = t.to(dtype)
        t = t.contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
