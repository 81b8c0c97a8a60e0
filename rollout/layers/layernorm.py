"""RMSNorm computed in fp32, as Hugging Face's Llama family does."""

from __future__ import annotations

import torch
from torch import nn

from rollout.kernels.cpu import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype = torch.float32, fused: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype), requires_grad=False)
        self.fused = fused  # CPU: one C++ call (rollout.kernels.cpu.ops; KernelPlan.norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dtype == self.weight.dtype and x.dtype in (torch.float32, torch.bfloat16):
            return ops.rms_norm(x, self.weight, self.eps)
        # torch.rms_norm is x * rsqrt(mean(x^2) + eps), bit for bit, in one call
        return self.weight * torch.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)
