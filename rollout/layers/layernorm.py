"""RMSNorm computed in fp32, as Hugging Face's Llama family does."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from rollout.kernels.cpu import ops
from rollout.layers.linear import LoadSlice, attach_loader_hooks, cat_parts
from rollout.layers.parallel_state import divide, get_tp_state, tp_all_reduce


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype = torch.float32, fused: bool = False,
                 triton: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype), requires_grad=False)
        self.fused = fused  # CPU: one C++ call (rollout.kernels.cpu.ops; KernelPlan.norm)
        self.triton = triton  # CUDA: one Triton launch, with the residual add before it (KernelPlan.triton)

    def add_forward(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) — the sum rounded to the model's dtype first, as a layer adds
        its residual; with no residual (the first layer), (norm(x), x)."""
        if self.triton:
            from rollout.kernels.triton.fused import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps)
        summed = x if residual is None else x + residual
        return self(summed), summed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton and x.dtype == self.weight.dtype:
            from rollout.kernels.triton.fused import add_rms_norm

            return add_rms_norm(x.reshape(-1, x.shape[-1]), None, self.weight, self.eps)[0].view(x.shape)
        if self.fused and x.dtype == self.weight.dtype and x.dtype in (torch.float32, torch.bfloat16):
            return ops.rms_norm(x, self.weight, self.eps)
        # torch.rms_norm is x * rsqrt(mean(x^2) + eps), bit for bit, in one call
        return self.weight * torch.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a width split across the TP ranks (OLMoE's q/k norms span every head of the projection):
    each rank holds its part of the weight; the sum of squares is all-reduced before the division."""

    def __init__(self, full_size: int, params_dtype: torch.dtype, eps: float):
        super().__init__()
        self.tp = get_tp_state()
        self.eps, self.full_size = eps, full_size
        self.local = divide(full_size, self.tp.tp_size, "normalised width")
        self.weight = attach_loader_hooks(nn.Parameter(torch.empty(self.local, dtype=params_dtype),
                                                       requires_grad=False), self)

    def shard_shape(self, param, shard_id=None) -> tuple[int, ...]:
        return (self.full_size,)

    def load_slice(self, param, shard_id=None) -> LoadSlice:
        if self.tp.tp_size == 1:
            return LoadSlice(param.data)
        return LoadSlice(param.data, 0, self.tp.tp_rank * self.local, self.local)

    def local_part(self, param, shard_id=None) -> torch.Tensor:
        return param.data

    def full_from_parts(self, parts: list[torch.Tensor], shard_id=None) -> torch.Tensor:
        return cat_parts(parts, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if self.tp.tp_size == 1:
            var = h.pow(2).mean(-1, keepdim=True)
        else:
            var = tp_all_reduce(h.pow(2).sum(-1, keepdim=True), self.tp) / self.full_size
        return self.weight * (h * torch.rsqrt(var + self.eps)).to(x.dtype)
