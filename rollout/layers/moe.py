"""A sparse mixture-of-experts block (Qwen3-MoE, Mixtral): a router picks each token's top-k experts, each
expert is a SiLU-gated MLP, their outputs summed with the routing weights.

Routing as Hugging Face computes it: router logits in the model's dtype, softmax in fp32, top-k, the k weights
renormalised where the model says so (``norm_topk_prob``; Mixtral always), cast back to the model's dtype.
The experts' weights lie in two 3-D parameters (``w13``: every expert's gate rows then up rows; ``w2``: its
down projection), loaded from the checkpoints' per-expert names (``experts.{e}.gate_proj.weight`` ...; Mixtral's
``block_sparse_moe`` block and ``w1`` / ``w3`` / ``w2``: ``LlamaForCausalLM.module_renames``, ``names``) as
shards of them. Tokens are grouped by expert: one GEMM per expert and projection over the tokens routed
there, summed back in the order ``transformers`` sums them (the experts in index order).

One TP rank for now (expert tensor parallelism is the next step of this family; a TP engine refuses it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout.layers.linear import LoadSlice, attach_loader_hooks


class _Experts(nn.Module):
    """``w13`` [E, 2I, H] and ``w2`` [E, H, I], each expert's pieces loaded by their Hugging Face names."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.w13 = attach_loader_hooks(nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, dtype=dtype),
                                                    requires_grad=False), self)
        self.w2 = attach_loader_hooks(nn.Parameter(torch.empty(num_experts, hidden, inter, dtype=dtype),
                                                   requires_grad=False), self)
        # the Hugging Face names of each parameter's pieces (relative to this module) and their shard ids
        gate, up, down = names  # the checkpoint's names of an expert's three linears
        self.w13.hf_pieces = [(f"{e}.{n}.weight", (e, p)) for e in range(num_experts) for n, p in ((gate, "gate"),
                                                                                                     (up, "up"))]
        self.w2.hf_pieces = [(f"{e}.{down}.weight", (e, "down")) for e in range(num_experts)]

    def shard_shape(self, param, shard_id=None) -> tuple[int, ...]:
        if shard_id is None:
            return tuple(param.shape)
        return (self.hidden, self.inter) if shard_id[1] == "down" else (self.inter, self.hidden)

    def _view(self, param, shard_id) -> torch.Tensor:
        if shard_id is None:
            return param.data
        e, piece = shard_id
        if piece == "down":
            return param.data[e]
        return param.data[e].narrow(0, 0 if piece == "gate" else self.inter, self.inter)

    def load_slice(self, param, shard_id=None) -> LoadSlice:
        return LoadSlice(self._view(param, shard_id))

    def local_part(self, param, shard_id=None) -> torch.Tensor:
        return self._view(param, shard_id)

    def full_from_parts(self, parts: list[torch.Tensor], shard_id=None) -> torch.Tensor:
        return parts[0]  # one TP rank


class SparseMoe(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden: int, inter: int, norm_topk_prob: bool,
                 dtype: torch.dtype, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.inter = top_k, norm_topk_prob, inter
        self.gate = nn.Linear(hidden, num_experts, bias=False, dtype=dtype)
        self.gate.weight.requires_grad_(False)
        self.experts = _Experts(num_experts, hidden, inter, dtype, names)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each token's top-k experts [T, k], their weights [T, k] in x's dtype)."""
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(logits.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():  # ascending, as transformers visits them
            slot, token = torch.where((experts == e).t())  # by slot, then token: transformers' order
            gate, up = F.linear(x[token], self.experts.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.experts.w2[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out
