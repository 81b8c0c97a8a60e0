"""The wire layout: the one contract shared by a trainer's sender, the engine's receiver and the
engine's parameter memory.

- ``wire_order``: the order tensors travel in, and the order the engine lays its parameters out in
  memory (the given order, biases after the other tensors of each decoder layer).
- ``bucket_specs``: where a (name, dtype, shape) list is cut into buckets (both sides cut alike).
- ``layout``: each tensor's byte offset inside its bucket (``ALIGN``-aligned).
- ``contiguous_run``: whether a bucket's tensors already lie in one memory exactly as the bucket
  lays them out; then a sender broadcasts from that memory and a receiver receives into it, with
  no pack or copy.

Because the engine lays out its parameters in ``wire_order`` with the same alignment rule, a
trainer that sends its own ``named_parameters()`` order delivers TP=1 buckets that land in place.
Plain data and torch only: nothing here imports the engine.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Optional

import torch

ALIGN = 64  # bytes: every tensor in a bucket starts cache-line aligned
FIRST_BUCKET_BYTES = 8 << 20  # the first bucket is small: the wire starts while the rest is packed

_DTYPES = {str(d).replace("torch.", ""): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                    torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)}

_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.")
_LORA_A = re.compile(r"\.lora_A(?:\.[\w-]+)?\.weight$")  # a LoRA adapter's A matrix, as peft names it

Spec = tuple[str, torch.dtype, tuple[int, ...]]  # (name, dtype, shape) of one tensor on the wire


class SpecTuple(tuple):
    """A call's (name, dtype, shape tuple) specs, hashed once: the caches keyed by a call's specs (its
    bucket layouts, an adapter's recipe) are looked up on every push, and a tuple of an adapter's 420
    specs hashes anew each time (~10-60 us on a busy core). Compares as the plain tuple it holds."""

    _hash: int

    def __new__(cls, specs: Iterable[Spec]) -> SpecTuple:
        self = super().__new__(cls, specs)
        self._hash = tuple.__hash__(self)
        return self

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):  # crosses processes as a plain tuple of its specs
        return (SpecTuple, (tuple(self),))


def spec_tuple(specs: Iterable[Spec]) -> SpecTuple:
    """``specs`` as a ``SpecTuple`` (itself when it is one already) of (name, dtype, shape tuple)."""
    if type(specs) is SpecTuple:
        return specs
    return SpecTuple((name, dtype, tuple(shape)) for name, dtype, shape in specs)


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.replace("torch.", "")]
    except (KeyError, AttributeError):
        raise ValueError(f"unsupported dtype {name!r}; supported: {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def wire_order(names: list[str]) -> list[int]:
    """Indices of ``names`` in wire order: the given order, except that within each run of one
    decoder layer's tensors the biases come after the rest (stable).

    A trainer lists a layer as q.weight, q.bias, k.weight, ...; the engine packs the q/k/v weights
    into one parameter and their biases into another. With biases last on both sides, a trainer
    that sends its own ``named_parameters()`` order delivers buckets already in the engine's
    layout."""
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


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the bucket

    @functools.cached_property
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


def layout(specs: Iterable[Spec]) -> tuple[list[TensorMeta], int]:
    """Byte offsets for (name, dtype, shape) specs, in the given order; returns (metadata, total bytes)."""
    metas, offset = [], 0
    for name, dtype, shape in specs:
        metas.append(TensorMeta(name, dtype_name(dtype), tuple(int(s) for s in shape), offset))
        offset += aligned_nbytes(dtype, shape)
    return metas, offset


def bucket_specs(specs: Iterable[Spec], bucket_bytes: int) -> Iterator[list[Spec]]:
    """Split specs, in ``wire_order``, into consecutive buckets of at most ``bucket_bytes`` (a
    larger tensor goes alone); the first bucket holds at most ``FIRST_BUCKET_BYTES``. Sender and
    receiver share this split.

    A LoRA adapter's call (its ``lora_A`` tensors sent before its ``lora_B`` ones, as
    ``rollout.weights.lora.wire_order`` orders them) breaks where the ``A`` tensors end: the ``A``
    buckets land in place in the engine's adapter buffer and only the ``B`` ones are copied out
    (scaled, into their blocks); and its first bucket is not held small (its trainer holds it in one
    buffer: nothing is packed while the wire waits). Fewer, larger messages: each costs gloo ~0.1 ms."""
    specs = list(specs)
    specs = [specs[i] for i in wire_order([s[0] for s in specs])]
    lora = bool(specs) and _LORA_A.search(specs[0][0]) is not None
    bucket, size, limit, in_a = [], 0, bucket_bytes if lora else min(bucket_bytes, FIRST_BUCKET_BYTES), lora
    for spec in specs:
        n = aligned_nbytes(spec[1], spec[2])
        is_a = lora and _LORA_A.search(spec[0]) is not None
        if bucket and (size + n > limit or (in_a and not is_a)):  # past the limit, or the first B
            yield bucket
            bucket, size, limit = [], 0, bucket_bytes
        bucket.append(spec)
        size += n
        in_a = is_a
    if bucket:
        yield bucket


def bucket_layouts(specs: Iterable[Spec], bucket_bytes: int) -> list[tuple[list[TensorMeta], int]]:
    """``layout`` of every bucket of ``bucket_specs``: what one update moves, bucket by bucket."""
    return [layout(b) for b in bucket_specs(specs, bucket_bytes)]


def contiguous_run(tensors: list[torch.Tensor], metas: list[TensorMeta], total: int,
                   tail_padding_ok: bool = True) -> Optional[torch.Tensor]:
    """A ``total``-byte uint8 view of the memory ``tensors`` (one per meta, in order) lie in, when
    they lie there exactly as the bucket lays them out: contiguous, one storage, each at its
    meta's byte offset from the first. None otherwise (the bucket must be packed or copied).

    A receiver writes all ``total`` bytes, so it passes ``tail_padding_ok=False``: the last
    tensor's alignment padding would overwrite whatever follows it in that memory."""
    if not tail_padding_ok and metas[-1].offset + metas[-1].nbytes != total:
        return None
    first = tensors[0]
    storage = first.untyped_storage()
    start = first.storage_offset() * first.element_size()
    if start + total > storage.nbytes():
        return None
    base = first.data_ptr()
    for t, m in zip(tensors, metas):  # each inside ``first``'s storage, at its offset (allocations never overlap)
        if t.data_ptr() - base != m.offset or t.nbytes != m.nbytes or not t.is_contiguous():
            return None
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, start, (total,), (1,))


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
