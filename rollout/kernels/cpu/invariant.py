"""The batch-invariant mode's GEMM on CPU: one kernel at every row count whose result for a row does not
depend on the other rows, their number, the row's place among them or the thread count — so a token's
logits are the same bits in a prefill, a chunk or a decode step of any batch, and in the trainer's
forward (``rollout.kernels.autograd.linear``, another process with its own thread count).

Two kernels qualify:

- ``chunked`` (bf16, where oneDNN runs bf16 natively: AVX512-BF16 or AMX): oneDNN's GEMM over the packed
  weight, called only with a few fixed row counts (``chunk_sizes``: the rows padded with zero rows to the
  least that holds them, calls of the largest past it). oneDNN picks its kernel by the call's shape and
  sums each output over k in that kernel's order whatever the row's place, so a row gets the same bits in
  every call. That is a property of oneDNN's kernels, not a documented promise, so it is checked per weight
  shape once per process (a row first and last among random others in a call of each size, at 1, 2 and
  this process's thread count, bit for bit) and the mode takes ``tiled`` where a shape fails. Called with
  any row count, oneDNN is not invariant: a 49152 x 576 LM head gave other bits below 33 rows than above
  on an AMX Xeon.
- ``tiled`` (``ops.tiled_linear``, anywhere the C++ kernels are built, fp32 too): the project's register
  tiles over the weight's fp32 panels, each output an fp32 sum over k in order whatever the rows, the tile
  or the thread (``csrc/gemm.cpp``); 2-4x slower than oneDNN's bf16 kernels where those run natively.

The engine's fused q/k/v and gate/up weights are single shapes here; the trainer computes them fused too
(``trainer_bridge.on_policy``), so both call the same kernel on the same shapes.

Measured (``rollout bench fidelity``, SmolLM2 bf16, grpo-short): ``benchmarks/NOTES.md``.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from rollout.kernels.cpu import ops
from rollout.kernels.cpu.capability import cpu_capability

CHUNK_SIZES = (8, 16, 32, 64, 128, 256)  # the row counts oneDNN is called with; past the last, calls of the last


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear`` through oneDNN's packed copy of the weight (``torch.ops.mkldnn._reorder_linear_weight``): the
    one call the GEMM plan's ``onednn`` / ``fp32`` kernels (``packing.packed_linear``) and the chunks make."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def chunk_rows(m: int, sizes: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(first row, rows, the call's size) of each oneDNN call for ``m`` rows: calls of ``sizes[-1]`` rows,
    the last padded with zero rows to the least of ``sizes`` that holds it."""
    out = []
    for first in range(0, m, sizes[-1]):
        rows = min(sizes[-1], m - first)
        out.append((first, rows, next(c for c in sizes if c >= rows)))
    return out


def chunked_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """``F.linear(x, W, bias)`` from oneDNN's packed copy of W, each call of one of the weight shape's
    ``chunk_sizes`` rows."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    sizes = chunk_sizes(out_features, rows.shape[1])
    assert sizes is not None, f"chunked_linear: oneDNN is not row-invariant for a {out_features}x{rows.shape[1]} weight"
    out = rows.new_empty(m, out_features)
    for first, n, size in chunk_rows(m, sizes):
        part = rows[first: first + n]
        if n != size:
            padded = rows.new_zeros(size, rows.shape[1])
            padded[:n] = part
            part = padded
        elif not part.is_contiguous():
            part = part.contiguous()
        y = onednn_linear(part, packed, bias)
        if m == size:
            out = y
        else:
            out[first: first + n] = y[:n]
    return out.view(*x.shape[:-1], out_features)


def check_threads() -> tuple[int, ...]:
    """The thread counts the check runs at: 1, 2 and this process's (the engine's and the trainer's
    processes may run with other counts)."""
    return tuple(sorted({1, 2, torch.get_num_threads()}))


def _agree(n: int, k: int, sizes: tuple[int, ...], threads: tuple[int, ...]) -> bool:
    g = torch.Generator().manual_seed(n * 7919 + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    others = torch.randn(sizes[-1], k, generator=g).bfloat16()
    row = torch.randn(k, generator=g).bfloat16()
    ref = None
    before = torch.get_num_threads()
    try:
        for t in threads:
            torch.set_num_threads(t)
            for size in sizes:
                for place in (0, size - 1):
                    chunk = others[:size].clone()
                    chunk[place] = row
                    y = onednn_linear(chunk, packed, None)[place]
                    if ref is None:
                        ref = y
                    elif not torch.equal(ref, y):
                        return False
    finally:
        torch.set_num_threads(before)
    return True


@functools.lru_cache(maxsize=64)
def chunk_sizes(n: int, k: int) -> Optional[tuple[int, ...]]:
    """The row counts the chunked kernel calls oneDNN with for an [n, k] bf16 weight: the longest tail of
    ``CHUNK_SIZES`` in whose every call a row gets the same bits (first or last among random others, at
    each of ``check_threads()``); None where not even calls of the largest agree. An AMX Xeon's oneDNN
    picks another kernel below 33 rows for a 49152 x 576 LM head (64 rows up, here), and one kernel at
    every row count for the layers' shapes (8 up)."""
    threads = check_threads()
    for i in range(len(CHUNK_SIZES)):
        if _agree(n, k, CHUNK_SIZES[i:], threads):
            return CHUNK_SIZES[i:]
    return None


def gemm_kernel(dtype: torch.dtype, shapes) -> Optional[str]:
    """The batch-invariant mode's GEMM kernel for ``dtype`` and these (out, in) weight shapes on this CPU:
    ``chunked`` where every shape has ``chunk_sizes``, else ``tiled`` (None: the C++ kernels are not
    built here, so the mode runs a forward per token instead)."""
    if ops.load() is None:
        return None
    if dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() and cpu_capability().onednn_bf16 \
            and all(chunk_sizes(int(n), int(k)) is not None for n, k in sorted(set(map(tuple, shapes)))):
        return "chunked"
    return "tiled"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], kernel: str) -> torch.Tensor:
    """``F.linear`` as the batch-invariant mode's ``kernel`` computes it (the weight's copy made per call):
    ``chunked``, ``tiled`` or, on the CUDA kernel plan, ``triton`` (``rollout.kernels.triton.matmul``)."""
    if kernel == "triton":
        from rollout.kernels.triton.matmul import invariant_linear

        return invariant_linear(x, weight, bias)
    if kernel == "chunked":
        return chunked_linear(x, torch.ops.mkldnn._reorder_linear_weight(weight, None), bias, weight.shape[0])
    return ops.tiled_linear(x, ops.tile_pack(weight), weight.shape[0], bias)
