"""One name map from a trainer's parameter names to Hugging Face names."""

from __future__ import annotations

# Wrappers that prefix parameter names: DeepSpeed / DDP ("module."), torch.compile ("_orig_mod."),
# FSDP ("_fsdp_wrapped_module."), activation checkpointing ("_checkpoint_wrapped_module.").
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def to_hf_name(name: str) -> str:
    """Strip every wrapper prefix, wherever it appears: ``module._orig_mod.model.x`` -> ``model.x``."""
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
            inner = "." + prefix
            if inner in name:
                name, changed = name.replace(inner, "."), True
    return name
