"""A delta push on one TP rank (``weight_sync.delta``): the base checked, the changed elements written where
this rank holds them, the result fingerprinted, every rank's parts summed, and the changes undone on every
rank unless every changed tensor came out as the trainer's.

Each full Hugging Face tensor lands on a rank as ``LoadSlice.source(full)`` into ``dst``: the whole tensor,
or the run of one dimension ``[start, start + length)`` (the full tensor first viewed as ``shape`` where
given). A full-tensor flat index g maps to that run by arithmetic on (outer, d, inner) coordinates, so the
rank writes only what it holds and fingerprints its elements at their full-tensor indices; a replicated
tensor (every rank holds all of it) counts on rank 0 alone, so the ranks' parts sum to the whole tensor's
fingerprint.

``DeltaState`` keeps this rank's part of each tensor's fingerprint of the live weights (computed when a
delta first needs it, moved by each delta, forgotten by any other change of the weights).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from rollout.layers.linear import LoadSlice
from rollout.layers.parallel_state import TpState
from rollout.outputs import REJECTED_ELSEWHERE, WeightResult
from weight_sync.delta import (
    DeltaEntry,
    WeightDelta,
    check_entries,
    fingerprint,
    kernel_ops,
    moved_by,
    name_salt,
    words_of,
    wrap64,
)


@dataclass
class _Span:
    """Where a full tensor's flat indices land in ``dst``: full = (outer, size, inner) around the split
    dimension; this rank holds [start, start + length) of it (all of it: start 0, length size)."""

    dst: torch.Tensor
    size: int
    inner: int
    start: int
    length: int
    counts: bool  # its elements count in this rank's fingerprint part (a replicated tensor: rank 0 only)
    numel: int  # the full tensor's elements

    @staticmethod
    def of(sl: LoadSlice, full_shape: tuple[int, ...], rank: int) -> _Span:
        n = math.prod(full_shape)
        if sl.dim is None:
            return _Span(sl.dst, n, 1, 0, n, rank == 0, n)
        shape = tuple(sl.shape) if sl.shape is not None else full_shape
        return _Span(sl.dst, shape[sl.dim], math.prod(shape[sl.dim + 1:]), sl.start, sl.length, True, n)

    def local(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(which of the full-tensor flat indices ``g`` this rank holds, their flat indices in ``dst``)."""
        outer, rest = g // (self.size * self.inner), g % (self.size * self.inner)
        d, b = rest // self.inner, rest % self.inner
        mine = (d >= self.start) & (d < self.start + self.length)
        return mine, (outer * self.length + (d - self.start)) * self.inner + b

    def positions(self, s: int, n: int) -> torch.Tensor:
        """The full-tensor flat indices of ``dst``'s flat elements [s, s + n)."""
        loc = torch.arange(s, s + n, device=self.dst.device)
        per = self.length * self.inner
        outer, rest = loc // per, loc % per
        return outer * (self.size * self.inner) + self.start * self.inner + rest

    def fingerprint(self, name: str) -> int:
        if not self.counts:
            return 0
        outer = self.dst.numel() // max(1, self.length * self.inner)
        return fingerprint(name, self.dst, self.positions, (outer, self.length, self.inner, self.size, self.start))


def _flat_write(dst: torch.Tensor, loc: torch.Tensor, values: torch.Tensor) -> None:
    if dst.is_contiguous():
        dst.view(-1)[loc] = values
    else:
        dst[torch.unravel_index(loc, dst.shape)] = values


