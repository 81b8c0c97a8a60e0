"""A sparse mixture-of-experts block (Qwen3-MoE, Mixtral): a router picks each token's top-k experts, each
expert is a SiLU-gated MLP, their outputs summed with the routing weights.

Routing as Hugging Face computes it: router logits in the model's dtype, softmax in fp32, top-k, the k weights
renormalised where the model says so (``norm_topk_prob``; Mixtral always), cast back to the model's dtype.
The experts' weights lie in two 3-D parameters (``w13``: every expert's gate rows then up rows; ``w2``: its
down projection), loaded from the checkpoints' per-expert names (``experts.{e}.gate_proj.weight`` ...; Mixtral's
``block_sparse_moe`` block and ``w1`` / ``w3`` / ``w2``: ``LlamaForCausalLM.module_renames``, ``names``) as
shards of them. Tokens are grouped by expert: one GEMM per expert and projection over the tokens routed
there, summed back in the order ``transformers`` sums them (the experts in index order) — on the CPU kernel
plan in one C++ call with the experts side by side over the threads (``rollout.kernels.cpu.ops.moe_experts``),
on the CUDA plan by the fused Triton kernel (``rollout.kernels.triton.moe``), else a loop of torch operators.

Tensor parallel as SGLang's TP MoE (``_Experts``): every rank routes every token (the router is replicated)
and computes its slice of each expert's intermediate dimension; one all-reduce per block.

Routed experts returned (SGLang's ``return_routed_experts``, R3's input): an engine started with
``enable_return_routed_experts`` keeps, beside each KV slot, the experts every layer routed that slot's token
to (``RoutingRecord``, its storage in the KV pool); a request that asks reads them for its positions when it
finishes. Prefix-cache hits and session turns carry the experts of the forward that computed the KV they reuse.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from rollout.layers.linear import LoadSlice, attach_loader_hooks
from rollout.layers.parallel_state import divide, get_tp_state, tp_all_reduce


class _Experts(nn.Module):
    """``w13`` [E, 2I, H] and ``w2`` [E, H, I], each expert's pieces loaded by their Hugging Face names.

    Tensor parallel as SGLang's TP MoE: each rank holds every expert's slice of the intermediate dimension,
    ``I / tp`` — its gate and up rows (column-parallel: ``w13`` [E, 2 I/tp, H], this rank's gate rows then its
    up rows) and the matching columns of down (row-parallel: ``w2`` [E, H, I/tp]); the block's output is
    all-reduced once."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.tp = get_tp_state()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.local = divide(inter, self.tp.tp_size, "moe_intermediate_size")
        self.w13 = attach_loader_hooks(nn.Parameter(torch.empty(num_experts, 2 * self.local, hidden, dtype=dtype),
                                                    requires_grad=False), self)
        self.w2 = attach_loader_hooks(nn.Parameter(torch.empty(num_experts, hidden, self.local, dtype=dtype),
                                                   requires_grad=False), self)
        # the Hugging Face names of each parameter's pieces (relative to this module) and their shard ids
        gate, up, down = names  # the checkpoint's names of an expert's three linears
        self.w13.hf_pieces = [(f"{e}.{n}.weight", (e, p)) for e in range(num_experts) for n, p in ((gate, "gate"),
                                                                                                     (up, "up"))]
        self.w2.hf_pieces = [(f"{e}.{down}.weight", (e, "down")) for e in range(num_experts)]
        # transformers v5 holds them fused under these names (a trainer's named_parameters): the same layout
        self.w13.hf_whole, self.w2.hf_whole = "gate_up_proj", "down_proj"
        # every rank's parts back into one tensor: which parameter they are of decides how (never their shapes,
        # which can coincide: w13's parts are [E, 2I/tp, H], w2's [E, H, I/tp])
        self.w13.full_from_parts = lambda parts, shard_id=None: self._full(parts, shard_id, fused=True)

    def shard_shape(self, param, shard_id=None) -> tuple[int, ...]:
        if shard_id is None:
            e, h, i = self.num_experts, self.hidden, self.inter
            return (e, 2 * i, h) if param is self.w13 else (e, h, i)
        return (self.hidden, self.inter) if shard_id[1] == "down" else (self.inter, self.hidden)

    def _view(self, param, shard_id) -> torch.Tensor:
        """This rank's part of the piece (the whole parameter for ``None``)."""
        if shard_id is None:
            return param.data
        e, piece = shard_id
        if piece == "down":
            return param.data[e]
        return param.data[e].narrow(0, 0 if piece == "gate" else self.local, self.local)

    def load_slice(self, param, shard_id=None) -> LoadSlice:
        dst, tp = self._view(param, shard_id), self.tp
        if tp.tp_size == 1:
            return LoadSlice(dst)
        start = tp.tp_rank * self.local
        if shard_id is None and param is self.w13:  # [E, 2I, H]: this rank's gate rows and its up rows
            e, h = self.num_experts, self.hidden
            return LoadSlice(dst.view(e, 2, self.local, h), 2, start, self.local, shape=(e, 2, self.inter, h))
        if shard_id is None:
            return LoadSlice(dst, 2, start, self.local)
        return LoadSlice(dst, 1 if shard_id[1] == "down" else 0, start, self.local)

    def local_part(self, param, shard_id=None) -> torch.Tensor:
        return self._view(param, shard_id)

    def full_from_parts(self, parts: list[torch.Tensor], shard_id=None) -> torch.Tensor:
        return self._full(parts, shard_id, fused=False)  # (w13's hook passes fused=True)

    def _full(self, parts: list[torch.Tensor], shard_id, fused: bool) -> torch.Tensor:
        """``parts`` of ``w13`` (``fused``) or ``w2`` from every rank, as the full Hugging Face tensor."""
        if len(parts) == 1:
            return parts[0]
        if shard_id is None and fused:  # w13: the gate rows of every rank, then their up rows
            e, h = self.num_experts, self.hidden
            return torch.cat([p.view(e, 2, self.local, h) for p in parts], 2).view(e, 2 * self.inter, h)
        if shard_id is None:
            return torch.cat(parts, 2)
        return torch.cat(parts, 1 if shard_id[1] == "down" else 0)


