"""The one strict loading path: ``load_named_tensors(model, [(hf_name, full_tensor), ...])``.

Every weight entering the engine — the initial load and every later update — comes through here:
names are mapped to parameters (and packed shards), every item is validated (name known, shape,
dtype, optionally finite) and coverage is checked *before the first copy*; then each parameter's
``weight_loader`` slices its shard and copies in place. Storage never moves.

Items may be tensors or ``LazyTensor`` (a safetensors entry read only when copied, see
``rollout.weights.safetensors_io``), so a folder is validated from its headers and then streamed one tensor
at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Union

import torch
from torch import nn

from rollout.config import InputError
from rollout.layers.linear import LoadSlice, copy_slices

# Checkpoint entries that are derived state, never weights.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

# With tied embeddings the head has no weight of its own; some checkpoints still carry it.
_TIED_ALIAS = "lm_head.weight"


class WeightLoadError(InputError):
    """A set of named tensors that cannot be loaded; nothing was copied."""


@dataclass
class LazyTensor:
    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]


TensorLike = Union[torch.Tensor, LazyTensor]


@dataclass
class LoadReport:
    num_tensors: int = 0
    num_bytes: int = 0
    loaded_names: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Target:
    param_name: str
    param: nn.Parameter
    shard_id: object
    slice: LoadSlice  # where a full tensor of this name lands (its views follow their storage)
    # another spelling of pieces that canonical names cover (a tied head; transformers v5's fused experts,
    # ``experts.gate_up_proj``, for the per-expert checkpoint names; Mixtral's ``mlp`` for ``block_sparse_moe``):
    # accepted, never required, never listed
    alias: bool = False


def _target(pname: str, param: nn.Parameter, shard_id, alias: bool = False) -> _Target:
    load_slice = getattr(param, "load_slice", None)
    return _Target(pname, param, shard_id, load_slice(param, shard_id) if load_slice else LoadSlice(param.data),
                   alias)


def pieces_of(t: _Target) -> set:
    """The (parameter, shard) pieces a tensor of this target writes: a whole parameter that checkpoints hold
    in pieces (``hf_pieces``) writes every one of them."""
    pieces = getattr(t.param, "hf_pieces", None)
    if t.shard_id is None and pieces is not None:
        return {(t.param_name, shard) for _, shard in pieces}
    return {(t.param_name, t.shard_id)}


def nonfinite_names(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the tensors holding NaN or Inf.

    One min/max pass over each tensor (NaN propagates through both, an Inf shows as an extreme),
    in the tensor's own dtype: ~20x faster than an fp32 sum over bf16 weights on CPU; one host
    sync per device, not per tensor."""
    by_device: dict[torch.device, list] = {}
    for name, t in named_tensors:
        if t.numel():
            lo, hi = torch.aminmax(t)
            by_device.setdefault(t.device, []).append((name, torch.stack([lo.float(), hi.float()])))
    bad = []
    for items in by_device.values():
        finite = torch.isfinite(torch.stack([ext for _, ext in items])).all(dim=1).tolist()
        bad += [name for (name, _), ok in zip(items, finite) if not ok]
    return bad


def is_finite(t: torch.Tensor) -> bool:
    """No NaN/Inf in ``t``."""
    return not nonfinite_names([("", t)])


NameMap = dict[str, "_Target"]


def weight_name_map(model: nn.Module) -> NameMap:
    """Hugging Face name -> target parameter and shard, for every name the model accepts.
    Parameters never change identity, so an owner computes this once (``ModelRunner.name_map``)."""
    mapping = getattr(model, "packed_modules_mapping", {})
    names: dict[str, _Target] = {}
    for pname, param in model.named_parameters():
        pieces = getattr(param, "hf_pieces", None)  # a parameter holding many checkpoint tensors (MoE experts)
        if pieces is not None:
            prefix = pname.rsplit(".", 1)[0] + "."
            for hf, shard in pieces:
                names[prefix + hf] = _target(pname, param, shard)
            whole = getattr(param, "hf_whole", None)  # the name transformers v5 gives the whole (fused experts)
            if whole is not None:
                names[prefix + whole] = _target(pname, param, None, alias=True)
            continue
        packed = [(hf, shard) for hf, (ours, shard) in mapping.items() if f".{ours}." in pname]
        if packed:
            ours = mapping[packed[0][0]][0]
            for hf, shard in packed:
                names[pname.replace(f".{ours}.", f".{hf}.")] = _target(pname, param, shard)
        else:
            names[pname] = _target(pname, param, None)
    renames = getattr(model, "module_renames", {})  # module names the checkpoint spells otherwise
    for ours, theirs in renames.items():  # the checkpoint's spelling; ours (transformers v5's) an alias
        renamed = {n.replace(f".{ours}.", f".{theirs}."): t for n, t in names.items()}
        renamed.update({n: dataclasses.replace(t, alias=True) for n, t in names.items() if n not in renamed})
        names = renamed
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "tie_word_embeddings", False) and _TIED_ALIAS not in names:
        names[_TIED_ALIAS] = dataclasses.replace(names["model.embed_tokens.weight"], alias=True)
    return names


def _expected_shape(t: _Target) -> tuple[int, ...]:
    shard_shape = getattr(t.param, "shard_shape", None)
    return tuple(shard_shape(t.param, t.shard_id)) if shard_shape else tuple(t.param.shape)


