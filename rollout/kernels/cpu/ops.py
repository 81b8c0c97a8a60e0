"""The CPU kernels' Python faces: each call hands its tensors to the compiled extension
(``build.kernels()``, this CPU's ISA variant). What each kernel computes, and why its bits are the
torch path's, is written at the top of its C++ file in ``csrc/``:

- ``paged_decode_attention``: decode attention straight from the paged KV cache (``paged_decode.cpp``);
- ``bf16_linear``, ``tile_pack`` / ``tiled_linear``: the small-batch and register-tiled GEMMs
  (``gemm.cpp``; which one serves a forward is the GEMM plan's choice, ``packing.py``);
- ``rms_norm`` (``norm.cpp``), ``rope_and_cache`` (``rope.cpp``), ``silu_mul`` (``act.cpp``);
- ``draw`` / ``logprob``: the sampler's inverse-CDF draw and its logprobs (``sample.cpp``);
- ``moe_experts``: a mixture of experts' block, its rows grouped by expert and the experts side by side
  over the threads (``moe.cpp``);
- ``scatter_plan`` / ``scatter_scaled``: received tensors into their fp32 places, scaled, non-finite
  values counted (``copy.cpp``; a LoRA adapter's bucket on arrival);
- ``delta_fingerprint`` / ``delta_diff_many`` / ``delta_fingerprint_at`` / ``delta_apply_many`` /
  ``delta_check_many``: a delta push's passes over the weights' bits (``delta.cpp``; ``weight_sync.delta`` says what
  they compute).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from rollout.kernels.cpu import build

# the source dtypes of a scatter, by the code a plan row gives them
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
PLAN_COLUMNS = 7  # src byte offset, dtype code, rows, cols, src row stride, dst offset, dst row stride


def load() -> Optional[object]:
    """The compiled kernels for this CPU's ISA, or None where they cannot be built (the reason logged once)."""
    return build.kernels()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           ctx_lens: torch.Tensor, scale: float, sliding_window: Optional[int] = None) -> torch.Tensor:
    """q [B, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block tables [B, max_blocks]; context
    lengths [B] (the new token's K/V already written) -> [B, Hq, D] in q's dtype."""
    return build.kernels().paged_decode(q, k_cache, v_cache, block_tables, ctx_lens, float(scale),
                                        int(sliding_window or 0))


def tile_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] (bf16 or fp32) as the fp32 panels ``tiled_linear`` reads (the weight's values
    exactly; N padded with zeros to whole panels). The layout is the running ISA variant's."""
    return build.kernels().tile_pack(weight)


