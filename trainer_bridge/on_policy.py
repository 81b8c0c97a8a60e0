"""True on-policy: the trainer's logprobs are the engine's, bit for bit.

``engine_logprobs(model, seqs, prompt_lens, temperature)`` runs the trainer's Hugging Face Llama-family
model (bare, or inside a DeepSpeed engine at any ZeRO stage) the way the rollout engine runs it in its
batch-invariant mode (``deterministic=True``): the engine's layer sequence — RMSNorm, the q/k/v, o, gate/up
and down GEMMs, rotary with the K/V write, attention of every row over its own context from a paged
cache, SiLU·up, the residual adds, the final norm, the LM head in the model's dtype widened to fp32,
``logits / T`` and the sampler's logprob of the token — through the engine's own kernels and tables
(``rollout.kernels.autograd``: each forward the engine's kernel, each backward the standard gradient of
the same math; ``rollout.layers.rotary.RotaryEmbedding``). Every sequence is one run of rows, all in one
forward: the kernels are batch-invariant, so packing changes no bit.

The module tree is walked and each leaf module is called (``embed_tokens``, each linear, each norm), so
DeepSpeed ZeRO-3 gathers a module's parameters in its hooks exactly as in a plain forward; only the leaf
modules' own math is replaced, for the duration of the call.

What must hold for the bits to match (checked or documented): the engine serves with
``deterministic=True`` at TP=1 (a TP=2 engine splits each row-parallel sum in two); the sampling is
temperature only (no top-k / top-p / min-p / penalties: their masks are replayed by
``trainer_bridge.replay`` in torch, within tolerance); no LoRA adapter on the trainer's model.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch import nn

from rollout.kernels import autograd as K
from rollout.layers.rotary import RotaryEmbedding, apply_rotary
from rollout.layers.sampler import dist_logprob
from rollout.models.config import ModelConfig
from trainer_bridge.push import unwrapped

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def _zero3(model: nn.Module) -> bool:
    """Whether DeepSpeed partitions the model's parameters (ZeRO-3: gathered per module, in its hooks)."""
    from deepspeed import DeepSpeedEngine

    return isinstance(model, DeepSpeedEngine) and model.zero_optimization_stage() == 3


def check_model(model: nn.Module, triton: bool = False) -> ModelConfig:
    """The model's config as the engine reads it; ValueError naming what the true on-policy forward lacks."""
    from peft import PeftModel

    hf: Any = unwrapped(model)
    if isinstance(hf, PeftModel):
        raise ValueError("true on-policy: a LoRA (peft) model is not supported; train the full weights")
    cfg = ModelConfig.from_dict(hf.config.to_dict())
    if cfg.architecture not in SUPPORTED:
        raise ValueError(f"true on-policy: architecture {cfg.architecture} not supported ({', '.join(SUPPORTED)})")
    from rollout.kernels.cpu import build

    if not triton and build.kernels() is None:
        raise ValueError("true on-policy needs the engine's C++ kernels, which cannot be built here (no compiler)")
    return cfg


def gemm_kernel(model: nn.Module, cfg: ModelConfig, triton: bool = False) -> str:
    """The batch-invariant GEMM kernel an engine of this model runs here (``rollout.kernels.cpu.invariant``),
    decided from the engine's weight shapes (q/k/v and gate/up fused, the LM head) as the engine decides it;
    on the CUDA kernel plan (``triton``), its Triton GEMM."""
    from rollout.kernels.cpu import invariant

    if triton:
        return "triton"
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = [((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d, h), (h, cfg.num_attention_heads * d),
              (2 * cfg.intermediate_size, h), (h, cfg.intermediate_size), (cfg.vocab_size, h)]
    hf: Any = unwrapped(model)
    kernel = invariant.gemm_kernel(hf.model.embed_tokens.weight.dtype, shapes)
    assert kernel is not None  # check_model: the C++ kernels are built
    return kernel


def _fused_weight(modules: list[Any]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The engine's packed weight (and bias) of these Hugging Face linears: their rows one after the other."""
    weight = torch.cat([m.weight for m in modules])
    bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules])
    return weight, bias


@contextlib.contextmanager
def _engine_math(hf: Any, cfg: ModelConfig, kernel: str, zero3: bool = False):
    """The leaf modules' forwards replaced by the engine's kernels for the duration (their hooks untouched):
    ``q_proj`` computes the engine's packed q/k/v projection and ``gate_proj`` its gate/up one (``k_proj``,
    ``v_proj`` and ``up_proj`` are not called: under ZeRO-3 their parameters are registered as external
    parameters of the module that reads them, so DeepSpeed gathers them there)."""
    triton = kernel == "triton"
    patched: list[Any] = []

    def patch(module: Any, fn) -> None:
        module.forward = fn  # an instance attribute: nn.Module.__call__ runs it between the module's hooks
        patched.append(module)

    def fused(owner: Any, modules: list[Any]):
        for m in modules[1:] if zero3 else ():  # ZeRO-3: gathered with the module that reads them
            from deepspeed.runtime.zero import register_external_parameter

            for p in m.parameters(recurse=False):
                register_external_parameter(owner, p)

        def forward(x: torch.Tensor) -> torch.Tensor:
            weight, bias = _fused_weight(modules)
            return K.linear(x, weight, bias, kernel)

        return forward

    def row_parallel(m: Any):  # its bias added after the GEMM, in the model's dtype, as the engine adds it
        return lambda x: K.linear(x, m.weight, None, kernel) if m.bias is None else \
            K.linear(x, m.weight, None, kernel) + m.bias

    for layer in hf.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        patch(attn.q_proj, fused(attn.q_proj, [attn.q_proj, attn.k_proj, attn.v_proj]))
        patch(mlp.gate_proj, fused(mlp.gate_proj, [mlp.gate_proj, mlp.up_proj]))
        patch(attn.o_proj, row_parallel(attn.o_proj))
        patch(mlp.down_proj, row_parallel(mlp.down_proj))
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if cfg.qk_norm:
            norms += [attn.q_norm, attn.k_norm]
        for norm in norms:
            patch(norm, lambda x, m=norm: K.rms_norm(x, m.weight, cfg.rms_norm_eps, triton))
    patch(hf.model.norm, lambda x, m=hf.model.norm: K.rms_norm(x, m.weight, cfg.rms_norm_eps, triton))
    patch(hf.lm_head, lambda x, m=hf.lm_head: K.linear(x, m.weight, None, kernel))
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def _on_cuda_plan(hf: Any, triton: Optional[bool]) -> bool:
    return hf.model.embed_tokens.weight.is_cuda if triton is None else triton


