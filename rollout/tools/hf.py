"""Reference facts from ``transformers`` (what a trainer holding the same model sees)."""

from __future__ import annotations

import torch


def hf_parameter_order(model_path: str) -> list[str]:
    """The weight names of the folder's transformers model in the model's own order (what a
    trainer's ``state_dict()`` lists; a safetensors file lists them alphabetically)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return list(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path)).state_dict())
