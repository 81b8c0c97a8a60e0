"""Column- and row-parallel linear layers, with merged QKV and gate/up variants.

Every parameter carries ``weight_loader(param, full_tensor, shard_id=None)``: it takes the *full*
Hugging Face tensor, slices this rank's part and copies it in place, so storage never moves.
``shard_shape(param, shard_id)`` tells the loader what full shape to expect, so validation
happens before any copy; ``load_slice(param, shard_id)`` says where a full tensor lands (the
destination view and the part of the source), so the loader can batch many copies into one call.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

from rollout.kernels.cpu.packing import PackedWeight, packed_linear
from rollout.layers.lora import LoraSlots
from rollout.layers.parallel_state import divide, get_tp_state, tp_all_reduce

# hf_pieces / hf_whole: the checkpoint tensors one parameter holds, the name of all of them (rollout.layers.moe)
LOADER_HOOKS = ("weight_loader", "shard_shape", "load_slice", "local_part", "full_from_parts",
                "hf_pieces", "hf_whole")


class LoadSlice(NamedTuple):
    """Where a full Hugging Face tensor lands on this rank: ``dst`` (a view of the parameter)
    receives ``full.narrow(dim, start, length)`` (the whole tensor when ``dim`` is None), the full
    tensor first viewed as ``shape`` where given (a fused pair of pieces, narrowed in each);
    ``zero_tail`` (padding rows, if any) is zeroed."""

    dst: torch.Tensor
    dim: Optional[int] = None
    start: int = 0
    length: int = 0
    zero_tail: Optional[torch.Tensor] = None
    shape: Optional[tuple[int, ...]] = None

    def source(self, full: torch.Tensor) -> torch.Tensor:
        if self.shape is not None:
            full = full.reshape(self.shape)
        return full if self.dim is None else full.narrow(self.dim, self.start, self.length)

    def copy_from(self, full: torch.Tensor) -> None:
        copy_slices([(full, self)])


def cat_parts(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat`` of TP parts; one part (TP=1) is returned as it is, a view of the parameter."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def copy_slices(pairs, where=None) -> None:
    """Copy each full tensor's part into its slice's destination — ``where(dst)`` when given (e.g.
    the same region of a shadow buffer) — in one batched call; zero any padding rows."""
    dsts, srcs, tails = [], [], []
    for full, sl in pairs:
        dsts.append(sl.dst if where is None else where(sl.dst))
        srcs.append(sl.source(full))
        if sl.zero_tail is not None:
            tails.append(sl.zero_tail if where is None else where(sl.zero_tail))
    if dsts:
        torch._foreach_copy_(dsts, srcs)
    for tail in tails:
        tail.zero_()


def attach_loader_hooks(param: nn.Parameter, layer) -> nn.Parameter:
    """Give a parameter its layer's loader hooks (the loader only ever sees the parameter)."""
    param.weight_loader = lambda p, full, shard_id=None: layer.load_slice(p, shard_id).copy_from(full)
    param.load_slice = layer.load_slice
    param.shard_shape = layer.shard_shape
    param.local_part = layer.local_part  # this rank's slice of one (packed) piece
    param.full_from_parts = layer.full_from_parts  # every rank's local_part -> the full tensor
    return param


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split along its output rows; output stays sharded."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 shard_ids: Optional[list] = None, params_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.tp = tp = get_tp_state()
        self.tp_rank, self.tp_size = tp.tp_rank, tp.tp_size
        self.input_size = input_size
        self.output_sizes = list(output_sizes)  # full sizes of each packed piece
        self.local_sizes = [divide(s, self.tp_size, "linear output") for s in self.output_sizes]
        self.shard_ids = shard_ids  # None: one unpacked weight
        out_local = sum(self.local_sizes)
        self.weight = attach_loader_hooks(
            nn.Parameter(torch.empty(out_local, input_size, dtype=params_dtype), requires_grad=False), self)
        if bias:
            self.bias = attach_loader_hooks(
                nn.Parameter(torch.empty(out_local, dtype=params_dtype), requires_grad=False), self)
        else:
            self.register_parameter("bias", None)
        self.packed_weight: Optional[PackedWeight] = None  # set and cleared by the ModelRunner
        offsets = [sum(self.local_sizes[:i]) for i in range(len(self.local_sizes))]
        self.lora = LoraSlots(list(zip(offsets, self.local_sizes)))  # resident adapters (rollout.layers.lora)

    def _piece(self, shard_id) -> int:
        if self.shard_ids is None:
            if shard_id is not None:
                raise KeyError(f"unexpected shard {shard_id!r}")
            return 0
        return self.shard_ids.index(shard_id)

    def shard_shape(self, param: nn.Parameter, shard_id=None) -> tuple[int, ...]:
        full = self.output_sizes[self._piece(shard_id)]
        return (full, self.input_size) if param.dim() == 2 else (full,)

    def local_slice(self, shard_id) -> tuple[int, int, int]:
        """(offset in the local param, start in the full tensor, length) along dim 0."""
        i = self._piece(shard_id)
        local = self.local_sizes[i]
        return sum(self.local_sizes[:i]), self.tp_rank * local, local

    def load_slice(self, param: nn.Parameter, shard_id=None) -> LoadSlice:
        dst_off, src_off, n = self.local_slice(shard_id)
        dst = param.data.narrow(0, dst_off, n)
        if src_off == 0 and n == self.output_sizes[self._piece(shard_id)]:
            return LoadSlice(dst)
        return LoadSlice(dst, 0, src_off, n)

    def local_part(self, param: nn.Parameter, shard_id=None) -> torch.Tensor:
        dst_off, _, n = self.local_slice(shard_id)
        return param.data.narrow(0, dst_off, n)

    def full_from_parts(self, parts: list[torch.Tensor], shard_id=None) -> torch.Tensor:
        return cat_parts(parts, 0)

    def lora_piece(self, shard_id=None) -> int:
        """The piece of this linear's output a Hugging Face module's adapter applies to."""
        return self._piece(shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = packed_linear(x, self.weight, self.bias, self.packed_weight)
        batch = self.lora.active()
        return y if batch is None else self.lora.add(y, x, batch)


class QKVParallelLinear(ColumnParallelLinear):
    """Merged q/k/v projection. KV heads fewer than ``tp_size`` are replicated across ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 params_dtype: torch.dtype = torch.float32):
        tp_size = get_tp_state().tp_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.local_heads = divide(num_heads, tp_size, "num_attention_heads")
        if num_kv_heads >= tp_size:
            self.local_kv_heads = divide(num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            self.local_kv_heads = 1
            self.kv_replicas = divide(tp_size, num_kv_heads, "tp_size over num_key_value_heads")
        # Sizes as seen by ColumnParallelLinear: replicated KV counts as tp_size heads in all.
        kv_virtual = self.local_kv_heads * tp_size * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, kv_virtual, kv_virtual], bias,
                         shard_ids=["q", "k", "v"], params_dtype=params_dtype)
        self.full_kv_size = num_kv_heads * head_dim

    def shard_shape(self, param, shard_id=None):
        if shard_id in ("k", "v"):
            return (self.full_kv_size, self.input_size) if param.dim() == 2 else (self.full_kv_size,)
        return super().shard_shape(param, shard_id)

    def full_from_parts(self, parts, shard_id=None):
        if shard_id == "q":
            return cat_parts(parts, 0)
        return cat_parts(parts[:: self.kv_replicas], 0)  # replicated KV heads: one copy each

    def load_slice(self, param, shard_id=None) -> LoadSlice:
        if shard_id == "q":
            return super().load_slice(param, shard_id)
        dst_off, _, n = self.local_slice(shard_id)
        src_off = (self.tp_rank // self.kv_replicas) * self.local_kv_heads * self.head_dim
        dst = param.data.narrow(0, dst_off, n)
        return LoadSlice(dst) if src_off == 0 and n == self.full_kv_size else LoadSlice(dst, 0, src_off, n)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split along its input columns; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool, params_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.tp = tp = get_tp_state()
        self.tp_rank, self.tp_size = tp.tp_rank, tp.tp_size
        self.input_size, self.output_size = input_size, output_size
        self.local_in = divide(input_size, self.tp_size, "linear input")
        self.weight = attach_loader_hooks(
            nn.Parameter(torch.empty(output_size, self.local_in, dtype=params_dtype), requires_grad=False), self)
        if bias:
            self.bias = attach_loader_hooks(
                nn.Parameter(torch.empty(output_size, dtype=params_dtype), requires_grad=False), self)
        else:
            self.register_parameter("bias", None)
        self.packed_weight: Optional[PackedWeight] = None  # set and cleared by the ModelRunner
        self.lora = LoraSlots([(0, output_size)])  # resident adapters (rollout.layers.lora)

    def shard_shape(self, param, shard_id=None):
        return (self.output_size, self.input_size) if param.dim() == 2 else (self.output_size,)

    def load_slice(self, param, shard_id=None) -> LoadSlice:
        if param.dim() == 1 or self.tp_size == 1:  # bias is added once, after the reduction
            return LoadSlice(param.data)
        return LoadSlice(param.data, 1, self.tp_rank * self.local_in, self.local_in)

    def local_part(self, param, shard_id=None):
        return param.data

    def full_from_parts(self, parts, shard_id=None):
        return cat_parts(parts, 1) if parts[0].dim() == 2 else parts[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = packed_linear(x, self.weight, None, self.packed_weight)
        batch = self.lora.active()
        if batch is not None:  # this rank's share of the low-rank term, summed with the rest
            partial = self.lora.add(partial, x, batch)
        y = tp_all_reduce(partial, self.tp)
        if self.bias is not None:
            y = y + self.bias
        return y