def _flat_read(dst: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
    if dst.is_contiguous():
        return dst.view(-1)[loc].clone()
    return dst[torch.unravel_index(loc, dst.shape)].clone()


class DeltaState:
    def __init__(self, name_map, tp_state: TpState, device: torch.device):
        self.name_map, self.tp, self.device = name_map, tp_state, device
        self.parts: dict[str, int] = {}  # name -> this rank's part of the live tensor's fingerprint
        self.spans: dict[str, _Span] = {}  # name -> where its elements lie on this rank (until the weights move)

    def forget(self) -> None:
        self.parts.clear()
        self.spans.clear()

    def _span(self, name: str) -> _Span:
        if name not in self.spans:
            target = self.name_map[name]
            self.spans[name] = _Span.of(target.slice, _shape(target), self.tp.tp_rank)
        return self.spans[name]

    def part(self, name: str) -> int:
        if name not in self.parts:
            self.parts[name] = self._span(name).fingerprint(name)
        return self.parts[name]

    def _sum(self, values: list[int]) -> list[int]:
        """Every rank's values summed mod 2^64 (a collective at TP > 1; every rank calls it alike)."""
        if self.tp.tp_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        self.tp.comm.all_reduce(t)
        return [wrap64(int(v)) for v in t.tolist()]

    def vote(self, ok: bool) -> bool:
        return self._sum([0 if ok else 1])[0] == 0

    def check(self, delta: WeightDelta) -> Optional[str]:
        """Why ``delta`` cannot apply to these weights before anything is written (None: it can)."""
        unknown = [n for n in (*delta.names, *delta.entries) if n not in self.name_map]
        if unknown:
            return f"unknown weight names in the delta: {sorted(set(unknown))[:8]}"
        outside = sorted(set(delta.entries) - set(delta.names))
        if outside:
            return f"changed tensors the delta's fingerprints do not cover: {outside[:8]}"
        return self.refusal(delta.entries)

    def apply(self, delta: WeightDelta) -> WeightResult:
        """The whole delta on this rank, all or nothing with the other ranks (collectives: every rank runs it)."""
        error = self.check(delta)
        if not self.vote(error is None):
            return WeightResult.fail(error or REJECTED_ELSEWHERE)
        base = self._sum([wrap64(sum(self.part(n) for n in delta.names))])[0]
        if base != delta.base_fingerprint:
            return WeightResult.fail(
                f"the engine's weights are not the delta's base {delta.base_version!r} (its fingerprint "
                f"{delta.base_fingerprint}, the engine's {base}); nothing was written: push in full",
                kind=WeightResult.BASE, fingerprint=str(base))
        names = sorted(delta.entries)
        undo, moved = self._write_all(names, delta.entries)
        after = self._sum([wrap64(self.part(n) + m) for n, m in zip(names, moved)])
        wrong = [n for n, got in zip(names, after) if got != delta.after[n]]
        if wrong:
            for back in reversed(undo):
                back()
            return WeightResult.fail(f"after the delta {len(wrong)} tensors are not the trainer's (a value lost or "
                                     f"corrupted on the way): {wrong[:8]}; every change undone, the old weights "
                                     "serve")
        for name, m in zip(names, moved):
            self.parts[name] = wrap64(self.part(name) + m)
        changed = sum(int(e.values.numel()) if e.values is not None else 0 for e in delta.entries.values())
        return WeightResult.ok(f"applied a delta of {len(names)} tensors ({changed} sparse elements)",
                               num_bytes=delta.num_bytes, fingerprint=str(base))

    def _write_all(self, names: list[str], entries: dict[str, DeltaEntry]) -> tuple[list[Callable[[], object]],
                                                                                   list[int]]:
        """Every entry written where this rank holds it: (what undoes the writes, how far each entry moved this
        rank's part of its tensor's fingerprint, in ``names``' order; a dense entry's part before must be known).
        The sparse entries the C++ pass takes (host words) in one call — one parallel region for all of them —,
        the others (a dense tensor, a GPU's) one by one."""
        undo: list[Callable[[], object]] = []
        moved = [0] * len(names)
        batch = []
        for i, name in enumerate(names):
            entry, span = entries[name], self._span(name)
            words = words_of(span.dst) if entry.dense is None else None
            if words is None or entry.values is None or entry.values.dtype != span.dst.dtype \
                    or entry.indices is None or entry.indices.device.type != "cpu":
                back, moved[i] = self._write(name, entry)
                undo.append(back)
                continue
            batch.append((i, (words, entry.indices.contiguous(), entry.values.contiguous().view(words.dtype),
                              name_salt(name), span.length, span.inner, span.size, span.start, span.counts)))
        if batch:
            ops = kernel_ops()
            done = ops.delta_apply_many([e for _, e in batch])
            for (i, _), (_, move, _) in zip(batch, done):
                moved[i] = wrap64(move)
            back = [(e[0], e[1], old, *e[3:8], False) for (_, e), (old, _, _) in zip(batch, done)]
            undo.append(lambda: ops.delta_apply_many(back))
        return undo, moved

    def _write(self, name: str, entry: DeltaEntry) -> tuple[Callable[[], object], int]:
        """One entry written where this rank holds it, by torch: (what undoes it, its move)."""
        span = self._span(name)
        if entry.dense is not None:
            old = span.dst.clone()
            self.name_map[name].slice.copy_from(entry.dense.to(self.device).reshape(_shape(self.name_map[name])))
            return (lambda: span.dst.copy_(old)), wrap64(span.fingerprint(name) - self.part(name))
        assert entry.indices is not None and entry.values is not None
        g = entry.indices.to(self.device, torch.int64)
        mine, loc = span.local(g)
        g, loc, values = g[mine], loc[mine], entry.values.to(self.device)[mine]
        old = _flat_read(span.dst, loc)
        _flat_write(span.dst, loc, values)
        return (lambda: _flat_write(span.dst, loc, old)), (moved_by(name, g, old, values) if span.counts else 0)

    def refusal(self, entries: dict[str, DeltaEntry],
                shapes: Optional[dict[str, tuple[int, ...]]] = None) -> Optional[str]:
        """Why entries cannot be written here, naming the first tensor at fault (None: they can); ``shapes``: the
        full shapes a patch says (vLLM's), checked against the checkpoint's."""
        items = []
        for name in sorted(entries):
            target = self.name_map.get(name)
            if target is None:
                return f"{name}: not a weight of this model"
            if shapes is not None and tuple(shapes[name]) != _shape(target):
                return f"{name}: the patch says shape {list(shapes[name])}, the checkpoint's is {list(_shape(target))}"
            items.append((name, entries[name], self._span(name).numel, target.param.dtype))
        return check_entries(items, finite=True)

    def patch(self, entries: dict[str, DeltaEntry], shapes: dict[str, tuple[int, ...]]) -> WeightResult:
        """vLLM's sparse patches (checkpoint names and full ``shapes``, flat indices into the full tensors, in
        increasing order): they name no base and carry no fingerprint, so everything is checked before anything
        is written — every name known, its shape the checkpoint's, each index inside it and there once, every
        value finite and of the weights' dtype — and then they are written on every rank, or on none (a
        collective: every rank runs it)."""
        error = self.refusal(entries, shapes)
        if not self.vote(error is None):
            return WeightResult.fail(f"{error or REJECTED_ELSEWHERE}; nothing was written")
        self._write_all(sorted(entries), entries)
        self.parts.clear()  # (no fingerprint to move them by; the tensors stay where they are: spans hold)
        count = sum(int(e.values.numel()) for e in entries.values() if e.values is not None)
        return WeightResult.ok(f"patched {len(entries)} tensors ({count} elements)",
                               num_bytes=sum(e.num_bytes for e in entries.values()))


def sparse_entry(indices: torch.Tensor, values: torch.Tensor) -> DeltaEntry:
    """A sparse patch's entry, its indices put in increasing order where they came in another (vLLM's patches
    need not be sorted; an index there twice stays so, and the check refuses it)."""
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        order = torch.argsort(indices.to(torch.int64), stable=True)
        indices, values = indices[order], values[order]
    return DeltaEntry(indices=indices, values=values, num_changed=indices.numel())


def merged(first: DeltaEntry, then: DeltaEntry) -> DeltaEntry:
    """Two sparse patches of one tensor as one, applied in order (where both write an element, ``then``'s)."""
    assert first.indices is not None and first.values is not None and then.indices is not None and then.values is not None
    idx = torch.cat([first.indices.to(torch.int64), then.indices.to(torch.int64)])
    values = torch.cat([first.values, then.values])
    order = torch.argsort(idx, stable=True)
    idx, values = idx[order], values[order]
    last = torch.ones_like(idx, dtype=torch.bool)
    last[:-1] = idx[1:] != idx[:-1]  # the last of each run of one index: the later patch's
    return DeltaEntry(indices=idx[last].to(first.indices.dtype), values=values[last], num_changed=int(last.sum()))


def _shape(target) -> tuple[int, ...]:
    """The full Hugging Face tensor's shape."""
    shard_shape = getattr(target.param, "shard_shape", None)
    return tuple(shard_shape(target.param, target.shard_id) if shard_shape else target.param.shape)

