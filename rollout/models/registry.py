"""Maps a model family (``ModelConfig``'s ``ARCHITECTURES``) to its class."""

from __future__ import annotations

import torch

from rollout.kernels.choice import KernelPlan
from rollout.models.config import ARCHITECTURES, ModelConfig
from rollout.models.llama import LlamaForCausalLM

_FAMILIES = {"llama": LlamaForCausalLM}


def build_model(cfg: ModelConfig, dtype: torch.dtype, kernels: KernelPlan = KernelPlan()) -> torch.nn.Module:
    """The model of ``cfg``'s family, its modules running the kernels ``kernels`` says serve (default: torch's)."""
    return _FAMILIES[ARCHITECTURES[cfg.architecture]["family"]](cfg, dtype, kernels)
