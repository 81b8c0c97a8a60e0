"""Attention for a mixed batch in one launch per layer (Triton): every sequence's new rows — a prefill chunk
of any length, or one decode token — attend over that sequence's context read straight from the paged KV
cache (its new K/V written there first), causally, within a sliding window where the model has one.

The batch is ragged: sequence ``s`` owns query rows ``q_starts[s] .. q_starts[s] + q_lens[s]`` of the flat
batch, sits at ``ctx_lens[s]`` tokens after this step and reads its blocks from ``block_tables[s]``. One
program per (sequence, block of ``BLOCK_M`` query rows, query head) walks the keys in ``BLOCK_N`` steps up to
its last row's position with an online softmax in fp32 (flash attention's order); no mask is built on the
host and no per-sequence loop runs. ``tests/test_gpu_path.py`` checks it against the torch path under
Triton's interpreter.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from rollout.kernels.audit import triton_launch

# Triton's interpreter multiplies bf16 as raw integers: there the dots take fp32 operands (on a GPU, bf16's)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _ragged_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, q_starts_ptr, q_lens_ptr, ctx_lens_ptr, tables_ptr,
                             scale, window, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb,
                             stride_ot, stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             HAS_WINDOW: tl.constexpr, IS_FP32: tl.constexpr):
    seq = tl.program_id(0)
    m_block = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_len = tl.load(q_lens_ptr + seq)
    if m_block * BLOCK_M < q_len:
        q_start = tl.load(q_starts_ptr + seq)
        ctx_len = tl.load(ctx_lens_ptr + seq)
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        pos = ctx_len - q_len + rows  # each query row's position in its sequence
        d = tl.arange(0, D_P2)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_P2], tl.float32)
        last = tl.minimum(ctx_len, ctx_len - q_len + (m_block + 1) * BLOCK_M)  # keys past the block's last row
        if HAS_WINDOW:  # keys before the block's first row's window are never read
            first = tl.maximum(0, (ctx_len - q_len + m_block * BLOCK_M - window) // BLOCK_N * BLOCK_N)
        else:
            first = 0
        for start in range(first, last, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_ok = keys < last
            block = tl.load(tables_ptr + seq * stride_tb + keys // BLOCK_SIZE, mask=key_ok, other=0)
            kv_off = block[:, None] * stride_kb + (keys % BLOCK_SIZE)[:, None] * stride_ks + kv_head * stride_kh \
                + d[None, :]
            kv_mask = key_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)  # [N, D], the cache's dtype
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
            if IS_FP32:  # full fp32 products (a GPU's default for fp32 dots is tf32)
                scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
            else:  # bf16 products, exact in the fp32 accumulator
                scores = tl.dot(q, tl.trans(k)) * scale
            allowed = key_ok[None, :] & (keys[None, :] <= pos[:, None])
            if HAS_WINDOW:
                allowed = allowed & (keys[None, :] > pos[:, None] - window)
            scores = tl.where(allowed, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet stays empty
            alpha = tl.exp(m - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            if IS_FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:  # the probabilities in the cache's dtype, as flash attention multiplies them
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def ragged_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_starts: torch.Tensor,
                           q_lens: torch.Tensor, ctx_lens: torch.Tensor, block_tables: torch.Tensor, max_q_len: int,
                           scale: float, sliding_window: Optional[int] = None,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [T, Hq, D] (each sequence's rows together); caches [blocks, block_size, Hkv, D] holding every
    sequence's context, this step's K/V included; per sequence (int tensors on q's device): ``q_starts``,
    ``q_lens``, ``ctx_lens`` (after this step), ``block_tables`` [S, max_blocks]; ``max_q_len`` the longest
    ``q_lens`` (the grid's size, known on the host). Writes rows it owns into ``out`` (new if None) -> [T, Hq, D]."""
    t, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    num_seqs = q_lens.shape[0]
    block_m = 16 if max_q_len <= 16 else 32
    block_n = 32
    grid = (num_seqs, triton.cdiv(max_q_len, block_m), num_heads)
    with triton_launch("ragged_paged_attention"):
        _ragged_attention_kernel[grid](
            q, k_cache, v_cache, out, q_starts, q_lens, ctx_lens, block_tables, scale,
            sliding_window if sliding_window is not None else 0, q.stride(0), q.stride(1), k_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
            GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, D_P2=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, HAS_WINDOW=sliding_window is not None,
            IS_FP32=q.dtype == torch.float32 or _INTERPRETED)
    return out