_ROTARY: dict = {}


def _rotary(cfg: ModelConfig, max_position: int) -> RotaryEmbedding:
    key = (cfg.head_dim, max_position, cfg.rope_theta, repr(cfg.rope_scaling))
    if key not in _ROTARY:
        _ROTARY.clear()
        _ROTARY[key] = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
    return _ROTARY[key]


def _hidden(hf: Any, cfg: ModelConfig, seqs: list[list[int]], block_size: int, triton: bool) -> torch.Tensor:
    """The final hidden states [sum of lengths, hidden] of whole sequences laid end to end (each from position
    0) as the engine computes them in its batch-invariant mode; inside ``_engine_math``."""
    lens = [len(s) for s in seqs]
    device = hf.model.embed_tokens.weight.device
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n) for n in lens])
    dtype = hf.model.embed_tokens.weight.dtype
    cos, sin = (t.to(device) for t in _rotary(cfg, max(cfg.max_position_embeddings, max(lens))).tables(positions, dtype))
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    scale = d ** -0.5
    t = len(ids)
    q_size, kv_size = heads * d, kv_heads * d
    h = hf.model.embed_tokens(ids)
    for layer in hf.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        x = layer.input_layernorm(h)
        qkv = attn.q_proj(x)  # the packed q/k/v projection (_engine_math)
        if cfg.qk_norm:  # normed per head, rotated in torch, then attended from the cache (the engine's path)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = apply_rotary(attn.q_norm(q.reshape(t, heads, d)), cos, sin)
            k = apply_rotary(attn.k_norm(k.reshape(t, kv_heads, d)), cos, sin)
            o = K.attention(q, k, v.reshape(t, kv_heads, d), lens, scale, cfg.sliding_window, block_size, triton)
        else:
            o = K.rope_attention(qkv, cos, sin, heads, kv_heads, lens, scale, cfg.sliding_window, block_size, triton)
        h = h + attn.o_proj(o)
        x = layer.post_attention_layernorm(h)
        h = h + mlp.down_proj(K.silu_mul(mlp.gate_proj(x), triton))  # gate_proj: the packed gate/up projection
    return hf.model.norm(h)


class _TokenLogprob(torch.autograd.Function):
    """The sampler's logprob of a drawn token (``rollout.layers.sampler.dist_logprob``), the softmax gradient."""

    @staticmethod
    def forward(ctx, dist, ids, fused):
        ctx.save_for_backward(dist, ids)
        return dist_logprob(dist, ids, fused)

    @staticmethod
    def backward(ctx, g):
        dist, ids = ctx.saved_tensors
        grad = -torch.softmax(dist, dim=-1)
        grad.scatter_add_(1, ids.unsqueeze(1), torch.ones_like(ids, dtype=grad.dtype).unsqueeze(1))
        return grad * g.unsqueeze(1), None, None


def engine_logprobs(model: nn.Module, seqs: list[list[int]], prompt_lens: list[int], temperature: float,
                    block_size: int = 16, logits_out: Optional[list] = None,
                    triton: Optional[bool] = None) -> list[torch.Tensor]:
    """Per sequence, the logprobs of its completion tokens (those past ``prompt_lens[i]``) as the engine
    reports them in its batch-invariant mode for sampling at ``temperature`` (differentiable).
    ``logits_out``: if a list, each completion's fp32 logits [T, V] (before the temperature) are appended.
    ``triton``: as an engine on the CUDA kernel plan (None: where the model lies on CUDA)."""
    hf: Any = unwrapped(model)
    triton = _on_cuda_plan(hf, triton)
    cfg = check_model(model, triton)
    rows: list[int] = []
    targets: list[int] = []
    starts = 0
    for s, p in zip(seqs, prompt_lens):
        rows += range(starts + p - 1, starts + len(s) - 1)
        targets += s[p:]
        starts += len(s)
    with _engine_math(hf, cfg, gemm_kernel(model, cfg, triton), _zero3(model)):
        hidden = _hidden(hf, cfg, seqs, block_size, triton)
        logits = hf.lm_head(hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=hidden.device))).float()
    dist = logits if temperature == 1.0 else \
        logits / torch.full((len(rows), 1), temperature, dtype=torch.float32, device=logits.device)
    # the CPU plan's sampler draws with its C++ kernel, the CUDA plan's with the torch formula
    lp = _TokenLogprob.apply(dist, torch.tensor(targets, dtype=torch.long, device=dist.device), not triton)
    out, at = [], 0
    for s, p in zip(seqs, prompt_lens):
        n = len(s) - p
        out.append(lp[at: at + n])
        if logits_out is not None:
            logits_out.append(logits[at: at + n])
        at += n
    return out
