"""The LoRA term of a mixed batch in one kernel launch per linear (Triton): every adapter's rows at once.

For a batch whose rows run on several adapters (and on none), one launch adds ``(x_s a_s^T) b_s^T``
to the base output's rows of each adapter slot ``s`` (``LoraSlots``' fused ``a`` [R, in] and ``b``
[out, R], fp32), the segmented-GEMM shape of Punica / S-LoRA: a program per (segment, block of its
rows, block of output columns) finds its adapter's matrices through per-linear tables of addresses
indexed by slot, computes the shrink ``x a^T`` over the input in fp32 and the expand into its output
block, adds it to ``y`` in fp32 and rounds once to ``y``'s dtype — as the torch path does. Products run
in IEEE fp32 (no TF32): greedy tokens must not move. The batch's segments (``LoraBatch.segments``) are
built once per forward and shared by every linear. Used on CUDA (``lora_backend``); tested on CPU under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.kernels.audit import triton_launch

BLOCK_M = 16  # rows per program (tl.dot needs 16)
BLOCK_N = 64  # output columns per program
BLOCK_K = 64  # input features per step of the shrink


@triton.jit
def _lora_segments_kernel(x_ptr, y_ptr, rows_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, a_table, b_table,
                          rank_table, stride_x, stride_y, IN, OUT, R_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    seg = tl.program_id(0)
    mb = tl.program_id(1)
    nb = tl.program_id(2)
    n_rows = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg)
    rank = tl.load(rank_table + slot)  # 0: this linear holds nothing in that slot
    if (mb * BLOCK_M < n_rows) & (rank > 0):
        start = tl.load(seg_start_ptr + seg)
        a_ptr = tl.load(a_table + slot).to(tl.pointer_type(tl.float32))
        b_ptr = tl.load(b_table + slot).to(tl.pointer_type(tl.float32))
        m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < n_rows
        rows = tl.load(rows_ptr + start + m, mask=m_ok, other=0).to(tl.int64)
        r = tl.arange(0, R_P2)
        r_ok = r < rank
        t = tl.zeros([BLOCK_M, R_P2], dtype=tl.float32)
        for k0 in range(0, IN, BLOCK_K):  # shrink: x a^T over the input, in fp32
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < IN
            xb = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                         other=0.0).to(tl.float32)
            ab = tl.load(a_ptr + r[:, None] * IN + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            t += tl.dot(xb, tl.trans(ab), input_precision="ieee")
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < OUT
        bb = tl.load(b_ptr + n[:, None] * rank + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        out = tl.dot(t, tl.trans(bb), input_precision="ieee")  # expand: this block of output columns
        mask = m_ok[:, None] & n_ok[None, :]
        y_at = y_ptr + rows[:, None] * stride_y + n[None, :]
        y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_at, (y + out).to(y_ptr.dtype.element_ty), mask=mask)


def lora_segments(y: torch.Tensor, x: torch.Tensor, segments, tables) -> None:
    """Add every segment's adapter term to ``y`` [N, out] in place; ``x`` [N, in]. ``segments``:
    (rows [T] int32 — each segment's batch rows back to back, starts [G], lengths [G], slots [G],
    the longest segment); ``tables``: (a addresses, b addresses, ranks) by slot, and the largest rank."""
    rows, starts, lens, slots, longest = segments
    (a_table, b_table, rank_table), top_rank = tables
    if not longest:
        return
    assert x.stride(-1) == 1 and y.stride(-1) == 1
    grid = (starts.numel(), triton.cdiv(longest, BLOCK_M), triton.cdiv(y.shape[1], BLOCK_N))
    with triton_launch("lora_segments"):
        _lora_segments_kernel[grid](x, y, rows, starts, lens, slots, a_table, b_table, rank_table, x.stride(0),
                                    y.stride(0), x.shape[1], y.shape[1],
                                    R_P2=max(16, triton.next_power_of_2(top_rank)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                    BLOCK_K=BLOCK_K)