@dataclass
class LoadPlan:
    """A validated set of (name, tensor, target): applying it cannot fail on names or shapes."""

    items: list[tuple[str, TensorLike, _Target]]


def plan_load(name_map: NameMap, named_tensors: Iterable[tuple[str, TensorLike]], *, strict_dtype: bool = False,
              require_complete: bool = True, check_finite: bool = False) -> LoadPlan:
    """Validate every item and the coverage; raise ``WeightLoadError`` listing every problem.

    strict_dtype: the tensor's dtype must equal the parameter's (updates); otherwise any floating
    dtype is cast on copy (checkpoints saved in another precision).
    require_complete: every parameter must be covered (initial loads, full updates).
    check_finite: reject NaN/Inf (a lazy tensor is read once for the check).
    """
    items: list[tuple[str, TensorLike, _Target]] = []
    errors: list[str] = []
    seen: set[str] = set()
    written: dict = {}  # (parameter, shard) piece -> the first item's name that writes it
    to_check: list[tuple[str, torch.Tensor]] = []  # in-memory tensors: checked together
    for item in named_tensors:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            errors.append(f"expected (name, tensor) pairs, got {type(item).__name__}")
            continue
        name, tensor = item
        if not isinstance(name, str):
            errors.append(f"weight names must be strings, got {type(name).__name__}")
            continue
        if not isinstance(tensor, (torch.Tensor, LazyTensor)):
            errors.append(f"{name}: expected a tensor, got {type(tensor).__name__}")
            continue
        if name.endswith(IGNORED_SUFFIXES):
            continue
        target = name_map.get(name)
        if target is None:
            errors.append(f"unknown weight name {name!r}")
            continue
        if name in seen:
            errors.append(f"weight {name!r} given twice")
            continue
        seen.add(name)
        writes = pieces_of(target)
        clash = next((written[p] for p in writes if p in written and _TIED_ALIAS not in (name, written[p])), None)
        if clash is not None:  # (a tied head may come with its embedding, as checkpoints carry both)
            errors.append(f"{name}: writes what {clash} in this load writes too (a fused tensor and its pieces, or "
                          f"two spellings of one weight): send one of them")
        for p in writes:
            written.setdefault(p, name)
        want, got = _expected_shape(target), tuple(tensor.shape)
        if want != got:
            errors.append(f"{name}: shape {list(got)} does not match the model's {list(want)}")
        pdtype = target.param.dtype
        if strict_dtype and tensor.dtype != pdtype:
            errors.append(f"{name}: dtype {tensor.dtype} does not match the model's {pdtype}")
        elif not tensor.dtype.is_floating_point:
            errors.append(f"{name}: dtype {tensor.dtype} is not a floating-point type")
        elif check_finite:
            if isinstance(tensor, LazyTensor):  # read once for the check, one tensor at a time
                if not is_finite(tensor.read()):
                    errors.append(f"{name}: contains NaN or Inf values")
            else:
                to_check.append((name, tensor))
        items.append((name, tensor, target))
    errors += [f"{name}: contains NaN or Inf values" for name in nonfinite_names(to_check)]
    if require_complete:
        missing = sorted({n for n, t in name_map.items() if not t.alias and not pieces_of(t) <= written.keys()})
        if missing:
            more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
            errors.append(f"missing weights: {', '.join(missing[:8])}{more}")
    if errors:
        raise WeightLoadError(rejection_message(errors))
    return LoadPlan(items)


def coverage(name_map: NameMap, names: Iterable[str]) -> set:
    """The (parameter, shard) pieces the named tensors write."""
    return set().union(*(pieces_of(name_map[n]) for n in names if n in name_map))


def covers_all(name_map: NameMap, covered: set) -> bool:
    """Whether ``covered`` pieces are every piece a complete load writes."""
    return all(pieces_of(t) <= covered for t in name_map.values() if not t.alias)


def canonical_names(name_map: NameMap) -> list[str]:
    """Every name a complete load gives, sorted (no aliases)."""
    return sorted(n for n, t in name_map.items() if not t.alias)


def rejection_message(errors: list[str]) -> str:
    more = f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else ""
    return "weights rejected, nothing was loaded:\n  " + "\n  ".join(errors[:20]) + more


@torch.no_grad()
def apply_load(plan: LoadPlan) -> LoadReport:
    """Copy every planned tensor into its parameter slice, in place.

    Tensors already in memory go in one batched copy call; lazy (file) tensors are read and
    copied one at a time, so memory holds one tensor, not the model twice."""
    report = LoadReport()
    in_memory = []
    for name, tensor, target in plan.items:
        if isinstance(tensor, LazyTensor):
            full = tensor.read()
            target.slice.copy_from(full)
        else:
            full = tensor
            in_memory.append((full, target.slice))
        report.num_tensors += 1
        report.num_bytes += full.numel() * full.element_size()
        report.loaded_names.append(name)
    copy_slices(in_memory)
    return report


def load_named_tensors(model: nn.Module, named_tensors: Iterable[tuple[str, TensorLike]], *,
                       strict_dtype: bool = False, require_complete: bool = True,
                       check_finite: bool = False) -> LoadReport:
    """Validate every item (``plan_load``), then copy each into its parameter in place.

    Raises ``WeightLoadError`` listing every problem; in that case nothing was copied.
    """
    return apply_load(plan_load(weight_name_map(model), named_tensors, strict_dtype=strict_dtype,
                                require_complete=require_complete, check_finite=check_finite))
