"""RMSNorm computed in fp32, as Hugging Face's Llama family does."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch.rms_norm is x * rsqrt(mean(x^2) + eps), bit for bit, in one call
        return self.weight * torch.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)
