"""The decoder layer's small ops fused, one Triton launch each (the CUDA path's ~10 launches a layer):

- ``add_rms_norm``: the residual add and the RMSNorm after it (``residual + x`` stored rounded to the
  model's dtype, as Hugging Face's layer stores it, then normalised in fp32 from the rounded sum);
- ``rope_and_cache``: rotary on q and k from one qkv row, k and v written to their cache slots, q returned;
- ``silu_mul``: ``silu(gate) * up`` of a ``[T, 2I]`` gate-up output.

Each rounds where the torch path rounds (a bf16 product or sum is rounded to bf16 before the next op), so a
bf16 model's values follow the unfused layer's; ``tests/test_gpu_path.py`` checks each against it under
Triton's interpreter on CPU. Launches go through ``rollout.kernels.audit.triton_launch`` (counted by a step
audit).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from rollout.kernels.audit import triton_launch


@triton.jit
def _rounded(x, BF16: tl.constexpr):
    """fp32 ``x`` rounded to the model's dtype (to nearest, ties to even) and held in fp32: where torch rounds
    a bf16 op's result. Done on the bits, so Triton's interpreter (whose fp32 -> bf16 cast truncates) and a
    GPU round alike; a store of the result to a bf16 tensor is then exact."""
    if BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps, n_cols, stride_x, stride_r, stride_o,
                         stride_ro, HAS_RESIDUAL: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    xf = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        xf = _rounded(xf + r, BF16)
        tl.store(res_out_ptr + row * stride_ro + cols, xf, mask=ok)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = _rounded(xf * rstd, BF16)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, _rounded(normed * w, BF16), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for x [T, H]; with no residual (the first layer) the norm of x
    and x itself."""
    t, h = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    res_in = residual if residual is not None else x
    with triton_launch("add_rms_norm"):
        _add_rms_norm_kernel[(t,)](x, res_in, weight, out, res_out, eps, h, x.stride(0), res_in.stride(0),
                                   out.stride(0), res_out.stride(0), HAS_RESIDUAL=residual is not None,
                                   BF16=x.dtype == torch.bfloat16, BLOCK=triton.next_power_of_2(h))
    return out, res_out


@triton.jit
def _rope_and_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                           stride_qkv, stride_cs, stride_qo_t, stride_qo_h, stride_slot, stride_kvh,
                           NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           D_P2: tl.constexpr, BF16: tl.constexpr):
    tok = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads, then v heads
    d = tl.arange(0, D_P2)
    ok = d < HEAD_DIM
    row = qkv_ptr + tok * stride_qkv + head * HEAD_DIM
    x = tl.load(row + d, mask=ok, other=0.0)
    slot = tl.load(slot_ptr + tok)
    if head >= NUM_HEADS + NUM_KV_HEADS:  # v: to the cache as it is
        kv_head = head - NUM_HEADS - NUM_KV_HEADS
        tl.store(v_cache_ptr + slot * stride_slot + kv_head * stride_kvh + d, x, mask=ok)
    else:
        half = HEAD_DIM // 2
        rolled = tl.load(row + (d + half) % HEAD_DIM, mask=ok, other=0.0)
        c = tl.load(cos_ptr + tok * stride_cs + d, mask=ok, other=0.0)
        s = tl.load(sin_ptr + tok * stride_cs + d, mask=ok, other=0.0)
        a = _rounded(x.to(tl.float32) * c.to(tl.float32), BF16)
        b = _rounded(rolled.to(tl.float32) * s.to(tl.float32), BF16)
        y = _rounded(a + b, BF16)
        if head < NUM_HEADS:
            tl.store(q_out_ptr + tok * stride_qo_t + head * stride_qo_h + d, y, mask=ok)
        else:
            tl.store(k_cache_ptr + slot * stride_slot + (head - NUM_HEADS) * stride_kvh + d, y, mask=ok)


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D]; cos / signed sin [T, 1, D] (``RotaryEmbedding.tables``, the qkv dtype);
    caches [blocks, block_size, Hkv, D]; slots [T] -> rotated q [T, Hq, D]; rotated k and v land in the cache."""
    t = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    cos2, sin2 = cos.reshape(t, head_dim), sin.reshape(t, head_dim)
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    with triton_launch("rope_and_cache"):
        _rope_and_cache_kernel[(t, num_heads + 2 * num_kv_heads)](
            qkv, cos2, sin2, q, k_cache, v_cache, slots, qkv.stride(0), cos2.stride(0), q.stride(0), q.stride(1),
            k_flat.stride(0), k_flat.stride(1), NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            D_P2=triton.next_power_of_2(head_dim), BF16=qkv.dtype == torch.bfloat16)
    return q


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BF16: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = _rounded(g / (1.0 + tl.exp(-g)), BF16)
    tl.store(out_ptr + row * stride_o + cols, _rounded(act * up.to(tl.float32), BF16), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> silu(gate) * up [T, I]."""
    t, two_i = gate_up.shape
    n = two_i // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    with triton_launch("silu_mul"):
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0),
                                                      BF16=gate_up.dtype == torch.bfloat16, BLOCK=block)
    return out
