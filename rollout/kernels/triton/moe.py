"""A mixture of experts' forward on the CUDA kernel plan (Triton), in the style of vLLM's and SGLang's fused MoE:
every (token, routed expert) pair is grouped by expert into blocks of ``BLOCK_M`` rows, and one launch per
projection computes every block's rows against its expert's weights — the gate/up GEMM, SiLU·up, the down GEMM
scaled by the routing weight — then the k rows of each token are summed.

No host synchronisation: the grouping is computed on the device (a stable sort of the routed ids, per-expert
counts by ``scatter_add``, each expert's run padded to whole blocks) into buffers sized by the most blocks any
routing can need, and a program whose block lies past the routing's last one returns at once — so a decode step
with it can be captured in a CUDA graph. fp32 accumulation, one rounding to the activations' dtype per GEMM.

Under Triton's interpreter (``TRITON_INTERPRET=1``, how the suite runs it on a CPU) the tiles' dot products take
fp32 operands.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from rollout.kernels.audit import triton_launch

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _grouped_kernel(a_ptr, w_ptr, out_ptr, rows_ptr, block_expert_ptr, num_blocks_ptr, scale_ptr, N, K, top_k,
                    num_rows, stride_am, stride_we, stride_wn, stride_om, A_PER_TOKEN: tl.constexpr,
                    SCALE: tl.constexpr, FP32_DOT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr):
    """out[r] = a[row r's input] @ w[e]^T (x scale[r]) for the rows r of block ``program_id(0)``, all routed
    to expert e; rows are (token, slot) pairs t * top_k + s, padding rows are ``num_rows``."""
    pid_b = tl.program_id(0)
    if pid_b >= tl.load(num_blocks_ptr):
        return
    pid_n = tl.program_id(1)
    rows = tl.load(rows_ptr + pid_b * BM + tl.arange(0, BM))
    valid = rows < num_rows
    a_rows = rows // top_k if A_PER_TOKEN else rows  # the gate/up GEMM reads the token's activations
    expert = tl.load(block_expert_ptr + pid_b).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :], mask=valid[:, None] & (kk[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + expert * stride_we + rn[None, :] * stride_wn + kk[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if FP32_DOT:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc)
    if SCALE:
        acc = acc * tl.load(scale_ptr + rows, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (rn[None, :] < N))


def group_by_expert(topk_ids: torch.Tensor, num_experts: int, block: int = BLOCK_M):
    """(rows [max_blocks * block]: each expert's (token, slot) rows in token order, each expert's run padded to
    whole blocks with ``T * k``; the expert of each block [max_blocks]; the number of blocks in use, a one-element
    device tensor). Sized by the most blocks any routing of these T x k pairs can need: no host sync."""
    flat = topk_ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    max_blocks = triton.cdiv(n, block) + num_experts
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    start, pad_start = torch.cumsum(counts, 0) - counts, torch.cumsum(padded, 0) - padded
    order = torch.sort(flat, stable=True).indices  # (token, slot) rows by expert, tokens in order within each
    expert_of = flat[order]
    pos = pad_start[expert_of] + torch.arange(n, device=dev) - start[expert_of]
    rows = torch.full((max_blocks * block,), n, dtype=torch.long, device=dev).scatter_(0, pos, order)
    block_end = torch.cumsum(padded // block, 0)  # each expert's blocks end here
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=dev), right=True)
    return rows, block_expert.clamp_(max=num_experts - 1), block_end[-1:]


def _grouped(a: torch.Tensor, w: torch.Tensor, rows, block_expert, num_blocks, n_rows: int, top_k: int,
             per_token: bool, scale=None) -> torch.Tensor:
    e, n, k = w.shape
    out = a.new_empty(n_rows, n)
    grid = (block_expert.numel(), triton.cdiv(n, BLOCK_N))
    with triton_launch("fused_moe"):
        _grouped_kernel[grid](a, w, out, rows, block_expert, num_blocks, scale if scale is not None else a, n, k,
                              top_k, n_rows, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                              A_PER_TOKEN=per_token, SCALE=scale is not None,
                              FP32_DOT=_INTERPRETED or a.dtype == torch.float32, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> torch.Tensor:
    """sum over a token's k experts e of weight * (SiLU(x W_gate[e]^T) * x W_up[e]^T) W_down[e]^T: ``x`` [T, H],
    ``w13`` [E, 2I, H] (gate rows, then up rows), ``w2`` [E, H, I], ``topk_ids`` / ``topk_weights`` [T, k]."""
    t, k = topk_ids.shape
    x = x if x.is_contiguous() else x.contiguous()
    if t == 0:
        return torch.zeros_like(x)
    rows, block_expert, num_blocks = group_by_expert(topk_ids, w13.shape[0])
    gate_up = _grouped(x, w13, rows, block_expert, num_blocks, t * k, k, per_token=True)
    gate, up = gate_up.chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate.float()) * up.float()).to(x.dtype)
    scale = topk_weights.reshape(-1).float().contiguous()
    down = _grouped(act, w2, rows, block_expert, num_blocks, t * k, k, per_token=False, scale=scale)
    return down.view(t, k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)