def tiled_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` from ``tile_pack(W)``: fp32 sums over k in order, one rounding to
    ``x.dtype`` (the register-tiled kernel for larger batches)."""
    return build.kernels().tiled_linear(x, panels, out_features, bias)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a contiguous bf16 ``weight`` (or an fp32 one with fp32 ``x``):
    fp32 accumulation, one rounding to ``x.dtype``."""
    return build.kernels().bf16_linear(x, weight, bias)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, experts: torch.Tensor,
                weights: torch.Tensor, linear_rows: int = 1 << 62) -> torch.Tensor:
    """A sparse block's experts: x [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], each
    token's ``experts`` [T, k] and their ``weights`` [T, k] -> [T, H]: the per-expert loop of ``bf16_linear``
    (``F.linear`` for an expert of ``linear_rows`` rows or more), ``silu_mul``, the same GEMM, summed back in
    ascending expert order, bit for bit."""
    return build.kernels().moe_experts(x, w13, w2, experts.long(), weights, int(linear_rows))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return build.kernels().rms_norm(x, weight, float(eps))


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] (q, k, v side by side); cos / signed sin [T, 1, D]
    (``RotaryEmbedding.tables``); caches [blocks, block_size, Hkv, D]; slots [T] -> rotated q
    [T, Hq, D], rotated k and v written into their slots."""
    return build.kernels().rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)`` in one C++ call."""
    return build.kernels().silu_mul(gate_up)


def sampling_available(x: torch.Tensor) -> bool:
    """Whether ``x`` (a processed distribution) is drawn from by the C++ kernel here."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and build.kernels() is not None


def draw(dist: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [S] long, their logprobs [S] fp32): the inverse-CDF draw of each row by its uniform."""
    ids = torch.empty(dist.shape[0], dtype=torch.long)
    lp = build.kernels().sample_rows(dist, uniforms.float(), ids, True)
    return ids, lp


def logprob(dist: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(dist)[ids], computed as ``draw`` computes a drawn token's logprob (the same bits)."""
    empty = torch.empty(0, dtype=torch.float32)
    return build.kernels().sample_rows(dist, empty, ids.to(torch.long).contiguous(), False)


def scatter_plan(slot: torch.Tensor, dst: torch.Tensor, pieces) -> tuple[torch.Tensor, torch.Tensor]:
    """``scatter_scaled``'s plan and scales for ``pieces``: (src view of ``slot``, dst view of ``dst``,
    scale or None), each view 2-D (or 1-D) with unit stride along its last dimension, the same shape."""
    rows, scales = [], []
    base_s, base_d = slot.data_ptr(), dst.data_ptr()
    for src, out, scale in pieces:
        src2, out2 = (src.unsqueeze(0), out.unsqueeze(0)) if src.dim() == 1 else (src, out)
        if src2.dim() != 2 or src2.shape != out2.shape or src2.stride(-1) != 1 or out2.stride(-1) != 1 \
                or src2.dtype not in DTYPE_CODES or out2.dtype != torch.float32:
            raise ValueError("scatter_plan: 2-D pieces of the same shape, unit stride along rows, fp32 places")
        rows.append([src2.data_ptr() - base_s, DTYPE_CODES[src2.dtype], src2.shape[0], src2.shape[1],
                     src2.stride(0), (out2.data_ptr() - base_d) // 4, out2.stride(0)])
        scales.append(1.0 if scale is None else scale)
    return torch.tensor(rows, dtype=torch.long).reshape(-1, PLAN_COLUMNS), torch.tensor(scales, dtype=torch.float32)


def scatter_scaled(slot: torch.Tensor, dst: torch.Tensor, plan: torch.Tensor, scales: torch.Tensor) -> int:
    """Run a ``scatter_plan``: the number of non-finite values written."""
    return int(build.kernels().scatter_scaled(slot, dst, plan, scales))


def delta_fingerprint(bits: torch.Tensor, salt: int, outer: int, length: int, inner: int, size: int,
                      start: int) -> int:
    """The fingerprint terms of ``bits`` (int16 or int32 words laid as [outer, length, inner], the run
    [start, start + length) of a full [outer, size, inner] tensor's middle dimension), summed mod 2^64."""
    out = torch.empty(1, dtype=torch.long)
    build.kernels().delta_fingerprint(bits, salt, outer, length, inner, size, start, out)
    return int(out[0])


def delta_diff_many(nows: list[torch.Tensor], bases: list[torch.Tensor], salts: list[int], align: int = 8,
                    in_place: bool = False) -> DiffFound:
    """For each (now, base) pair: (the increasing flat indices, where ``now``'s words differ from ``base``'s — int32
    where the tensor has fewer than 2^31 elements, else int64 —, ``now``'s words there, how far the fingerprint
    moves from ``base`` to ``now`` mod 2^64), each tensor's indices and words at offsets of a multiple of ``align``
    of one buffer (as a weight bucket lays tensors: ``align`` its alignment). ``now`` may be fp32 values against
    bf16 words: compared, and given, as torch casts them. ``in_place``: the changed words written into each base as
    they are found (``DiffFound.olds``: the words they replaced). One call, one parallel region over all of them."""
    k = len(nows)
    moved, blocks = torch.empty(k, dtype=torch.long), torch.empty(k, 4, dtype=torch.long)
    raw = build.kernels().delta_diff_many(nows, bases, torch.tensor(salts, dtype=torch.long), moved, blocks, align,
                                          int(in_place))
    found, olds = [], []
    for base, (count, at_index, at_words, at_old), move in zip(bases, blocks.tolist(), moved.tolist()):
        index = torch.int32 if base.numel() < 2**31 else torch.int64
        size = base.element_size()
        found.append((raw[at_index: at_index + count * index.itemsize].view(index),
                      raw[at_words: at_words + count * size].view(base.dtype), int(move)))
        olds.append(raw[at_old: at_old + count * size].view(base.dtype))
    return DiffFound(found, olds)


class DiffFound(NamedTuple):
    """``delta_diff_many``'s answer: per tensor (indices, new words, fingerprint move), and per tensor the words an
    in-place diff replaced."""

    found: list[tuple[torch.Tensor, torch.Tensor, int]]
    olds: list[torch.Tensor]


def delta_fingerprint_at(bits: torch.Tensor, positions: torch.Tensor, salt: int) -> int:
    """The fingerprint terms of ``bits`` at their full-tensor flat indices ``positions`` (int64), summed."""
    out = torch.empty(1, dtype=torch.long)
    build.kernels().delta_fingerprint_at(bits, positions, salt, out)
    return int(out[0])


def delta_check_many(entries: list[tuple[torch.Tensor, torch.Tensor, int, int]]) -> list[tuple[int, int]]:
    """For each sparse entry (indices, values as words, the tensor's ``numel``, the values' exponent bits — 0: any
    value passes): (0, 0) where it applies to a tensor of ``numel`` elements; else (1: an index outside it, 2:
    indices not strictly increasing, 3: a NaN or infinite value; the first offending element). One call."""
    params = torch.tensor([[e[2], e[3]] for e in entries], dtype=torch.long).reshape(-1, 2)
    out = torch.empty(len(entries), 2, dtype=torch.long)
    build.kernels().delta_check_many([e[0] for e in entries], [e[1] for e in entries], params, out)
    return [(int(c), int(at)) for c, at in out.tolist()]


def delta_apply_many(entries: list[tuple]) -> list[tuple[torch.Tensor, int, int]]:
    """Sparse entries (dst, indices, values, salt, length, inner, size, start, counts) written into each ``dst``'s
    words where this rank holds them (``dst`` laid as [outer, length, inner] of a full [outer, size, inner] tensor
    from ``start``), in one call: each one's (old words — the value itself where the rank does not hold it, so
    that writing them back undoes this —, the fingerprint's move (0 unless ``counts``), the words written)."""
    olds = [torch.empty_like(e[2]) for e in entries]
    params = torch.tensor([[e[3], e[4], e[5], e[6], e[7], int(e[8])] for e in entries], dtype=torch.long).reshape(-1, 6)
    out = torch.empty(len(entries), 2, dtype=torch.long)
    build.kernels().delta_apply_many([e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries], olds,
                                     params, out)
    return [(old, int(m), int(w)) for old, (m, w) in zip(olds, out.tolist())]