class RoutingRecord:
    """Each KV slot's routed experts: ``experts`` [slots, num_hidden_layers, top_k] int32 (layers without
    experts keep 0, as SGLang's capture leaves them). ``slots`` is the running forward's slot of each row (set
    by the model before its layers run): every MoE layer writes its rows' top-k there, inside the forward
    (no host sync; a CUDA graph replays the write with its own slot buffer)."""

    def __init__(self, experts: torch.Tensor):
        self.experts = experts
        self.slots: Optional[torch.Tensor] = None

    def write(self, layer: int, experts: torch.Tensor) -> None:
        if self.slots is not None:
            self.experts[self.slots, layer] = experts.to(torch.int32)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """The experts recorded at these slots, [len(slots), layers, top_k] int32 on the CPU."""
        return self.experts[slots.to(self.experts.device)].cpu()


class SparseMoe(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden: int, inter: int, norm_topk_prob: bool,
                 dtype: torch.dtype, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 layer_index: int = 0, shared_expert: Optional[nn.Module] = None, triton: bool = False,
                 cpu_kernel: bool = False):
        super().__init__()
        self.triton = triton  # the CUDA plan: the fused Triton kernels (rollout.kernels.triton.moe), no host sync
        # the CPU plan: the experts in one C++ call (rollout.kernels.cpu.ops.moe_experts); an expert of this
        # many rows or more takes F.linear (oneDNN) there, fewer the wing's small-batch GEMM
        self.cpu_kernel, self.linear_rows = cpu_kernel, _linear_rows(dtype) if cpu_kernel else 0
        self.top_k, self.norm_topk_prob, self.inter = top_k, norm_topk_prob, inter
        self.layer_index = layer_index
        # Qwen2-MoE: a dense MLP every token goes through, scaled by sigmoid(shared_expert_gate(x))
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, dtype=dtype)
            self.shared_expert_gate.weight.requires_grad_(False)
        self.record: Optional[RoutingRecord] = None  # with enable_return_routed_experts
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
        if self.record is not None:
            self.record.write(self.layer_index, experts)
        if self.triton:
            from rollout.kernels.triton.moe import fused_moe

            out = fused_moe(x, self.experts.w13, self.experts.w2, experts, weights)
        elif self.cpu_kernel:
            from rollout.kernels.cpu import ops

            out = ops.moe_experts(x, self.experts.w13, self.experts.w2, experts, weights, self.linear_rows)
        else:
            out = self._per_expert(x, experts, weights)
        out = tp_all_reduce(out, self.experts.tp)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _per_expert(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """One GEMM per expert and projection over the tokens routed there, summed back expert by expert in
        ascending order, as ``transformers`` sums them. The (token, slot) rows are grouped by expert with one
        stable sort and the experts' row counts read on the host once a layer; each expert then takes a slice."""
        k = experts.shape[1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.experts.num_experts).tolist()
        token = order // k
        rows, scale = x.index_select(0, token), weights.reshape(-1).index_select(0, order)[:, None]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            end = start + n
            gate, up = F.linear(rows[start:end], self.experts.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.experts.w2[e]) * scale[start:end]
            out.index_add_(0, token[start:end], y.to(out.dtype))
            start = end
        return out


def _linear_rows(dtype: torch.dtype) -> int:
    """From how many rows an expert's GEMMs take ``F.linear`` in the CPU kernel: 9 for fp32 (MKL) and for bf16
    where oneDNN has native bf16 GEMMs (AMX, AVX512-BF16); never elsewhere, where oneDNN widens bf16 on a slow
    path and the wing's GEMM serves every row count. Measured on a Xeon with AMX (Qwen3-30B-A3B's expert shape
    scaled down, 64 experts, bf16, 2 threads): the wing's GEMM is faster to 8 rows an expert, oneDNN from 9
    (benchmarks/NOTES.md)."""
    from rollout.kernels.cpu.capability import cpu_capability

    return 9 if dtype == torch.float32 or cpu_capability().onednn_bf16 else 1 << 62


def attach_routing_record(model: nn.Module, experts: torch.Tensor) -> RoutingRecord:
    """Every sparse block of ``model`` (its ``model.routing``: where each forward sets its slots) records into
    ``experts`` [slots, layers, top_k]."""
    record = RoutingRecord(experts)
    model.model.routing = record
    for module in model.modules():
        if isinstance(module, SparseMoe):
            module.record = record
    return record
