"""The batch-invariant kernels as differentiable functions, for a trainer whose loss must see the engine's
logprobs bit for bit (``trainer_bridge.on_policy``): the CPU plan's C++ kernels, or (``triton=True``) the
CUDA plan's Triton ones.

Each function's forward is the engine's own kernel on the same values (the batch-invariant GEMM,
``rollout.kernels.cpu.invariant``; RMSNorm; rotary with the K/V write and paged attention over each row's
context; SiLU·up); its backward is the standard one of the same math in torch operators
(``torch.autograd.grad`` of a reference computation in fp32, or the closed form), since these kernels
have no backward of their own. So the forward's bits are the engine's and the gradient is the usual
one of that function, as in slime's and vLLM's true-on-policy modes.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from rollout.kernels.cpu import invariant, ops


def _triton_fused():
    from rollout.kernels.triton import fused

    return fused


def _reference_grads(fn, inputs: tuple, grad_out: torch.Tensor) -> tuple:
    """Gradients of ``fn(*inputs)`` (recomputed in torch operators) against ``grad_out``, for the inputs
    that need them (None for the rest)."""
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) and x.is_floating_point()
                  else x for x in inputs]
        out = fn(*leaves)
        wanted = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True) if wanted else ())
    return tuple(next(grads) if isinstance(x, torch.Tensor) and x.requires_grad else None for x in leaves)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, kernel):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return invariant.linear(x, weight.detach(), None if bias is None else bias.detach(), kernel)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        gx = (g2 @ weight.to(g.dtype)).view(x.shape) if ctx.needs_input_grad[0] else None
        gw = (g2.t().float() @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        gb = g2.float().sum(0).to(g.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], kernel: str) -> torch.Tensor:
    """``F.linear`` through the batch-invariant mode's GEMM ``kernel`` (``rollout.kernels.cpu.invariant``:
    ``gemm_kernel`` of the model's shapes), as the engine's linears compute it in that mode."""
    return _Linear.apply(x, weight, bias, kernel)


def _rms_reference(x, weight, eps):
    return weight * torch.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, triton):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        if triton:
            flat = x.reshape(-1, x.shape[-1]).contiguous()
            return _triton_fused().add_rms_norm(flat, None, weight.detach(), eps)[0].view(x.shape)
        return ops.rms_norm(x.contiguous(), weight.detach(), eps)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gx, gw = _reference_grads(lambda a, w: _rms_reference(a, w, ctx.eps), (x, weight), g)
        return gx, gw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, triton: bool = False) -> torch.Tensor:
    """RMSNorm through the engine's kernel (``ops.rms_norm``; Triton's ``add_rms_norm``)."""
    return _RMSNorm.apply(x, weight, eps, triton)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, triton):
        ctx.save_for_backward(gate_up)
        return (_triton_fused().silu_mul if triton else ops.silu_mul)(gate_up.contiguous())

    @staticmethod
    def backward(ctx, g):
        (gate_up,) = ctx.saved_tensors

        def ref(gu):
            gate, up = gu.float().chunk(2, dim=-1)
            return F.silu(gate) * up

        return (*_reference_grads(ref, (gate_up,), g.float()), None)


def silu_mul(gate_up: torch.Tensor, triton: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up = [gate, up]`` through the engine's kernel (C++; Triton)."""
    return _SiluMul.apply(gate_up, triton)


def _attention_reference(q, k, v, seq_starts, seq_lens, scale, window):
    """Causal attention of each sequence over itself, in fp32 (q [T, Hq, D], k/v [T, Hkv, D])."""
    out = []
    group = q.shape[1] // k.shape[1]
    for start, n in zip(seq_starts, seq_lens):
        qs, ks, vs = (t[start: start + n].float().transpose(0, 1) for t in (q, k, v))
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        if window:
            mask &= ~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-window)
        o = F.scaled_dot_product_attention(qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), attn_mask=mask,
                                           scale=scale, enable_gqa=group > 1)
        out.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(out).flatten(1)


