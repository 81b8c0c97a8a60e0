"""``FlattenedTensorBucket``: many tensors in one contiguous byte buffer plus metadata.

One buffer per bucket turns N transfers (and N IPC handles, N broadcasts) into one. Metadata is
plain data (name, dtype, shape, byte offset): it travels as JSON, never as a pickle.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Optional

import torch

ALIGN = 64  # bytes: every tensor starts cache-line aligned

_DTYPES = {str(d).replace("torch.", ""): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                    torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)}


_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.")


def wire_order(names: list[str]) -> list[int]:
    """The order in which tensors travel, and in which the engine lays its parameters out in
    memory: the given order, except that within each run of one decoder layer's tensors the
    biases come after the rest (stable).

    A trainer lists a layer as q.weight, q.bias, k.weight, ...; the engine packs the q/k/v weights
    into one parameter and their biases into another. With biases last on both sides, a trainer
    that sends its own ``named_parameters()`` order delivers buckets already in the engine's
    layout, which a TP=1 receiver takes in place, with no copy."""
    out, i = [], 0
    while i < len(names):
        m = _LAYER.search(names[i])
        if m is None:
            out.append(i)
            i += 1
            continue
        prefix, j = names[i][: m.end()], i
        while j < len(names) and names[j].startswith(prefix):
            j += 1
        run = range(i, j)
        out += [k for k in run if not names[k].endswith(".bias")] + [k for k in run if names[k].endswith(".bias")]
        i = j
    return out


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.replace("torch.", "")]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; supported: {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the buffer

    @property
    def nbytes(self) -> int:
        return dtype_from_name(self.dtype).itemsize * math.prod(self.shape)

    def to_dict(self) -> dict:
        return {**asdict(self), "shape": list(self.shape)}

    @staticmethod
    def from_dict(d: dict) -> TensorMeta:
        return TensorMeta(str(d["name"]), str(d["dtype"]), tuple(int(x) for x in d["shape"]), int(d["offset"]))


def aligned_nbytes(dtype: torch.dtype, shape) -> int:
    """Bytes a tensor takes in a bucket: its size rounded up to ``ALIGN``."""
    return -(-dtype.itemsize * math.prod(shape) // ALIGN) * ALIGN


def layout(specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[list[TensorMeta], int]:
    """Byte offsets for (name, dtype, shape) specs; returns (metadata, total bytes)."""
    metas, offset = [], 0
    for name, dtype, shape in specs:
        metas.append(TensorMeta(name, dtype_name(dtype), tuple(int(s) for s in shape), offset))
        offset += aligned_nbytes(dtype, shape)
    return metas, offset


def pack(buffer: torch.Tensor, metas: list[TensorMeta], named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Copy each tensor into its place in ``buffer`` (metas from ``layout`` of the same tensors)."""
    for (_, dst), (_, src) in zip(views(buffer, metas), named_tensors):
        dst.copy_(src, non_blocking=dst.is_cuda)


def views(buffer: torch.Tensor, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Zero-copy (name, tensor) views of a uint8 buffer, validating that each lies inside it."""
    total = buffer.numel()
    out = []
    for m in metas:
        if m.offset < 0 or m.offset + m.nbytes > total:
            raise ValueError(f"bucket entry {m.name!r} [{m.offset}, {m.offset + m.nbytes}) lies outside "
                             f"the {total}-byte buffer")
        out.append((m.name, buffer[m.offset: m.offset + m.nbytes].view(dtype_from_name(m.dtype)).view(m.shape)))
    return out


class FlattenedTensorBucket:
    """Pack named tensors into one uint8 buffer (``buffer``) described by ``metadata``; with
    ``dtype``, every tensor is cast to it on the way in (one pass)."""

    def __init__(self, named_tensors: Optional[list[tuple[str, torch.Tensor]]] = None, *,
                 buffer: Optional[torch.Tensor] = None, metadata: Optional[list[TensorMeta]] = None,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None):
        if named_tensors is not None:
            metas, total = layout((n, dtype or t.dtype, tuple(t.shape)) for n, t in named_tensors)
            device = device or (named_tensors[0][1].device if named_tensors else torch.device("cpu"))
            buffer = torch.empty(total, dtype=torch.uint8, device=device)
            pack(buffer, metas, named_tensors)
            metadata = metas
        if buffer is None or metadata is None:
            raise ValueError("pass named_tensors, or buffer and metadata")
        self.buffer, self.metadata = buffer, list(metadata)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return views(self.buffer, self.metadata)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()
