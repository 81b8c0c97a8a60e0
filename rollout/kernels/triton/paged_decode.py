"""Paged decode attention on CUDA (Triton): reads K/V straight from the block cache, no gather.

One program per (sequence, KV head) handles the ``group`` query heads that share that KV head,
walking the sequence's blocks with an online softmax in fp32 — or, for small batches of long contexts,
one per (sequence, KV head, split of the blocks), their partial sums combined by a second launch
(``decode_splits``). Checked against the torch reference path by ``scripts/gpu_check.py`` and, under
Triton's interpreter, by the suite.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.kernels.audit import triton_launch


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, acc_ptr, m_ptr, l_ptr, scale,
                         stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb, stride_ob, stride_oh,
                         GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
                         NUM_HEADS: tl.constexpr):
    """The query heads of one KV head over one split of a sequence's blocks (all of them when ``NUM_SPLITS``
    is 1: the output itself; else the split's unnormalised sum, running max and denominator per head)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
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
    first = split * BLOCKS_PER_SPLIT
    last = tl.minimum(tl.cdiv(ctx_len, BLOCK_SIZE), first + BLOCKS_PER_SPLIT)
    for i in range(first, last):
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
    heads = kv_head * GROUP + g
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        part = (seq * NUM_HEADS + heads) * NUM_SPLITS + split  # [G] rows of the partials
        tl.store(acc_ptr + part[:, None] * D_P2 + d[None, :], acc, mask=g_ok[:, None])
        tl.store(m_ptr + part, m, mask=g_ok)
        tl.store(l_ptr + part, l_sum, mask=g_ok)


@triton.jit
def _paged_decode_reduce_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, stride_ob, stride_oh, HEAD_DIM: tl.constexpr,
                                D_P2: tl.constexpr, NUM_SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr):
    """The splits of one (sequence, query head) combined: each rescaled to the common max."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, D_P2)
    rows = (seq * NUM_HEADS + head) * NUM_SPLITS + sp
    m = tl.load(m_ptr + rows)
    m_all = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))  # an empty split weighs nothing
    total = tl.sum(tl.load(l_ptr + rows) * w, axis=0)
    acc = tl.sum(tl.load(acc_ptr + rows[:, None] * D_P2 + d[None, :]) * w[:, None], axis=0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, (acc / total).to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def decode_splits(batch: int, num_kv_heads: int, max_blocks: int) -> int:
    """How many parts a sequence's blocks are split into: enough programs to fill a GPU when the batch is
    small and contexts long (SGLang's Triton decode pattern), none when the batch fills it already; a power
    of two, each part at least 8 blocks. Decided from shapes alone, so a captured graph keeps it."""
    if batch * num_kv_heads >= 128 or max_blocks < 16:
        return 1
    return min(16, triton.next_power_of_2(max_blocks // 8), max(1, triton.next_power_of_2(256 // (batch * num_kv_heads))))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           ctx_lens: torch.Tensor, scale: float, num_splits: int | None = None) -> torch.Tensor:
    """q: [B, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] (int);
    ctx_lens [B] (int) -> [B, Hq, D]. ``num_splits`` (a power of two; None: ``decode_splits``): each
    sequence's blocks walked in that many parts at once, then combined."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    splits = decode_splits(batch, num_kv_heads, block_tables.shape[1]) if num_splits is None else num_splits
    assert splits & (splits - 1) == 0, "num_splits: a power of two"
    d_p2 = triton.next_power_of_2(head_dim)
    rows = batch * num_heads * splits if splits > 1 else 1
    acc = torch.empty(rows, d_p2, dtype=torch.float32, device=q.device)
    m = torch.empty(rows, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    with triton_launch("paged_decode" if splits == 1 else "paged_decode_split"):
        _paged_decode_kernel[(batch, num_kv_heads, splits)](
            q, k_cache, v_cache, block_tables, ctx_lens, out, acc, m, l_sum, scale, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), out.stride(0),
            out.stride(1), GROUP=group, GROUP_P2=triton.next_power_of_2(group), HEAD_DIM=head_dim, D_P2=d_p2,
            BLOCK_SIZE=block_size, NUM_SPLITS=splits, BLOCKS_PER_SPLIT=triton.cdiv(block_tables.shape[1], splits),
            NUM_HEADS=num_heads)
    if splits > 1:
        with triton_launch("paged_decode_reduce"):
            _paged_decode_reduce_kernel[(batch, num_heads)](acc, m, l_sum, out, out.stride(0), out.stride(1),
                                                            HEAD_DIM=head_dim, D_P2=d_p2, NUM_SPLITS=splits,
                                                            NUM_HEADS=num_heads)
    return out