def _rotate(x, cos, sin):
    """``rollout.layers.rotary.apply_rotary`` in fp32 (the kernels' wing sits below the layers)."""
    return x.float() * cos.float() + x.float().roll(x.shape[-1] // 2, dims=-1) * sin.float()


class _PackedCache:
    """A scratch paged KV cache holding whole sequences, one after the other, in blocks of ``block_size``
    (each sequence starting on a block of its own), with each row's block table, context length and slot."""

    def __init__(self, seq_lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        blocks = [-(-n // block_size) for n in seq_lens]
        self.k = torch.zeros(sum(blocks), block_size, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        width = max(blocks)
        tables, lens, slots, first = [], [], [], 0
        for n, b in zip(seq_lens, blocks):
            table = torch.arange(first, first + width).clamp(max=first + b - 1)
            tables.append(table.expand(n, width))
            lens.append(torch.arange(1, n + 1))
            slots.append(first * block_size + torch.arange(n))
            first += b
        self.tables, self.lens, self.slots = (torch.cat(x).to(device) for x in (tables, lens, slots))


def _attend(q: torch.Tensor, cache: _PackedCache, scale: float, window: Optional[int], triton: bool) -> torch.Tensor:
    """Every row of q over its own context in ``cache``: the paged decode kernel (Triton's unsplit, or C++)."""
    if triton:
        from rollout.kernels.triton.paged_decode import paged_decode_attention

        return paged_decode_attention(q.contiguous(), cache.k, cache.v, cache.tables, cache.lens, scale, num_splits=1)
    return ops.paged_decode_attention(q.contiguous(), cache.k, cache.v, cache.tables, cache.lens, scale, window)


class _RopeAttention(torch.autograd.Function):
    """Rotary with the K/V write (``ops.rope_and_cache``) and attention of every row over its own context
    from that cache (``ops.paged_decode_attention``): the engine's batch-invariant attention."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, heads, kv_heads, seq_lens, scale, window, block_size, triton):
        t = qkv.shape[0]
        d = cos.shape[-1]
        cache = _PackedCache(seq_lens, block_size, kv_heads, d, qkv.dtype, qkv.device)
        rope = _triton_fused().rope_and_cache if triton else ops.rope_and_cache
        q = rope(qkv.contiguous(), cos, sin, cache.k, cache.v, cache.slots, heads, kv_heads)
        out = _attend(q, cache, scale, window, triton)
        ctx.save_for_backward(qkv, cos, sin)
        ctx.shape = (heads, kv_heads, d, list(seq_lens), scale, window)
        return out.view(t, heads * d)

    @staticmethod
    def backward(ctx, g):
        qkv, cos, sin = ctx.saved_tensors
        heads, kv_heads, d, seq_lens, scale, window = ctx.shape
        starts = [sum(seq_lens[:i]) for i in range(len(seq_lens))]

        def ref(x):
            t = x.shape[0]
            q, k, v = x.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
            q, k = _rotate(q.view(t, heads, d), cos, sin), _rotate(k.view(t, kv_heads, d), cos, sin)
            return _attention_reference(q, k, v.view(t, kv_heads, d), starts, seq_lens, scale, window)

        (gq,) = _reference_grads(ref, (qkv,), g.float())
        return gq, None, None, None, None, None, None, None, None, None


def rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                   seq_lens: list[int], scale: float, window: Optional[int] = None, block_size: int = 16,
                   triton: bool = False) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] of whole sequences laid end to end (``seq_lens``; positions from 0), cos /
    signed sin [T, 1, D] (``RotaryEmbedding.tables``) -> attention output [T, Hq D], each row attended
    causally over its sequence as the engine attends it in the batch-invariant mode."""
    return _RopeAttention.apply(qkv, cos, sin, heads, kv_heads, list(seq_lens), float(scale), window, block_size,
                                triton)


class _Attention(torch.autograd.Function):
    """Attention of rotated q / k and v (a model with q/k norms rotates them in torch, as the engine does):
    the K/V written into a scratch cache, every row attended over its own context from it."""

    @staticmethod
    def forward(ctx, q, k, v, seq_lens, scale, window, block_size, triton):
        t, heads, d = q.shape
        kv_heads = k.shape[1]
        cache = _PackedCache(seq_lens, block_size, kv_heads, d, q.dtype, q.device)
        cache.k.view(-1, kv_heads, d).index_copy_(0, cache.slots, k)
        cache.v.view(-1, kv_heads, d).index_copy_(0, cache.slots, v)
        out = _attend(q, cache, scale, window, triton)
        ctx.save_for_backward(q, k, v)
        ctx.shape = (list(seq_lens), scale, window)
        return out.view(t, heads * d)

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        seq_lens, scale, window = ctx.shape
        starts = [sum(seq_lens[:i]) for i in range(len(seq_lens))]
        gq, gk, gv = _reference_grads(lambda a, b, c: _attention_reference(a, b, c, starts, seq_lens, scale, window),
                                      (q, k, v), g.float())
        return gq, gk, gv, None, None, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], scale: float,
              window: Optional[int] = None, block_size: int = 16, triton: bool = False) -> torch.Tensor:
    """q [T, Hq, D], k / v [T, Hkv, D] (rotated) of whole sequences end to end -> [T, Hq D]."""
    return _Attention.apply(q, k, v, list(seq_lens), float(scale), window, block_size, triton)
