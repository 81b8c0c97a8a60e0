"""RMSNorm computed in fp32, as Hugging Face's Llama family does."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from rollout.kernels.cpu import ops


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
