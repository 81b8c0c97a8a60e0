"""The CPU GEMMs' plan and weight copies: which kernel serves a linear's forward of how many rows
(``GemmPlan``, chosen per weight shape by ``plan.plan_gemms``), the copies of a weight those kernels
read (``PackedWeight``, built by ``pack_weight``), and ``packed_linear``, ``F.linear`` through the
plan's kernel: ``linear`` (torch), ``onednn`` (oneDNN's packed copy in the weight's dtype), ``fp32``
(an fp32 packed copy of a bf16 weight), ``own`` (``ops.bf16_linear``, the small-batch kernel reading
the weight itself), ``tiled`` (``ops.tiled_linear`` over the weight's fp32 panels) and ``chunked``
(oneDNN's packed copy in fixed chunks of rows: the batch-invariant mode's, ``invariant.py``); on the CUDA
kernel plan that mode's ``triton`` (``rollout.kernels.triton.matmul``, reading the weight itself).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from rollout.kernels.cpu import ops
from rollout.kernels.cpu.invariant import chunked_linear, onednn_linear


@dataclass(frozen=True)
class GemmPlan:
    """``segments``: ascending (up to this many rows, kernel); rows past the last take its kernel."""

    segments: tuple[tuple[int, str], ...]
    how: str = "fixed"  # fixed | measured | cached
    timings: dict = field(default_factory=dict, compare=False, hash=False)  # kernel -> {rows: seconds}

    def __post_init__(self) -> None:  # the bounds, once: kernel_for runs for every linear of every forward
        object.__setattr__(self, "_uptos", [upto for upto, _ in self.segments])

    def kernel_for(self, rows: int) -> str:
        i = bisect.bisect_left(self._uptos, rows)
        return self.segments[min(i, len(self.segments) - 1)][1]

    @property
    def kernels(self) -> set[str]:
        return {k for _, k in self.segments}

    def describe(self) -> str:
        parts, lo = [], 1
        for i, (upto, kernel) in enumerate(self.segments):
            last = i == len(self.segments) - 1
            parts.append(f"{lo}+ rows: {kernel}" if last else f"{lo}{'' if upto == lo else f'-{upto}'} rows: {kernel}")
            lo = upto + 1
        return ", ".join(parts) + f" ({self.how})"

    def as_dict(self) -> dict:
        return {"segments": [list(s) for s in self.segments], "how": self.how, "timings": self.timings}


PLAIN = GemmPlan(((1 << 62, "linear"),))


@dataclass(frozen=True)
class GemmPlans:
    """One plan per weight shape (out, in): the fastest kernel differs between shapes at the same rows."""

    plans: tuple[tuple[tuple[int, int], GemmPlan], ...]

    def for_shape(self, shape) -> GemmPlan:
        """The plan of this weight shape; a shape not measured takes the largest measured one's."""
        found = dict(self.plans).get(tuple(shape))
        return found if found is not None else max(self.plans, key=lambda p: p[0][0] * p[0][1])[1]

    @property
    def kernels(self) -> set[str]:
        return {k for _, p in self.plans for k in p.kernels}

    @property
    def is_plain(self) -> bool:
        return self.kernels == {"linear"}

    def describe(self) -> str:
        return "; ".join(f"{o}x{i}: {p.describe()}" for (o, i), p in self.plans)

    def as_dict(self) -> dict:
        return {f"{o}x{i}": p.as_dict() for (o, i), p in self.plans}


@dataclass
class PackedWeight:
    """What one linear layer's GEMMs read on CPU (see ``rollout.kernels.cpu.plan``): the engine's
    plan (which kernel serves a forward of how many rows) and the copies its kernels need, built
    by ``ModelRunner.refresh_packed_weights`` and dropped at every weight change (never stale):
    ``narrow``, oneDNN's packed copy in the weight's dtype (kernel ``onednn``), ``wide``, an fp32
    packed copy of a bf16 weight with its bias in fp32 (kernel ``fp32``; 2x the weight's bytes), and
    ``panels``, the weight's fp32 panels for ``rollout.layers.ops.tiled_linear`` (kernel
    ``tiled``; 4 bytes a value). Kernels ``own`` and ``linear`` read the weight itself."""

    plan: GemmPlan
    narrow: Optional[torch.Tensor] = None
    wide: Optional[torch.Tensor] = None
    wide_bias: Optional[torch.Tensor] = None
    panels: Optional[torch.Tensor] = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.narrow, self.wide, self.wide_bias, self.panels)
                   if t is not None)

    def has_copy(self, kernel: str) -> bool:
        """Whether the copy ``kernel`` reads is built (kernels reading the weight itself: always)."""
        copy = {"onednn": self.narrow, "chunked": self.narrow, "fp32": self.wide, "tiled": self.panels}
        return kernel not in copy or copy[kernel] is not None


COPY_KERNELS = ("onednn", "fp32", "tiled", "chunked")  # the kernels that read a copy of the weight


def pack_weight(weight: torch.Tensor, bias: Optional[torch.Tensor], plan: GemmPlan,
                kinds=None, into: Optional[PackedWeight] = None) -> PackedWeight:
    """The copies of ``weight`` that ``kinds`` (default: every kernel of ``plan``) read, added to
    ``into`` (or a new ``PackedWeight``)."""
    packed = into if into is not None else PackedWeight(plan)
    kinds = plan.kernels if kinds is None else kinds
    if "onednn" in kinds or "chunked" in kinds:
        packed.narrow = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    if "fp32" in kinds:
        packed.wide = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float(), None)
        packed.wide_bias = None if bias is None else bias.detach().float()
    if "tiled" in kinds:
        packed.panels = ops.tile_pack(weight.detach())
    return packed


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  packed: Optional[PackedWeight]) -> torch.Tensor:
    """``F.linear``, through the kernel the plan names for this many rows."""
    rows = x.reshape(-1, x.shape[-1])
    # no rows (a prefill chunk none of whose positions needs logits): nothing to compute, and the plan's
    # kernel for 0 rows may read a copy that no forward of this size asked refresh_packed_weights for
    if packed is None or rows.shape[0] == 0:
        return F.linear(x, weight, bias)
    kernel = packed.plan.kernel_for(rows.shape[0])
    if kernel == "linear":
        return F.linear(x, weight, bias)
    if kernel == "own":
        y = ops.bf16_linear(rows, weight, bias)
    elif kernel == "tiled":
        assert packed.panels is not None, "panels missing: refresh_packed_weights was not called"
        y = ops.tiled_linear(rows, packed.panels, weight.shape[0], bias)
    elif kernel == "triton":  # the CUDA plan's batch-invariant GEMM (rollout.kernels.triton.matmul)
        from rollout.kernels.triton.matmul import invariant_linear

        y = invariant_linear(rows, weight, bias)
    elif kernel == "chunked":
        assert packed.narrow is not None, "packed copy missing: refresh_packed_weights was not called"
        y = chunked_linear(rows, packed.narrow, bias, weight.shape[0])
    else:
        rows = rows if rows.is_contiguous() else rows.contiguous()
        if kernel == "fp32":
            assert packed.wide is not None, "fp32 copy missing: refresh_packed_weights was not called"
            y = onednn_linear(rows.float(), packed.wide, packed.wide_bias).to(x.dtype)
        else:
            assert packed.narrow is not None, "packed copy missing: refresh_packed_weights was not called"
            y = onednn_linear(rows, packed.narrow, bias)
    return y.view(*x.shape[:-1], y.shape[-1])
