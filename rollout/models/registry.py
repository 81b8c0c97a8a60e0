"""Maps a model family (``ModelConfig``'s ``ARCHITECTURES``) to its class."""

from __future__ import annotations

import torch

from rollout.models.config import ARCHITECTURES, ModelConfig
from rollout.models.llama import LlamaForCausalLM

_FAMILIES = {"llama": LlamaForCausalLM}


def build_model(cfg: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
    return _FAMILIES[ARCHITECTURES[cfg.architecture]["family"]](cfg, dtype)
