"""``ModelConfig``: the architecture facts the engine needs, parsed from a Hugging Face folder.

Reads ``config.json`` (both the classic ``rope_theta``/``rope_scaling`` keys and the newer
``rope_parameters``) and ``generation_config.json`` (EOS ids and sampling defaults).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

# The one list of supported architectures: each one's model family (``registry`` maps a family to
# its class) and the facts config.json does not state explicitly.
ARCHITECTURES = {
    "LlamaForCausalLM": dict(family="llama", qk_norm=False),
    "MistralForCausalLM": dict(family="llama", qk_norm=False),
    "Qwen2ForCausalLM": dict(family="llama", qk_norm=False),
    "Qwen3ForCausalLM": dict(family="llama", qk_norm=True),
    # mixtures of experts: the Llama layer with a sparse MoE block (rollout.layers.moe) in place of its MLP
    "Qwen3MoeForCausalLM": dict(family="llama", qk_norm=True),
    "Qwen2MoeForCausalLM": dict(family="llama", qk_norm=False),  # + a shared expert behind a sigmoid gate
    "MixtralForCausalLM": dict(family="llama", qk_norm=False),
    "OlmoeForCausalLM": dict(family="llama", qk_norm=False),  # q/k RMSNorm over the whole projection
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: Optional[int]
    checkpoint_dtype: Optional[str]
    eos_token_ids: tuple[int, ...] = ()
    generation_defaults: dict = field(default_factory=dict)
    # mixtures of experts (0 experts: dense): experts, experts a token is routed to, each expert's MLP width,
    # whether the k routing weights are renormalised, and the layers whose MLP is the sparse block
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: every token also through a shared expert (0: none)
    qk_norm_full: bool = False  # OLMoE: q and k RMS-normalised over the whole projection (all heads at once)
    clip_qkv: Optional[float] = None  # OLMoE: q, k and v clamped to +-clip_qkv after the projection

    @staticmethod
    def from_pretrained(model_path: str) -> ModelConfig:
        path = os.path.join(model_path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json in {model_path!r}: pass a Hugging Face model folder")
        with open(path) as f:
            hf = json.load(f)
        gen = {}
        gen_path = os.path.join(model_path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                gen = json.load(f)
        return ModelConfig.from_dict(hf, gen)

    @staticmethod
    def from_dict(hf: dict[str, Any], gen: Optional[dict[str, Any]] = None) -> ModelConfig:
        gen = gen or {}
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        bias = bool(hf.get("attention_bias", False))
        qkv_bias, o_bias = (True, False) if arch == "Qwen2ForCausalLM" else (bias, bias)
        if arch == "Qwen2MoeForCausalLM":  # (transformers v5 names it qkv_bias; the hub's configs predate it)
            qkv_bias, o_bias = bool(hf.get("qkv_bias", True)), False
        window = hf.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
            if hf.get("use_sliding_window"):
                raise ValueError(f"{arch} with use_sliding_window=true is not supported (per-layer windows)")
            window = None
        eos = gen.get("eos_token_id", hf.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                    if gen.get(k) is not None}
        if gen.get("do_sample") is False:
            defaults["temperature"] = 0.0
        moe: dict[str, Any] = {}
        layers = hf["num_hidden_layers"]
        experts = hf.get("num_experts") or hf.get("num_local_experts")  # the hub's name; transformers v5 writes the other
        if arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM") and experts:
            skip, step = set(hf.get("mlp_only_layers") or ()), hf.get("decoder_sparse_step", 1) or 1
            moe = dict(num_experts=experts, num_experts_per_tok=hf["num_experts_per_tok"],
                       moe_intermediate_size=hf["moe_intermediate_size"],
                       norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                       moe_layers=tuple(i for i in range(layers) if i not in skip and (i + 1) % step == 0),
                       shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or 0
                       if arch == "Qwen2MoeForCausalLM" else 0)
        elif arch == "OlmoeForCausalLM":
            moe = dict(num_experts=experts, num_experts_per_tok=hf["num_experts_per_tok"],
                       moe_intermediate_size=hf["intermediate_size"],
                       norm_topk_prob=bool(hf.get("norm_topk_prob", False)), moe_layers=tuple(range(layers)),
                       qk_norm_full=True, clip_qkv=hf.get("clip_qkv"))
        elif arch == "MixtralForCausalLM":
            moe = dict(num_experts=hf["num_local_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                       moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True,
                       moe_layers=tuple(range(layers)))
        return ModelConfig(
            **moe,
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=ARCHITECTURES[arch]["qk_norm"],
            sliding_window=window,
            checkpoint_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            eos_token_ids=eos_ids,
            generation_defaults=defaults,
        )

    def check_tp_size(self, tp_size: int) -> None:
        valid = self.valid_tp_sizes(16)
        if tp_size not in valid:
            experts = f", experts' intermediate {self.moe_intermediate_size}" if self.num_experts else ""
            raise ValueError(f"tp_size={tp_size} does not split {self.architecture} ({self.num_attention_heads} heads, "
                             f"{self.num_key_value_heads} KV heads, intermediate {self.intermediate_size}{experts}) "
                             f"evenly; valid TP sizes: {valid}")

    def valid_tp_sizes(self, limit: int = 64) -> list[int]:
        """TP sizes this model splits evenly over (KV heads may be replicated; a mixture of experts' intermediate
        dimension too, and the dense one only where some layer is dense)."""
        dense = not self.num_experts or len(self.moe_layers) < self.num_hidden_layers
        ok = []
        for tp in range(1, limit + 1):
            kv_ok = self.num_key_value_heads % tp == 0 or (tp % self.num_key_value_heads == 0 and not self.qk_norm_full)
            mlp_ok = (not dense or self.intermediate_size % tp == 0) and \
                (not self.num_experts or self.moe_intermediate_size % tp == 0)
            if (self.num_attention_heads % tp == 0 and mlp_ok
                    and (self.num_attention_heads * self.head_dim) % tp == 0 and kv_ok):
                ok.append(tp)
        return ok
