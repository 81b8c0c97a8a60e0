"""LoRA on the tensor-parallel linears: adapters resident in numbered slots beside the base weights,
applied to a batch that mixes rows on different adapters and on none.

A linear's output is its one base GEMM over every row of the batch (whatever kernel the CPU plan
picks), plus, for each adapter slot present in the batch, ``(x_s A^T) B^T * scale`` over that
slot's rows only (``x_s``: the rows of the requests on that adapter). Base weights are never merged
or copied, and a batch runs one base pass whatever mix of adapters it holds.

Tensor parallelism follows the base weight's split: a column-parallel linear keeps ``A`` whole and
this rank's output rows of ``B`` (the rows its weight holds, replicated KV heads included); a
row-parallel one keeps this rank's input columns of ``A`` and ``B`` whole, and its low-rank partial
``(x_local A_local^T) B^T`` is added to the partial output before the all-reduce (the sum over
ranks is the whole product). As ``peft`` computes it, the low-rank term is formed in the adapter's
dtype (fp32) and added to the base output in fp32, rounded once to the layer's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

LORA_DTYPE = torch.float32  # adapters are held and applied in fp32 (peft's default on bf16 bases)


@dataclass
class LoraPiece:
    """One adapter on one linear (or one piece of a merged linear), this rank's part."""

    a: torch.Tensor  # [rank, in] (row-parallel: this rank's input columns)
    b: torch.Tensor  # [out, rank] (column-parallel: this rank's output rows of the piece)
    scale: float

    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()


@dataclass
class LoraBatch:
    """Which rows of one forward use which adapter slot: ``groups`` of (slot, row indices), where
    None stands for every row of the batch. Rows on no adapter appear in no group."""

    groups: list[tuple[int, Optional[torch.Tensor]]]

    @staticmethod
    def from_sequences(slots: Optional[list[int]], q_lens: list[int], device: torch.device) -> Optional[LoraBatch]:
        """Per sequence its adapter slot (-1: none) and its rows this forward -> the groups; None
        when no row uses an adapter."""
        if not slots or all(s < 0 for s in slots):
            return None
        if all(s == slots[0] for s in slots):
            return LoraBatch([(slots[0], None)])
        rows: dict[int, list[int]] = {}
        start = 0
        for slot, q in zip(slots, q_lens):
            if slot >= 0:
                rows.setdefault(slot, []).extend(range(start, start + q))
            start += q
        return LoraBatch([(s, torch.tensor(r, dtype=torch.long, device=device)) for s, r in sorted(rows.items())])


@dataclass
class LoraContext:
    """Shared by every LoRA-capable linear of a model: the current forward's ``LoraBatch`` (set by
    the model runner around each forward; None: no adapter in this batch)."""

    batch: Optional[LoraBatch] = None


@dataclass
class LoraSlots:
    """A linear's resident adapters: slot -> {piece index -> ``LoraPiece``} (a merged linear's pieces,
    e.g. q/k/v, each with an adapter or not), and where each piece's columns lie in the output."""

    piece_offsets: list[tuple[int, int]]  # (start, length) of each piece in this rank's output
    context: Optional[LoraContext] = None
    adapters: dict[int, dict[int, LoraPiece]] = field(default_factory=dict)

    def active(self) -> Optional[LoraBatch]:
        if not self.adapters or self.context is None:
            return None
        return self.context.batch

    def add(self, y: torch.Tensor, x: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        """``y`` (the base output of ``x``) with every resident adapter's term added to its rows."""
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.reshape(-1, y.shape[-1])
        for slot, rows in batch.groups:
            pieces = self.adapters.get(slot)
            if not pieces:
                continue
            xs = (x2 if rows is None else x2.index_select(0, rows)).to(LORA_DTYPE)
            out = y2 if rows is None else y2.index_select(0, rows)
            for i, piece in pieces.items():
                start, length = self.piece_offsets[i]
                delta = F.linear(F.linear(xs, piece.a), piece.b) * piece.scale
                cols = out[:, start: start + length]
                if cols.dtype == LORA_DTYPE:
                    cols.add_(delta)
                else:  # added in fp32, rounded once to the layer's dtype
                    cols.copy_(cols.to(LORA_DTYPE) + delta)
            if rows is not None:
                y2.index_copy_(0, rows, out)
        return y2.view(y.shape)

    def nbytes(self) -> int:
        return sum(p.nbytes() for pieces in self.adapters.values() for p in pieces.values())
