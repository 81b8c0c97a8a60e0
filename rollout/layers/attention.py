"""Paged attention over a block KV cache (torch reference path; CPU and CUDA).

KV layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and for V, viewed
flat as ``[num_slots, num_kv_heads, head_dim]`` (slot = block * block_size + offset). New K/V are
written to their slots first, then each sequence attends over its context slots:

- decode tokens (one query each) run as one batched SDPA over context padded to the longest one,
  grouping the query heads of each KV head so GQA needs no repeat;
- prefill chunks run one SDPA per sequence, causal within the chunk, over cached prefix + chunk.

Masks are built once per step (``AttentionMetadata``), not per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PrefillSpan:
    q_start: int  # first row of this sequence's chunk in the flat token batch
    q_len: int
    ctx_slots: Optional[torch.Tensor]  # [ctx_len] slots of prefix + chunk; None: chunk is the whole context
    mask: Optional[torch.Tensor]  # [q_len, ctx_len] bool, True = attend; None: plain causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot of each new token
    decode_rows: Optional[torch.Tensor] = None  # [Bd] rows of decode tokens in the flat batch
    decode_blocks: Optional[torch.Tensor] = None  # [Bd, max_blocks] block tables, padded with block 0
    decode_mask: Optional[torch.Tensor] = None  # [Bd, 1, 1, max_blocks * block_size] bool
    decode_ctx_lens: Optional[torch.Tensor] = None  # [Bd] context lengths (the paged CUDA kernel's input)
    all_decode: bool = False  # every row is a decode token, in order: no row selection needed
    use_paged_kernel: bool = False  # read paged KV in place (CUDA: Triton; CPU: C++) instead of gather + SDPA
    prefills: list[PrefillSpan] = field(default_factory=list)
    sliding_window: Optional[int] = None
    ragged: Optional[RaggedBatch] = None  # the one-launch path's view of every sequence (build ..., ragged=True)
    decode_splits: Optional[int] = None  # the Triton decode kernel's parts per sequence (None: from shapes; per_row: 1)


@dataclass
class RaggedBatch:
    """Every sequence of a step for ``rollout.kernels.triton.prefill.ragged_paged_attention``: where its rows
    start, how many, its context after the step and its blocks (device tensors), and the longest run of rows."""

    q_starts: torch.Tensor
    q_lens: torch.Tensor
    ctx_lens: torch.Tensor
    block_tables: torch.Tensor
    max_q_len: int


def build_attention_metadata(block_tables: list[list[int]], ctx_lens: list[int], q_lens: list[int],
                             block_size: int, device: torch.device, sliding_window: Optional[int] = None,
                             ragged: bool = False, per_row: bool = False) -> tuple[torch.Tensor, AttentionMetadata]:
    """Per sequence: its block table, its context length after this step and its number of new
    tokens (the last ``q_len`` positions). Returns (positions [T], metadata); rows follow the
    sequences in order. Slots are computed from block tables with tensor arithmetic, not lists.
    ``ragged``: a step with prefill rows is attended in one launch (``RaggedBatch``), no per-sequence
    spans or host masks built. ``per_row`` (the batch-invariant mode): every row is attended as a decode
    token is — its own query over its sequence's context up to its position, from the cache — so a
    position's attention is the same computation in a prefill, a chunk, after a prefix-cache hit or in a
    decode step (``all_decode`` set: the paged decode kernel serves every step; no SDPA mask is built).
    """
    num_seqs = len(block_tables)
    tables = torch.zeros(num_seqs, max(len(t) for t in block_tables), dtype=torch.long)
    for i, t in enumerate(block_tables):
        tables[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    ctx = torch.tensor(ctx_lens, dtype=torch.long)
    q = torch.tensor(q_lens, dtype=torch.long)
    row_start = torch.cumsum(q, 0) - q
    seq_of_row = torch.repeat_interleave(torch.arange(num_seqs), q)
    positions = (ctx - q)[seq_of_row] + torch.arange(int(q.sum())) - row_start[seq_of_row]
    slot_mapping = tables[seq_of_row, positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(slot_mapping=slot_mapping.to(device), sliding_window=sliding_window)
    if per_row:
        lens = positions + 1  # no mask: the paged kernel (use_paged_kernel) reads each row's context
        meta.decode_rows = torch.arange(len(lens)).to(device)
        meta.decode_blocks = tables[seq_of_row][:, : -(-int(lens.max()) // block_size)].to(device)
        meta.decode_ctx_lens = lens.to(device)
        meta.all_decode = True
        meta.decode_splits = 1  # a split count chosen by the batch's shape would change a row's sums
        return positions.to(device), meta
    is_decode = q == 1
    if bool(is_decode.any()):
        idx = is_decode.nonzero().squeeze(1)
        lens = ctx[idx]
        num_blocks = -(-int(lens.max()) // block_size)
        # Whole blocks are gathered (a contiguous copy each); positions past a context are masked.
        keys = torch.arange(num_blocks * block_size)
        mask = keys.unsqueeze(0) < lens.unsqueeze(1)
        if sliding_window is not None:
            mask &= keys.unsqueeze(0) > (lens.unsqueeze(1) - 1 - sliding_window)
        meta.decode_rows = row_start[idx].to(device)
        meta.decode_blocks = tables[idx][:, :num_blocks].to(device)
        meta.decode_ctx_lens = lens.to(device)
        meta.decode_mask = mask.view(len(idx), 1, 1, -1).to(device)
        meta.all_decode = len(idx) == num_seqs
    if ragged and not meta.all_decode:
        meta.ragged = RaggedBatch(row_start.to(device), q.to(device), ctx.to(device), tables.to(device), max(q_lens))
        return positions.to(device), meta
    for i in (~is_decode).nonzero().squeeze(1).tolist():
        meta.prefills.append(_prefill_span(int(row_start[i]), q_lens[i], ctx_lens[i], tables[i], block_size,
                                           device, sliding_window))
    return positions.to(device), meta


def _prefill_span(row: int, q_len: int, ctx_len: int, table: torch.Tensor, block_size: int, device,
                  sliding_window: Optional[int]) -> PrefillSpan:
    if ctx_len == q_len and sliding_window is None:
        return PrefillSpan(row, q_len, None, None)  # no cached prefix: attend within the chunk
    k_pos = torch.arange(ctx_len)
    slots = table[k_pos // block_size] * block_size + k_pos % block_size
    q_pos = torch.arange(ctx_len - q_len, ctx_len).unsqueeze(1)
    mask = k_pos.unsqueeze(0) <= q_pos
    if sliding_window is not None:
        mask &= k_pos.unsqueeze(0) > q_pos - sliding_window
    return PrefillSpan(row, q_len, slots.to(device), mask.to(device))


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, triton: bool = False):
        super().__init__()
        self.triton = triton  # decode from the paged cache with the Triton kernel on any device (KernelPlan.triton)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D] -> [T, Hq*D]."""
        k_flat = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_flat = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)
        if meta.ragged is not None:  # every sequence's rows in one launch, from the cache
            from rollout.kernels.triton.prefill import ragged_paged_attention

            r = meta.ragged
            out = ragged_paged_attention(q, k_cache, v_cache, r.q_starts, r.q_lens, r.ctx_lens, r.block_tables,
                                         r.max_q_len, self.scale, meta.sliding_window)
            return out.view(q.shape[0], self.num_heads * self.head_dim)
        kernel = self._paged_kernel(q, k_cache, v_cache, meta)
        if kernel is not None and meta.all_decode:  # a plain decode step: no rows to select or scatter
            return self._decode_all(kernel, q)
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            qd = q.index_select(0, meta.decode_rows)
            bd = qd.shape[0]
            if kernel is not None:
                out.index_copy_(0, meta.decode_rows, kernel(qd))
                return self._prefill(q, k, v, k_flat, v_flat, meta, out)
            qd = qd.view(bd, self.num_kv_heads, self.group, self.head_dim)
            kd = k_cache[meta.decode_blocks].view(bd, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
            vd = v_cache[meta.decode_blocks].view(bd, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=self.scale)
            out.index_copy_(0, meta.decode_rows, od.reshape(bd, self.num_heads, self.head_dim))
        return self._prefill(q, k, v, k_flat, v_flat, meta, out)

    def decode_from_cache(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata) -> torch.Tensor:
        """A plain decode step (``meta.all_decode``, the paged kernel on) whose new K/V are in the
        cache already (``rollout.kernels.cpu.ops``): q [T, Hq, D] -> [T, Hq*D]."""
        kernel = self._paged_kernel(q, k_cache, v_cache, meta)
        assert kernel is not None and meta.all_decode, "decode_from_cache: a decode step on the paged kernel only"
        return self._decode_all(kernel, q)

    def _decode_all(self, kernel, q: torch.Tensor) -> torch.Tensor:
        return kernel(q.contiguous()).view(q.shape[0], self.num_heads * self.head_dim)

    def _paged_kernel(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata):
        """The decode attention that reads KV blocks in place (CUDA: Triton, no sliding window; CPU:
        C++), as ``f(decode queries) -> outputs``; None: gather + SDPA."""
        if not meta.use_paged_kernel or meta.decode_rows is None:
            return None
        args = (k_cache, v_cache, meta.decode_blocks, meta.decode_ctx_lens, self.scale)
        if q.is_cuda or self.triton:
            if meta.sliding_window is not None:
                return None
            from rollout.kernels.triton.paged_decode import paged_decode_attention

            return lambda qd: paged_decode_attention(qd, *args, num_splits=meta.decode_splits)
        from rollout.kernels.cpu.ops import paged_decode_attention

        return lambda qd: paged_decode_attention(qd, *args, meta.sliding_window)

    def _prefill(self, q, k, v, k_flat, v_flat, meta: AttentionMetadata, out: torch.Tensor) -> torch.Tensor:
        for span in meta.prefills:
            qs = q.narrow(0, span.q_start, span.q_len).transpose(0, 1).unsqueeze(0)  # [1, Hq, Q, D]
            if span.ctx_slots is None:
                ks = k.narrow(0, span.q_start, span.q_len)
                vs = v.narrow(0, span.q_start, span.q_len)
            else:
                ks, vs = k_flat[span.ctx_slots], v_flat[span.ctx_slots]
            ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
            os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, is_causal=span.mask is None,
                                                 scale=self.scale, enable_gqa=self.group > 1)
            out.narrow(0, span.q_start, span.q_len).copy_(os_.squeeze(0).transpose(0, 1))
        return out.view(q.shape[0], self.num_heads * self.head_dim)
