"""Delta weight pushes: only the changed elements travel, against a named base, checked before and after.

Between two RL steps most bf16 weights keep their bits. A delta names the version it applies to and the
fingerprint of that base; for each tensor that changed it carries the flat indices of the changed elements
and their new values (or the whole tensor where most of it changed), and the fingerprint every changed
tensor must have afterwards. An engine that does not hold the base refuses before touching anything and
says what it holds; one that does applies the delta, fingerprints what it now holds, and publishes only if
every tensor (every TP rank's part of it) matches — otherwise it restores the changed elements and keeps
serving the old version. Nothing needs a restart.

The fingerprint: for a tensor named n with elements e_i (their bit patterns as unsigned integers), the sum
over i of e_i * m(n, i) mod 2^64, where m(n, i) is an odd 64-bit multiplier from a hash of the name and
the flat index. It is additive over any split of the elements, so a TP rank fingerprints its own shard at the
elements' full-tensor indices and the ranks' parts sum to the whole tensor's (as a ZeRO-3 partition's would),
a changed element moves it by (new - old) * m (a delta's check costs its changed elements, not the model),
and an odd multiplier makes any single changed element change it. It is a checksum against mistakes (a wrong
base, a lost or corrupted value, a missed push), not against an adversary.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from weight_sync.layout import ALIGN

FORMAT = "rollout-delta/1"
_K1 = -7046029254386353131  # 0x9E3779B97F4A7C15 (the golden ratio's odd 64-bit constant), as int64
_K2 = 0x2545F4914F6CDD1D  # an odd 64-bit constant (Marsaglia's xorshift multiplier)
_CHUNK = 1 << 22  # elements fingerprinted at a time (bounds the int64 temporaries)
INDEX_SUFFIX, VALUE_SUFFIX = "#indices", "#values"  # a sparse entry's two tensors in a bucket ('#': never in a name)
_BITS = {torch.float32: (torch.int32, 0xFFFFFFFF), torch.bfloat16: (torch.int16, 0xFFFF),
         torch.float16: (torch.int16, 0xFFFF)}


def wrap64(x: int) -> int:
    """``x`` modulo 2^64 as a signed 64-bit integer (what an int64 tensor sum wraps to)."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


