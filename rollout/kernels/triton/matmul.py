"""The batch-invariant mode's GEMM on the CUDA kernel plan (Triton): ``y = x W^T (+ b)`` with one fixed tile
shape and no split of k, so an output's sum runs over k in one order, in one program, whatever the number
of rows — a row's result does not depend on the batch it came in (cuBLAS picks its kernel, and may split k,
by the row count). fp32 accumulation, one rounding to x's dtype (to nearest even, on the bits: ``fused._rounded``); the bias
added in fp32 before it.

Under Triton's interpreter (``TRITON_INTERPRET=1``, how the suite runs it on a CPU) the tiles' dot products
take fp32 operands: each tile is one fixed-shape product, as on the GPU.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from rollout.kernels.audit import triton_launch
from rollout.kernels.triton.fused import _rounded

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                   FP32_DOT: tl.constexpr, BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K),
                    other=0.0)
        if FP32_DOT:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], _rounded(acc, BF16).to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, each output summed over k in one fixed order whatever the rows."""
    rows = x.reshape(-1, x.shape[-1])
    rows = rows if rows.is_contiguous() else rows.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    m, k = rows.shape
    n = w.shape[0]
    y = rows.new_empty(m, n)
    if m:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        with triton_launch("invariant_linear"):
            _linear_kernel[grid](rows, w, bias if bias is not None else w, y, m, n, k, rows.stride(0), w.stride(0),
                                 y.stride(0), HAS_BIAS=bias is not None,
                                 FP32_DOT=_INTERPRETED or rows.dtype == torch.float32,
                                 BF16=rows.dtype == torch.bfloat16, BM=BLOCK_M, BN=BLOCK_N,
                                 BK=BLOCK_K)
    return y.view(*x.shape[:-1], n)
