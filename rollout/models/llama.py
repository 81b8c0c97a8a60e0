"""The Llama family: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

The differences are flags in ``ModelConfig``; the module tree mirrors Hugging Face's names so the
loader maps checkpoint names with ``packed_modules_mapping`` alone.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from rollout.kernels.choice import KernelPlan
from rollout.kernels.cpu import fused, ops
from rollout.layers.attention import AttentionMetadata, PagedAttention
from rollout.layers.layernorm import RMSNorm, ShardedRMSNorm
from rollout.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from rollout.layers.moe import RoutingRecord, SparseMoe
from rollout.layers.rotary import RotaryEmbedding, apply_rotary
from rollout.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from rollout.models.config import ModelConfig

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def _triton_op(name: str):
    """A fused op of ``rollout.kernels.triton.fused`` (imported only where the plan runs Triton)."""
    from rollout.kernels.triton import fused as triton_fused

    return getattr(triton_fused, name)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, kernels: KernelPlan):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.qkv_bias, dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.local_heads, self.qkv_proj.local_kv_heads
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, dtype)
        self.q_norm: nn.Module
        self.k_norm: nn.Module
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, kernels.norm, kernels.triton)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, kernels.norm, kernels.triton)
        elif cfg.qk_norm_full:  # OLMoE: over every head of the projection at once
            self.q_norm = ShardedRMSNorm(cfg.num_attention_heads * cfg.head_dim, dtype, cfg.rms_norm_eps)
            self.k_norm = ShardedRMSNorm(cfg.num_key_value_heads * cfg.head_dim, dtype, cfg.rms_norm_eps)
        self.qk_norm, self.qk_norm_full, self.clip_qkv = cfg.qk_norm, cfg.qk_norm_full, cfg.clip_qkv
        # decode steps: rotary and the K/V write in one call (CPU: C++; CUDA: Triton)
        self.fused_rope = kernels.rope or kernels.triton
        self.rope_and_cache = _triton_op("rope_and_cache") if kernels.triton else ops.rope_and_cache
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim ** -0.5,
                                   triton=kernels.triton)

    def forward(self, rope, hidden, kv_cache, meta: AttentionMetadata):
        """rope: ``RotaryEmbedding.tables`` of this forward's positions."""
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if self.qk_norm_full:  # OLMoE: q and k normalised whole, then (where the model says) q, k, v clamped
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
            if self.clip_qkv is not None:
                qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        if self.fused_rope and meta.all_decode and meta.use_paged_kernel and not self.qk_norm:
            # a CPU decode step: rotary and the K/V write in one call, attention from the cache
            q = self.rope_and_cache(qkv, *rope, kv_cache[0], kv_cache[1], meta.slot_mapping, self.num_heads,
                                    self.num_kv_heads)
            return self.o_proj(self.attn.decode_from_cache(q, kv_cache[0], kv_cache[1], meta))
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rotary(self.q_norm(q.reshape(t, self.num_heads, self.head_dim)), *rope)
            k = apply_rotary(self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)), *rope)
        else:  # q and k lie side by side in qkv: rotated as one tensor
            qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim), *rope)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        return self.o_proj(self.attn(q, k, v, kv_cache[0], kv_cache[1], meta))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, kernels: KernelPlan, inter: Optional[int] = None):
        super().__init__()
        inter = inter or cfg.intermediate_size  # (a MoE block's shared expert has its own width)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter] * 2, cfg.mlp_bias, shard_ids=[0, 1],
                                                 params_dtype=dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, dtype)
        self.fused_act = kernels.silu or kernels.triton  # silu(gate) * up in one call (CPU: C++; CUDA: Triton)
        self.silu_mul = _triton_op("silu_mul") if kernels.triton else ops.silu_mul

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.fused_act:
            return self.down_proj(self.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, kernels: KernelPlan, index: int = 0):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, dtype, kernels)
        # a mixture of experts' sparse block where the model has one (rollout.layers.moe), else the dense MLP
        mixtral = cfg.architecture == "MixtralForCausalLM"
        shared = LlamaMLP(cfg, dtype, kernels, cfg.shared_expert_intermediate_size) \
            if cfg.shared_expert_intermediate_size and index in cfg.moe_layers else None  # Qwen2-MoE
        self.mlp: nn.Module = SparseMoe(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                        cfg.moe_intermediate_size, cfg.norm_topk_prob, dtype,
                                        ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj"), index,
                                        shared, kernels.triton, kernels.moe) \
            if index in cfg.moe_layers else LlamaMLP(cfg, dtype, kernels)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels.norm, kernels.triton)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels.norm,
                                                kernels.triton)

    def forward(self, rope, hidden, kv_cache, meta):
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward_carried(self, rope, hidden, residual, kv_cache, meta):
        """The layer with its residual adds carried into the next norm (each add and the RMSNorm after it
        one launch): ``hidden + residual`` is this layer's input; returns (mlp output, the residual it adds
        to). The same sums, in the same dtype, as ``forward``."""
        x, residual = self.input_layernorm.add_forward(hidden, residual)
        x, residual = self.post_attention_layernorm.add_forward(self.self_attn(rope, x, kv_cache, meta), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, kernels: KernelPlan):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, dtype, kernels, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels.norm, kernels.triton)
        self.carry_residual = kernels.triton  # each residual add fused into the norm after it
        self.fused_decode = kernels.layer  # CPU decode steps: each layer in one call (rollout.kernels.cpu.fused)
        self.fused_stack = kernels.stack  # the same, every layer in one call where the GEMM plans allow
        self.stack_tensors: dict = {}  # rollout.layers.fused.decode_stack's arguments, emptied by the runner
        self.routing: Optional[RoutingRecord] = None  # each slot's routed experts (enable_return_routed_experts)

    def forward(self, input_ids, positions, kv_caches: KVCaches, meta: AttentionMetadata):
        hidden = self.embed_tokens(input_ids)
        if self.routing is not None:
            self.routing.slots = meta.slot_mapping  # where each row's MoE layers record its experts
        rope = self.rotary.tables(positions, hidden.dtype)
        lora = self.layers[0].self_attn.qkv_proj.lora.context
        # adapters each on one run of rows (torch backend): each layer's C++ call adds their low-rank terms
        runs = () if lora is None or lora.batch is None else \
            lora.batch.runs(hidden.shape[0]) if lora.backend == "torch" else None
        # a plain CPU decode step: each layer in one C++ call (rollout.kernels.cpu.fused), the same bits
        one_call = self.fused_decode and meta.all_decode and meta.use_paged_kernel and runs is not None
        out = fused.decode_stack(self, rope, hidden, kv_caches, meta) if one_call and self.fused_stack and \
            not runs else None
        if out is not None:
            return self.norm(out)
        if self.carry_residual:
            residual = None
            for layer, kv in zip(self.layers, kv_caches):
                hidden, residual = layer.forward_carried(rope, hidden, residual, kv, meta)
            return self.norm.add_forward(hidden, residual)[0]
        for layer, kv in zip(self.layers, kv_caches):
            out = fused.decode_layer(layer, rope, hidden, kv, meta, runs) if one_call else None
            hidden = layer(rope, hidden, kv, meta) if out is None else out
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    # Hugging Face name piece -> (our parameter's module, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, kernels: KernelPlan = KernelPlan()):
        super().__init__()
        self.config = cfg
        # module names the checkpoint spells otherwise (ours -> theirs): Mixtral's sparse block
        self.module_renames = {"mlp": "block_sparse_moe"} if cfg.architecture == "MixtralForCausalLM" else {}
        self.model = LlamaModel(cfg, dtype, kernels)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, tied_to=tied)

    def forward(self, input_ids, positions, kv_caches: KVCaches, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids/positions: [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> [R, vocab_size] in fp32."""
        return self.lm_head(hidden).float()