@functools.lru_cache(maxsize=1 << 16)
def name_salt(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little", signed=True)


def element_bits(values: torch.Tensor) -> torch.Tensor:
    """Each element's bit pattern as a non-negative int64 (fp32, bf16, fp16)."""
    if values.dtype not in _BITS:
        raise ValueError(f"no delta fingerprint for dtype {values.dtype}: fp32, bf16 or fp16 weights")
    view, mask = _BITS[values.dtype]
    return values.contiguous().view(view).to(torch.int64) & mask


def multipliers(positions: torch.Tensor, salt: int) -> torch.Tensor:
    """m(n, i) for flat indices ``positions`` (int64) of the tensor whose name hashes to ``salt``: odd."""
    return ((positions ^ salt) * _K1 + _K2) | 1


@functools.cache
def kernel_ops():
    """The C++ passes (``rollout.kernels.cpu.ops``: one pass over the bits on every core) where they built, else None
    (asked once a process: a build that failed does not come back)."""
    from rollout.kernels.cpu import build, ops

    return ops if build.kernels() is not None else None


def words_of(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t``'s elements as int16/int32 words for the C++ passes, or None where those do not apply (another device
    or dtype, not contiguous, no compiled kernels)."""
    if t.device.type != "cpu" or t.dtype not in _BITS or not t.is_contiguous() or kernel_ops() is None:
        return None
    return t.view(_BITS[t.dtype][0])


def fingerprint_at(values: torch.Tensor, positions: torch.Tensor, salt: int) -> int:
    """The fingerprint's terms of ``values`` at their full-tensor flat indices ``positions`` (same shape)."""
    v, p = values.reshape(-1), positions.reshape(-1)
    words = words_of(v.contiguous())
    if words is not None and p.device.type == "cpu":
        return wrap64(kernel_ops().delta_fingerprint_at(words, p.to(torch.int64).contiguous(), salt))
    total = 0
    for s in range(0, v.numel(), _CHUNK):
        part = element_bits(v[s: s + _CHUNK]) * multipliers(p[s: s + _CHUNK].to(torch.int64), salt)
        total += int(part.sum())
    return wrap64(total)


def fingerprint(name: str, t: torch.Tensor, positions: Optional[Callable[[int, int], torch.Tensor]] = None,
                layout: Optional[tuple[int, int, int, int, int]] = None) -> int:
    """A tensor's fingerprint — or, with ``positions(s, n)`` (the full tensor's flat indices of ``t``'s flat
    elements [s, s + n)), its part of a larger tensor's — a chunk of elements at a time. ``layout`` (outer,
    length, inner, size, start): the same positions said as where ``t`` lies in the full tensor ([outer, size,
    inner], ``t`` its run [start, start + length) of the middle dimension), for the C++ pass."""
    flat, salt = t.detach().reshape(-1), name_salt(name)
    words = words_of(t.detach()) if positions is None or layout is not None else None
    if words is not None:
        n = flat.numel()
        return wrap64(kernel_ops().delta_fingerprint(words, salt, *(layout or (1, n, 1, n, 0))))
    total = 0
    for s in range(0, flat.numel(), _CHUNK):
        n = min(_CHUNK, flat.numel() - s)
        where = torch.arange(s, s + n, device=flat.device) if positions is None else positions(s, n)
        total += fingerprint_at(flat[s: s + n], where, salt)
    return wrap64(total)


def moved_by(name: str, positions: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> int:
    """How much a tensor's fingerprint moves when the elements at ``positions`` go from ``old`` to ``new``."""
    salt = name_salt(name)
    return wrap64(fingerprint_at(new, positions, salt) - fingerprint_at(old, positions, salt))


@dataclass
class DeltaEntry:
    """One changed tensor: the flat indices of its changed elements (int32 where the tensor has fewer than 2^31
    elements, else int64; strictly increasing) and their new values — or ``dense``, the whole new tensor."""

    indices: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    dense: Optional[torch.Tensor] = None
    num_changed: int = 0  # elements whose bits changed (a dense entry's too)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.indices, self.values, self.dense) if t is not None)


@dataclass
class WeightDelta:
    """A delta push: the base it applies to (``base_version`` and the fingerprint, summed over ``names``, of
    that base), the version it makes, and each changed tensor's entry and fingerprint after it."""

    base_version: str
    base_fingerprint: int
    version: str
    names: tuple[str, ...]  # every tensor the fingerprints cover (the trainer's whole push)
    entries: dict[str, DeltaEntry] = field(default_factory=dict)
    after: dict[str, int] = field(default_factory=dict)  # name -> its fingerprint once applied

    def header(self) -> dict:
        """The JSON part (fingerprints as decimal strings: JSON numbers lose 64-bit integers)."""
        return {"format": FORMAT, "base_version": self.base_version, "base_fingerprint": str(self.base_fingerprint),
                "version": self.version, "names": list(self.names),
                "after": {n: str(v) for n, v in self.after.items()},
                "dense": sorted(n for n, e in self.entries.items() if e.dense is not None)}

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The entries as (name, tensor) pairs for a bucket: a dense tensor under its name, a sparse one as
        ``name#indices`` and ``name#values``."""
        out = []
        for name, e in self.entries.items():
            if e.dense is not None:
                out.append((name, e.dense))
            else:
                assert e.indices is not None and e.values is not None
                out += [(name + INDEX_SUFFIX, e.indices), (name + VALUE_SUFFIX, e.values)]
        return out

    @property
    def num_bytes(self) -> int:
        return sum(e.num_bytes for e in self.entries.values())

    @classmethod
    def from_parts(cls, header: dict, named: Iterable[tuple[str, torch.Tensor]]) -> WeightDelta:
        """A delta back from its header and its bucket's tensors; ``ValueError`` naming what does not fit."""
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ValueError(f"a delta header must be a JSON object with format {FORMAT!r}")
        try:
            names = tuple(header["names"])
            after = {str(n): int(v) for n, v in dict(header["after"]).items()}
            delta = cls(str(header["base_version"]), int(header["base_fingerprint"]), str(header["version"]),
                        names, after=after)
            dense = set(header.get("dense", []))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a delta header needs base_version, base_fingerprint, version, names and after "
                             f"(fingerprints as decimal strings): {exc}") from None
        if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            raise ValueError("a delta's names must be distinct strings")
        tensors = dict(named)
        for name in after:
            if name in dense:
                t = tensors.pop(name, None)
                if t is None:
                    raise ValueError(f"{name}: the delta names it dense but carries no tensor for it")
                delta.entries[name] = DeltaEntry(dense=t)
                continue
            idx, val = tensors.pop(name + INDEX_SUFFIX, None), tensors.pop(name + VALUE_SUFFIX, None)
            if idx is None or val is None:
                raise ValueError(f"{name}: the delta names it changed but carries no {name}{INDEX_SUFFIX} and "
                                 f"{name}{VALUE_SUFFIX}")
            delta.entries[name] = DeltaEntry(indices=idx, values=val)
        if tensors:
            raise ValueError(f"tensors the delta's header does not name: {sorted(tensors)[:8]}")
        return delta


PATCH_HEADER, PATCH_TENSORS = "delta.json", "delta.safetensors"  # a patch folder's two files


def save_patch(delta: WeightDelta, folder: str) -> str:
    """``delta`` as a patch folder (prime-rl-style filesystem sync; read by ``update_weights_from_delta(path)``
    and the server's ``/update_weights_from_delta``): ``delta.json`` (the header, naming its base) and
    ``delta.safetensors`` (the entries' tensors), each written whole and renamed into place, tensors first."""
    import json
    import os

    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    named = {n: t.detach().contiguous().cpu() for n, t in delta.named_tensors()}
    for name, write in ((PATCH_TENSORS, lambda path: save_file(named, path)),
                        (PATCH_HEADER, lambda path: open(path, "w").write(json.dumps(delta.header())))):
        tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
        write(tmp)
        os.replace(tmp, os.path.join(folder, name))
    return folder


_EXPONENT = {torch.float32: 0x7F800000, torch.bfloat16: 0x7F80, torch.float16: 0x7C00}  # all set: NaN or infinite


def check_entries(items: Sequence[tuple[str, DeltaEntry, int, torch.dtype]], finite: bool = False) -> Optional[str]:
    """Why the first of ``items`` — (name, entry, the tensor's elements, its dtype) — that cannot apply cannot
    (None: all can); ``finite``: a NaN or infinite value is a reason too. The sparse entries of host words checked
    in one C++ call, the others by torch."""
    errors: list[Optional[str]] = [None] * len(items)
    batch = []  # (item, indices, value words, numel, exponent bits)
    for i, (name, entry, numel, dtype) in enumerate(items):
        errors[i] = _shape_error(name, entry, numel, dtype)
        if errors[i] is not None:
            continue
        if entry.dense is not None:
            if finite and not bool(torch.isfinite(entry.dense).all()):
                errors[i] = _CHECK_MESSAGES[3](name, 0, numel)
            continue
        idx, val = entry.indices, entry.values
        assert idx is not None and val is not None
        words = words_of(val.contiguous()) if idx.device.type == "cpu" and idx.numel() else None
        if words is not None:
            batch.append((i, idx.contiguous(), words, numel, _EXPONENT[dtype] if finite else 0))
        elif idx.numel():
            code, bad = _check_torch(idx, val, numel, finite)
            errors[i] = _CHECK_MESSAGES[code](name, bad, numel)
    if batch:
        for (i, idx, *_), (code, at) in zip(batch, kernel_ops().delta_check_many([b[1:] for b in batch])):
            errors[i] = _CHECK_MESSAGES[code](items[i][0], int(idx[at]) if code else 0, items[i][2])
    return next((e for e in errors if e is not None), None)


def _shape_error(name: str, entry: DeltaEntry, numel: int, dtype: torch.dtype) -> Optional[str]:
    """Why ``entry``'s tensors cannot be an entry of a tensor of ``numel`` elements of ``dtype`` by their shapes and
    dtypes alone (None: they can)."""
    if entry.dense is not None:
        if entry.dense.numel() != numel or entry.dense.dtype != dtype:
            return (f"{name}: a dense entry of {entry.dense.numel()} {entry.dense.dtype} values for a tensor of "
                    f"{numel} {dtype} values")
        return None
    idx, val = entry.indices, entry.values
    assert idx is not None and val is not None
    if idx.dim() != 1 or val.dim() != 1 or idx.numel() != val.numel():
        return f"{name}: indices and values must be 1-D and as long ({list(idx.shape)} and {list(val.shape)})"
    if idx.dtype not in (torch.int32, torch.int64):
        return f"{name}: indices must be int32 or int64, got {idx.dtype}"
    if val.dtype != dtype:
        return f"{name}: values are {val.dtype}, the model's weights {dtype}"
    return None


def _check_torch(idx: torch.Tensor, val: torch.Tensor, numel: int, finite: bool) -> tuple[int, int]:
    """``delta_check_many``'s (code, offending index) for one entry, by torch (a GPU's)."""
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= numel:
        return 1, lo if lo < 0 else hi
    if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
        return 2, 0
    if finite and not bool(torch.isfinite(val).all()):
        return 3, 0
    return 0, 0


_CHECK_MESSAGES: dict[int, Callable[[str, int, int], Optional[str]]] = {
    0: lambda name, bad, numel: None,
    1: lambda name, bad, numel: f"{name}: index {bad} is outside the tensor's {numel} elements",
    2: lambda name, bad, numel: f"{name}: indices must be strictly increasing (each element once, in order)",
    3: lambda name, bad, numel: f"{name}: contains NaN or Inf values"}


class DeltaTracker:
    """The trainer's side: the bits it last published (host memory, in the push dtype; ``held_bytes``), their
    fingerprints, and the version they are. ``diff`` builds the delta of new full tensors against them;
    ``commit`` takes the delta's values as the new base once the engine published it; ``reset`` forgets
    the base (a full push follows, ``record`` takes it)."""

    def __init__(self, dense_fraction: float = 0.25, anchor_every: int = 0, on_device: bool = False):
        # a tensor whose changed fraction passes this goes dense: a sparse element costs its value and a
        # 4-byte index, so past ~1/3 (bf16) to 1/2 (fp32) of the elements dense is smaller
        self.dense_fraction = dense_fraction
        self.anchor_every = anchor_every  # a full push after this many deltas (0: only when one is refused)
        # keep the base where the pushed tensors live (a GPU's memory: the diff runs there, nothing copied to the
        # host a step) instead of in host memory; held_bytes counts it either way
        self.on_device = on_device
        self.base: dict[str, torch.Tensor] = {}
        self.fingerprints: dict[str, int] = {}
        self.version: Optional[str] = None
        self.deltas_since_anchor = 0
        # the delta last diffed while it is neither committed nor rolled back: the names whose base words it already
        # holds (the C++ pass writes the new words in as it finds them) and the entries that write the old ones back
        self._staged: Optional[tuple[WeightDelta, set[str], list[tuple]]] = None

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.base.values())

    @property
    def base_fingerprint(self) -> int:
        return wrap64(sum(self.fingerprints.values()))

    def wants_full(self) -> bool:
        """No base yet, or an anchor is due."""
        return self.version is None or (self.anchor_every > 0 and self.deltas_since_anchor >= self.anchor_every)

    def reset(self) -> None:
        self.base, self.fingerprints, self.version, self._staged = {}, {}, None, None

    def take(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Tensors of a full push as they go out (bucket by bucket): the next base, once ``recorded``."""
        if self.version is not None or self._staged is not None:
            self.reset()
        for name, t in named:
            self.base[name] = t.detach().to(self._home(t), copy=True).reshape(-1)
            self.fingerprints[name] = fingerprint(name, self.base[name])

    def _home(self, t: torch.Tensor) -> torch.device:
        return t.device if self.on_device else torch.device("cpu")

    def recorded(self, version: str) -> None:
        """The full push whose tensors ``take`` kept was published as ``version``."""
        self.version, self.deltas_since_anchor = version, 0

    def record(self, named: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        """A full push of ``named`` published as ``version``: their bits become the base."""
        self.reset()
        self.take(named)
        self.recorded(version)

    def diff(self, named: Iterable[tuple[str, torch.Tensor]], version: str) -> WeightDelta:
        """The delta from the base to ``named``: every tensor of the base, full, in the push dtype — or fp32 where
        the base is bf16 (a trainer's own parameters), cast as it is compared, the cast never made whole. The base
        takes the delta's values as they are found (host words: the same pass); ``commit`` keeps them, ``rollback``
        (or the next ``diff``) puts the old ones back. The sparse entries lie in one buffer laid out as a weight
        bucket lays them (``weight_sync.layout.ALIGN``): they go on the wire from where they lie."""
        if self.version is None:
            raise ValueError("no base to diff against: push in full first (DeltaTracker.record)")
        self.rollback()
        delta = WeightDelta(self.version, self.base_fingerprint, version, tuple(self.base))
        pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for name, t in named:
            base = self.base.get(name)
            new = t.detach().to(base.device if base is not None else "cpu").reshape(-1)
            if base is None or base.numel() != new.numel() or new.dtype not in _BITS or base.dtype not in _BITS or (
                    base.dtype != new.dtype and (base.dtype, new.dtype) != (torch.bfloat16, torch.float32)):
                raise ValueError(f"{name}: not in the base as pushed ({'absent' if base is None else 'shape or dtype'}"
                                 "); push in full (fp32, bf16 or fp16 weights)")
            pairs.append((name, new, base))
        missing = sorted(set(self.base) - {n for n, _, _ in pairs})
        if missing:
            raise ValueError(f"the new weights lack tensors of the base: {missing[:8]}")
        changes, staged, undo = _changes(pairs)
        self._staged = (delta, staged, undo)
        for (name, new, base), (index, values, moved) in zip(pairs, changes):
            if not index.numel():
                continue
            if index.numel() > self.dense_fraction * new.numel():
                dense = base.clone() if name in staged else new.to(base.dtype, copy=True)  # (a staged base is new)
                delta.entries[name] = DeltaEntry(dense=dense, num_changed=index.numel())
            else:
                delta.entries[name] = DeltaEntry(indices=index, values=values, num_changed=index.numel())
            delta.after[name] = wrap64(self.fingerprints[name] + moved)
        return delta

    def commit(self, delta: WeightDelta) -> None:
        """The engine published ``delta``: its values become the base."""
        if self._staged is not None and self._staged[0] is not delta:
            self.rollback()  # another delta's words staged: the base is the version's before this one lands
        staged = self._staged[1] if self._staged is not None else set()
        self._staged = None
        batch = []  # sparse entries into host words: one C++ call for all of them
        for name, e in delta.entries.items():
            self.fingerprints[name] = delta.after[name]
            if name in staged:  # the diff wrote the new words into this base as it found them
                continue
            base = self.base[name]
            words = words_of(base)
            if e.dense is not None:
                self.base[name] = e.dense.reshape(-1).to(base.device, copy=True)
            elif words is not None and e.values is not None and e.values.dtype == base.dtype:
                assert e.indices is not None
                n = base.numel()
                batch.append((words, e.indices.cpu().contiguous(), e.values.cpu().contiguous().view(words.dtype),
                              0, n, 1, n, 0, False))
            else:  # the torch path (a GPU's base)
                assert e.indices is not None and e.values is not None
                base[e.indices.to(base.device, torch.int64)] = e.values.to(base.device, base.dtype)
        if batch:
            kernel_ops().delta_apply_many(batch)
        self.version = delta.version
        self.deltas_since_anchor += 1

    def rollback(self) -> None:
        """The delta last diffed was not published: the base words its diff wrote in are put back (the base is
        ``version``'s again). Nothing where none is staged."""
        if self._staged is not None:
            undo = self._staged[2]
            self._staged = None
            if undo:
                kernel_ops().delta_apply_many(undo)


def _changes(pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> tuple[
        list[tuple[torch.Tensor, torch.Tensor, int]], set[str], list[tuple]]:
    """For every (name, new, base): (the flat indices where ``new``'s bits, as cast to the base's dtype, differ
    from ``base``'s — int32 where the tensor allows, 4 bytes fewer an element than int64 —, the new values there
    in the base's dtype, how far that moves the tensor's fingerprint); the names whose bases took the new words
    (staged); the ``delta_apply_many`` entries that put their old words back. The pairs the C++ pass takes (host
    words; fp32 against a bf16 base compared as cast) in one call — one parallel region for the whole model, the
    found entries laid out as a bucket lays them, the new words written into the bases as they are found —, the
    others (a GPU's) by the torch path, their bases untouched."""
    out: list = [None] * len(pairs)
    batch = []  # (pair, now as the pass takes it, the base's words)
    for i, (_, new, base) in enumerate(pairs):
        was, new = words_of(base), new.contiguous()
        now = new if new.dtype == torch.float32 and base.dtype == torch.bfloat16 else words_of(new)
        if was is not None and now is not None:
            batch.append((i, now, was))
    staged, undo = set(), []
    if batch:
        found = kernel_ops().delta_diff_many([now for _, now, _ in batch], [was for _, _, was in batch],
                                             [name_salt(pairs[i][0]) for i, _, _ in batch], ALIGN, in_place=True)
        for (i, _, was), (index, words, moved), old in zip(batch, found.found, found.olds):
            out[i] = (index, words.view(pairs[i][2].dtype), moved)
            staged.add(pairs[i][0])
            if index.numel():
                undo.append((was, index, old.view(was.dtype), 0, was.numel(), 1, was.numel(), 0, False))
    return [o if o is not None else _changed(*pairs[i]) for i, o in enumerate(out)], staged, undo


def _changed(name: str, new: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``_changes`` of one pair by the torch path."""
    new = new.to(base.dtype)
    view = _BITS[new.dtype][0]
    changed = torch.nonzero(new.view(view) != base.view(view)).reshape(-1)
    moved = moved_by(name, changed, base[changed], new[changed])
    return (changed.to(torch.int32) if new.numel() < 2**31 else changed), new[changed], moved


def changed_fraction(delta: WeightDelta, sizes: Sequence[int]) -> float:
    """The fraction of all elements (``sizes``: every tensor's count) whose bits the delta changes."""
    return sum(e.num_changed for e in delta.entries.values()) / max(1, sum(sizes))
