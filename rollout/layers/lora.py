"""LoRA on the tensor-parallel linears: adapters resident in numbered slots beside the base weights,
applied to a batch that mixes rows on different adapters and on none.

A linear's output is its one base GEMM over every row of the batch (whatever kernel the CPU plan
picks), plus, for each adapter slot present in the batch, ``(x_s A^T) (B * scale)^T`` over that
slot's rows only (``x_s``: the rows of the requests on that adapter; a merged linear's pieces fused
into one pair of GEMMs). Base weights are never merged or copied, and a batch runs one base pass
whatever mix of adapters it holds.

Tensor parallelism follows the base weight's split: a column-parallel linear keeps ``A`` whole and
this rank's output rows of ``B`` (the rows its weight holds, replicated KV heads included); a
row-parallel one keeps this rank's input columns of ``A`` and ``B`` whole, and its low-rank partial
``(x_local A_local^T) B^T`` is added to the partial output before the all-reduce (the sum over
ranks is the whole product). As ``peft`` computes it, the low-rank term is formed in the adapter's
dtype (fp32) and added to the base output in fp32, rounded once to the layer's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.nn.functional as F

LORA_DTYPE = torch.float32  # adapters are held and applied in fp32 (peft's default on bf16 bases)


Rows = Union[None, slice, torch.Tensor]  # every row, a run of rows, or row indices


@dataclass
class LoraBatch:
    """Which rows of one forward use which adapter slot: ``groups`` of (slot, rows), rows being None
    (every row of the batch), a ``slice`` (a run: the scheduler puts each adapter's sequences side by
    side) or an index tensor. Rows on no adapter appear in no group."""

    groups: list[tuple[int, Rows]]
    _segments: Optional[tuple] = field(default=None, init=False, repr=False)

    def segments(self, num_rows: int, device: torch.device) -> tuple:
        """The groups as the batched kernel reads them (``rollout.kernels.triton.lora``), built once per
        forward for every linear: (rows [T] int32, each group's rows back to back; starts [G];
        lengths [G]; slots [G]; the longest group's length)."""
        if self._segments is None:
            parts, starts, lens, slots = [], [], [], []
            offset = 0
            for slot, rows in self.groups:
                if rows is None:
                    idx = torch.arange(num_rows, dtype=torch.int32)
                elif isinstance(rows, slice):
                    idx = torch.arange(rows.start, rows.stop, dtype=torch.int32)
                else:
                    idx = rows.to(device="cpu", dtype=torch.int32)
                parts.append(idx)
                starts.append(offset)
                lens.append(idx.numel())
                slots.append(slot)
                offset += idx.numel()
            meta = torch.tensor([starts, lens, slots], dtype=torch.int32).to(device)
            self._segments = (torch.cat(parts).to(device), meta[0], meta[1], meta[2], max(lens, default=0))
        return self._segments

    def runs(self, num_rows: int) -> Optional[tuple[tuple[int, int, int], ...]]:
        """(slot, first row, rows) of each group when every group is one run of rows (the C++ decode
        layer's form, ``rollout.kernels.cpu.fused``); None when a group's rows are scattered."""
        out = []
        for slot, rows in self.groups:
            if rows is None:
                out.append((slot, 0, num_rows))
            elif isinstance(rows, slice) and rows.step in (None, 1):
                out.append((slot, rows.start, rows.stop - rows.start))
            else:
                return None
        return tuple(out)

    @staticmethod
    def from_sequences(slots: Optional[list[int]], q_lens: list[int], device: torch.device) -> Optional[LoraBatch]:
        """Per sequence its adapter slot (-1: none) and its rows this forward -> the groups; None
        when no row uses an adapter."""
        if not slots or all(s < 0 for s in slots):
            return None
        if all(s == slots[0] for s in slots):
            return LoraBatch([(slots[0], None)])
        spans: dict[int, list[tuple[int, int]]] = {}  # slot -> its sequences' (start, end) rows
        start = 0
        for slot, q in zip(slots, q_lens):
            if slot >= 0:
                spans.setdefault(slot, []).append((start, start + q))
            start += q
        groups: list[tuple[int, Rows]] = []
        for s, runs in sorted(spans.items()):
            if all(runs[i][1] == runs[i + 1][0] for i in range(len(runs) - 1)):
                groups.append((s, slice(runs[0][0], runs[-1][1])))
            else:
                rows = [r for a, b in runs for r in range(a, b)]
                groups.append((s, torch.tensor(rows, dtype=torch.long, device=device)))
        return LoraBatch(groups)


@dataclass
class LoraContext:
    """Shared by every LoRA-capable linear of a model: the current forward's ``LoraBatch`` (set by
    the model runner around each forward; None: no adapter in this batch), and how the adapters'
    terms are computed: ``"torch"`` (two GEMMs per adapter over its rows) or ``"triton"`` (one
    segmented kernel launch per linear for all adapters, ``rollout.kernels.triton.lora``)."""

    batch: Optional[LoraBatch] = None
    backend: str = "torch"
    slots: int = 8  # adapter slots of the engine (max_loaded_loras): the kernel's tables have one entry each


@dataclass
class LoraSlots:
    """A linear's resident adapters: slot -> (``a`` [R, in], ``b`` [out, R]) fused over the pieces of a
    merged linear (q/k/v, gate/up), each piece's rows of ``a`` its own ``A`` and its block of ``b`` its
    ``B * scale``, in its own output rows and its own rank columns (zero elsewhere: a piece with no
    adapter gets exactly nothing; ``blocks`` says where; ``rollout.weights.lora`` writes them).
    A linear's low-rank term is then two GEMMs whatever its pieces: ``(x a^T) b^T`` added to the base
    output (``addmm``), in fp32."""

    piece_offsets: list[tuple[int, int]]  # (start, length) of each piece in this rank's output
    context: Optional[LoraContext] = None
    adapters: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _tables: Optional[tuple] = field(default=None, repr=False)  # (key, tables) for the batched kernel

    @property
    def width(self) -> int:
        """This rank's output features (``b``'s rows)."""
        return max(start + length for start, length in self.piece_offsets)

    def blocks(self, ranks: dict[int, int]) -> dict[int, tuple[int, int, int, int]]:
        """Where each adapted piece (piece -> its rank) lies in a fused (``a``, ``b``): (its first row of
        ``a`` and first column of ``b``, its rank, its first row of ``b``, its rows of ``b``). Pieces in
        order, ranks back to back; ``b`` is zero outside the blocks."""
        out, r0 = {}, 0
        for i in sorted(ranks):
            start, length = self.piece_offsets[i]
            out[i] = (r0, ranks[i], start, length)
            r0 += ranks[i]
        return out

    def active(self) -> Optional[LoraBatch]:
        if not self.adapters or self.context is None:
            return None
        return self.context.batch

    def tables(self, device: torch.device) -> tuple:
        """The batched kernel's view of the resident adapters: (the address of each slot's ``a``, of its
        ``b``, its rank; 0 for a slot this linear has no adapter in — every slot of the engine has an
        entry), and the largest rank. Rebuilt only when the resident adapters change."""
        key = tuple((slot, a.data_ptr(), b.data_ptr(), a.shape[0]) for slot, (a, b) in sorted(self.adapters.items()))
        if self._tables is None or self._tables[0] != key:
            size = max(self.context.slots if self.context is not None else 0, max(self.adapters, default=0) + 1)
            table = torch.zeros(3, size, dtype=torch.int64)
            for slot, a_ptr, b_ptr, rank in key:
                table[:, slot] = torch.tensor([a_ptr, b_ptr, rank])
            table = table.to(device)
            self._tables = (key, ((table[0], table[1], table[2].to(torch.int32)), max((k[3] for k in key), default=1)))
        return self._tables[1]

    def add(self, y: torch.Tensor, x: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        """``y`` (the base output of ``x``) with every resident adapter's term added to its rows."""
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.reshape(-1, y.shape[-1])
        if self.context is not None and self.context.backend == "triton":
            from rollout.kernels.triton.lora import lora_segments

            lora_segments(y2, x2.contiguous(), batch.segments(x2.shape[0], x2.device), self.tables(x2.device))
            return y2.view(y.shape)
        for slot, rows in batch.groups:
            weights = self.adapters.get(slot)
            if weights is None:
                continue
            a, b = weights
            bt = b.t()  # a view: the GEMM reads b transposed
            if isinstance(rows, torch.Tensor):  # rows scattered over the batch: gathered, then put back
                out = torch.addmm(y2.index_select(0, rows).to(LORA_DTYPE),
                                  F.linear(x2.index_select(0, rows).to(LORA_DTYPE), a), bt)
                y2.index_copy_(0, rows, out.to(y2.dtype))
                continue
            xs, ys = (x2, y2) if rows is None else (x2[rows], y2[rows])  # views
            t = F.linear(xs.to(LORA_DTYPE), a)
            if ys.dtype == LORA_DTYPE:
                ys.addmm_(t, bt)
            else:  # added in fp32, rounded once to the layer's dtype
                ys.copy_(torch.addmm(ys.to(LORA_DTYPE), t, bt))
        return y2.view(y.shape)

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.adapters.values())
