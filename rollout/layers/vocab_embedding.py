"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded up to a multiple of ``tp_size``; each rank owns a contiguous slice of
rows. Padded rows are zero and their logits are cut off after the gather, so they can never be
sampled.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from rollout.layers.linear import LoadSlice, PackedWeight, attach_loader_hooks, cat_parts, packed_linear
from rollout.layers.parallel_state import get_tp_state, tp_all_gather_last_dim, tp_all_reduce


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, params_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.tp = tp = get_tp_state()
        self.tp_rank, self.tp_size = tp.tp_rank, tp.tp_size
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_local = padded_vocab_size(vocab_size, self.tp_size) // self.tp_size
        self.vocab_start = self.tp_rank * self.num_local
        self.weight = attach_loader_hooks(
            nn.Parameter(torch.empty(self.num_local, hidden_size, dtype=params_dtype), requires_grad=False), self)

    def shard_shape(self, param, shard_id=None) -> tuple[int, int]:
        return (self.vocab_size, self.hidden_size)

    def local_part(self, param, shard_id=None) -> torch.Tensor:
        return param.data

    def full_from_parts(self, parts, shard_id=None) -> torch.Tensor:
        return cat_parts(parts, 0)[: self.vocab_size]

    def load_slice(self, param: nn.Parameter, shard_id=None) -> LoadSlice:
        n = max(0, min(self.num_local, self.vocab_size - self.vocab_start))
        tail = param.data.narrow(0, n, self.num_local - n) if n < self.num_local else None
        if n == self.vocab_size == self.num_local:
            return LoadSlice(param.data)
        return LoadSlice(param.data.narrow(0, 0, n), 0, self.vocab_start, n, tail)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_range = (local >= 0) & (local < self.num_local)
        out = F.embedding(torch.where(in_range, local, 0), self.weight)
        out = out * in_range.unsqueeze(-1).to(out.dtype)
        return tp_all_reduce(out, self.tp)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to full-vocabulary logits (gathered on every rank)."""

    def __init__(self, vocab_size: int, hidden_size: int, params_dtype: torch.dtype = torch.float32,
                 tied_to: VocabParallelEmbedding | None = None):
        super().__init__(vocab_size, hidden_size, params_dtype)
        if tied_to is not None:
            self.weight = tied_to.weight  # same Parameter: one storage, loaded once
        self.packed_weight: Optional[PackedWeight] = None  # set and cleared by the ModelRunner

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, vocab_size]
        logits = tp_all_gather_last_dim(packed_linear(hidden, self.weight, None, self.packed_weight), self.tp)
        return logits[..., : self.vocab_size]
