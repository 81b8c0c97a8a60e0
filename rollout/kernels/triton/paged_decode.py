"""Paged decode attention on CUDA (Triton): reads K/V straight from the block cache, no gather.

One program per (sequence, KV head) handles the ``group`` query heads that share that KV head,
walking the sequence's blocks with an online softmax in fp32. Checked against the torch
reference path by ``scripts/gpu_check.py``. Imported only on CUDA machines with Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.kernels.audit import triton_launch


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale,
                         stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb, stride_ob, stride_oh,
                         GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx_len = tl.load(lens_ptr + seq)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, D_P2)
    s = tl.arange(0, BLOCK_SIZE)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + (kv_head * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [G, D]
    m = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, D_P2], tl.float32)
    num_blocks = tl.cdiv(ctx_len, BLOCK_SIZE)
    for i in range(0, num_blocks):
        block = tl.load(tables_ptr + seq * stride_tb + i)
        pos_ok = (i * BLOCK_SIZE + s) < ctx_len
        kv_off = block * stride_kb + s[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)  # [S, D]
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, S]
        scores = tl.where(pos_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(out_ptr + seq * stride_ob + (kv_head * GROUP + g)[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] (int);
    ctx_lens [B] (int) -> [B, Hq, D]."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    with triton_launch("paged_decode"):
        _paged_decode_kernel[(batch, num_kv_heads)](
            q, k_cache, v_cache, block_tables, ctx_lens, out, scale,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            out.stride(0), out.stride(1),
            GROUP=group, GROUP_P2=triton.next_power_of_2(group), HEAD_DIM=head_dim,
            D_P2=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size)
    return out
