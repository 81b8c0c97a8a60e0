"""Which of the project's kernels an engine runs: asked once (``KernelChoice``, ``EngineConfig.kernels``),
resolved once (``KernelChoice.resolve``: the device, whether the C++ build exists on this machine, the
model) into a ``KernelPlan`` that the model builder takes — no module is probed and no flag is written
onto a module afterwards.

The CPU fusion ladder is one value, each rung containing the one below it:

- ``torch``: torch operators only (decode attention gathers the KV blocks for SDPA);
- ``ops``: each of ``FUSED_OPS`` in one C++ call — decode attention from the paged cache, RMSNorm, rotary
  with the K/V cache write, SiLU·up, the sampler's draw and its logprob, a mixture of experts' experts
  (outside the batch-invariant mode) — unless named in ``unfused``;
- ``layer``: also each decoder layer of a plain decode step in one C++ call (the same kernels, the same
  bits), where every op it strings together is on, one TP rank serves and the model has no q/k norm;
- ``stack`` (the default): also every layer of a decode step in one call with one team of threads, at
  the few rows where each linear takes the small-batch GEMM.

On CUDA the layer's small ops are Triton kernels (``rollout.kernels.triton.fused``: the residual add with
RMSNorm, rotary with the K/V cache write, SiLU·up; decode attention from the paged cache): ``triton``
(``None``: on CUDA where Triton is installed and ``fusion`` is not ``torch``; ``True`` on a CPU runs that
path under Triton's interpreter, ``TRITON_INTERPRET=1`` set before Triton is imported — how the suite
tests the CUDA path here; fp32 and bf16 models).

The GEMMs are chosen separately, per weight shape and number of rows (``rollout.kernels.cpu.plan``):
``gemm`` pins one kernel at every row count (``linear``: plain ``F.linear``, no weight copies), and
``fp32_gemm_rows`` / ``small_gemm_rows`` bound where the fp32-copy and the small-batch kernels may serve
(``None``: measured; ``0``: never). ``adapt_threads``: forwards drop to one thread while another process
computes on this one's cores (``rollout.executor.cpu_threads``; ``None``: on for bf16 engines outside the
batch-invariant mode).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

FUSION_LEVELS = ("torch", "ops", "layer", "stack")
FUSED_OPS = ("paged_attention", "norm", "rope", "silu", "sampler", "moe")
GEMM_KERNELS = ("linear", "onednn", "fp32", "own", "tiled", "chunked")
_LAYER_OPS = ("paged_attention", "norm", "rope", "silu")  # what a decoder layer's one call strings together

# the flat engine options this choice replaced: old name -> how it maps (a value equal to the default maps
# to nothing)
DEPRECATED_OPTIONS = {
    "cpu_packed_weights": "gemm='linear' for False", "cpu_gemm_kernel": "gemm", "cpu_fp32_gemm_rows": "fp32_gemm_rows",
    "cpu_small_gemm_rows": "small_gemm_rows", "cpu_adapt_threads": "adapt_threads",
    "cpu_paged_attention": "unfused=('paged_attention',) for False", "cpu_fused_norm": "unfused=('norm',) for False",
    "cpu_fused_rope": "unfused=('rope',) for False", "cpu_fused_silu": "unfused=('silu',) for False",
    "cpu_fused_sampler": "unfused=('sampler',) for False", "cpu_fused_layer": "fusion='ops' for False",
    "cpu_fused_stack": "fusion='layer' for False",
}


def _bad(name: str, value: Any, why: str) -> ValueError:
    return ValueError(f"engine option kernels.{name}={value!r}: {why}")


@dataclass(frozen=True)
class KernelChoice:
    fusion: str = "stack"
    unfused: tuple[str, ...] = ()
    gemm: Optional[str] = None
    fp32_gemm_rows: Optional[int] = None
    small_gemm_rows: Optional[int] = None
    adapt_threads: Optional[bool] = None
    triton: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.fusion not in FUSION_LEVELS:
            raise _bad("fusion", self.fusion, f"must be one of {', '.join(FUSION_LEVELS)}")
        unfused = tuple(op for op in self.unfused.split(",") if op) if isinstance(self.unfused, str) else self.unfused
        if not isinstance(unfused, (tuple, list, set, frozenset)) or any(op not in FUSED_OPS for op in unfused):
            raise _bad("unfused", self.unfused, f"must name ops among {', '.join(FUSED_OPS)}")
        object.__setattr__(self, "unfused", tuple(sorted(set(unfused))))
        if self.gemm is not None and self.gemm not in GEMM_KERNELS:
            raise _bad("gemm", self.gemm, f"must be None (measured) or one of {', '.join(GEMM_KERNELS)}")
        for name in ("fp32_gemm_rows", "small_gemm_rows"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise _bad(name, value, "must be None (measured) or an integer >= 0 (0: never)")
        if self.adapt_threads not in (None, True, False):
            raise _bad("adapt_threads", self.adapt_threads, "must be None (by dtype), true or false")
        if self.triton not in (None, True, False):
            raise _bad("triton", self.triton, "must be None (on CUDA), true or false")

    def with_deprecated(self, flat: dict[str, Any]) -> KernelChoice:
        """This choice with the old flat ``cpu_*`` options applied (each named in one DeprecationWarning)."""
        if not flat:
            return self
        warnings.warn(f"engine options {sorted(flat)} are deprecated: pass kernels=KernelChoice(...) (or a dict) "
                      f"instead — {'; '.join(f'{k}: {DEPRECATED_OPTIONS[k]}' for k in sorted(flat))}",
                      DeprecationWarning, stacklevel=4)
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        unfused = set(self.unfused)
        level = FUSION_LEVELS.index(self.fusion)
        for name, value in flat.items():
            if name in ("cpu_gemm_kernel", "cpu_fp32_gemm_rows", "cpu_small_gemm_rows", "cpu_adapt_threads"):
                fields[DEPRECATED_OPTIONS[name]] = value
            elif value is False and name == "cpu_fused_layer":
                level = min(level, FUSION_LEVELS.index("ops"))
            elif value is False and name == "cpu_fused_stack":
                level = min(level, FUSION_LEVELS.index("layer"))
            elif value is False and name.startswith(("cpu_fused_", "cpu_paged_")):
                unfused.add({"cpu_paged_attention": "paged_attention"}.get(name, name[len("cpu_fused_"):]))
            elif value not in (True, False):
                raise ValueError(f"engine option {name}={value!r}: must be true or false")
        if flat.get("cpu_packed_weights") is False:
            fields["gemm"] = "linear"
        fields.update(fusion=FUSION_LEVELS[level], unfused=tuple(unfused))
        return KernelChoice(**fields)

    def resolve(self, *, device: torch.device, built: bool, tp_size: int, qk_norm: bool, dtype: torch.dtype,
                deterministic: bool, moe: bool = False) -> KernelPlan:
        """What serves on this engine: the choice where the device, the CPU build and the model allow it."""
        level = FUSION_LEVELS.index(self.fusion)
        if self._triton(device, level, dtype):
            return KernelPlan(paged_attention=True, triton=True)
        cpu = device.type == "cpu" and built  # the C++ kernels exist on this machine (no compiler: torch serves)
        ops = {op: cpu and level >= 1 and op not in self.unfused for op in FUSED_OPS}
        ops["rope"] = ops["rope"] and ops["paged_attention"]  # K/V the kernel reads is written by the same call
        # the experts' kernel is not batch-invariant (its GEMMs sum by how many rows an expert has)
        ops["moe"] = ops["moe"] and moe and not deterministic and dtype in (torch.float32, torch.bfloat16)
        layer = (level >= 2 and all(ops[op] for op in _LAYER_OPS) and tp_size == 1 and not qk_norm and not moe
                 and dtype in (torch.float32, torch.bfloat16))  # the one-call layer strings the dense MLP
        adapt = self.adapt_threads if self.adapt_threads is not None else dtype == torch.bfloat16 and not deterministic
        return KernelPlan(**ops, layer=layer, stack=layer and level >= 3, adapt_threads=device.type == "cpu" and adapt)

    def _triton(self, device: torch.device, level: int, dtype: torch.dtype) -> bool:
        if self.triton is False or (self.triton is None and (device.type != "cuda" or level == 0)):
            return False
        import importlib.util
        import os

        if importlib.util.find_spec("triton") is None:
            if self.triton:
                raise _bad("triton", True, "needs Triton installed (pip install triton)")
            return False
        if self.triton and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise _bad("triton", True, "needs CUDA, or on a CPU TRITON_INTERPRET=1 set before Triton is imported")
        return dtype in (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class KernelPlan:
    """The kernels that serve one engine (``KernelChoice.resolve``): each op's own C++ call, a decoder layer
    in one call, the whole stack in one call, and whether forwards adapt their thread count — or, on CUDA,
    ``triton``: the layer's small ops and decode attention as Triton kernels (the C++ ones then off)."""

    paged_attention: bool = False
    norm: bool = False
    rope: bool = False
    silu: bool = False
    sampler: bool = False
    moe: bool = False
    layer: bool = False
    stack: bool = False
    adapt_threads: bool = False
    triton: bool = False

    def describe(self) -> str:
        on = [name for name in self.__dataclass_fields__ if getattr(self, name)]
        return ", ".join(on) if on else "torch operators only"
