"""Maps Hugging Face ``architectures`` names to model classes."""

from __future__ import annotations

import torch

from rollout.models.config import ModelConfig
from rollout.models.llama import LlamaForCausalLM

_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
SUPPORTED_ARCHITECTURES = tuple(_REGISTRY)


def build_model(cfg: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
    return _REGISTRY[cfg.architecture](cfg, dtype)
