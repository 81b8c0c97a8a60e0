"""What this CPU can do, read once: the one place CPU kernel choices start from.

``cpu_capability()`` reads the processor (model name and the ISA extensions that decide kernels),
what torch dispatches to (``torch.backends.cpu.get_cpu_capability()``) and whether oneDNN runs
bf16 GEMMs natively (AVX512-BF16 or AMX) rather than by converting to fp32 and back (on AVX2-only
CPUs a bf16 GEMM is several times slower than an fp32 one). It also says which instruction set the
project's own C++ kernels run (``kernel_isa``): ``avx512bf16`` (the AVX-512 one with AVX512-BF16's
dot products, which the small-batch GEMM takes from five bf16 rows), ``avx512`` (AVX-512 F/BW/VL),
``avx2`` (AVX2 + FMA + F16C) or ``generic``. One build holds a variant of every one
(``rollout.kernels.cpu.build``), chosen at run time from this CPU's flags, so a build made on one
processor never runs instructions another lacks.

``ROLLOUT_CPU_ISA=avx512`` (or ``avx2``, ``generic``) caps ``kernel_isa`` below what the CPU has, so
a machine with AVX512-BF16 runs (and tests) the plain AVX-512 and AVX2 kernels too; ``ROLLOUT_CPU_NATIVE_BF16=0`` makes the
engine plan its GEMMs as on a CPU without native bf16 (the fp32-compute path), for the same reason.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from dataclasses import asdict, dataclass

import torch

KERNEL_ISAS = ("generic", "avx2", "avx512", "avx512bf16")
# the ISA extensions that decide kernels, as /proc/cpuinfo spells them
_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16", "amx_tile")


@dataclass(frozen=True)
class CpuCapability:
    cpu_model: str
    torch_isa: str  # what torch's own kernels dispatch to: DEFAULT, AVX2, AVX512, ...
    flags: tuple[str, ...]  # which of _FLAGS this CPU has
    onednn_bf16: bool  # oneDNN runs bf16 GEMMs natively (not by conversion)
    amx: bool  # bf16 matrix units
    kernel_isa: str  # which variant of the project's C++ kernels runs (see module docstring)

    @property
    def native_bf16(self) -> bool:
        """bf16 GEMMs are at least as fast as fp32 ones here (what decides the fp32-compute path)."""
        return self.onednn_bf16

    @property
    def runnable_isas(self) -> tuple[str, ...]:
        """The kernel ISAs this CPU can run (``kernel_isa`` and every one below it; ``ROLLOUT_CPU_ISA``
        lowers ``kernel_isa``, not these)."""
        return KERNEL_ISAS[: KERNEL_ISAS.index(_best_isa(set(self.flags))) + 1]

    def as_dict(self) -> dict:
        out = asdict(self)
        out["flags"] = list(self.flags)
        out["native_bf16"] = self.native_bf16
        return out

    def describe(self) -> str:
        return (f"{self.cpu_model}: torch {self.torch_isa}, oneDNN bf16 {'native' if self.onednn_bf16 else 'by conversion'}"
                f"{', AMX' if self.amx else ''}; own kernels: {self.kernel_isa}")


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError):  # not Linux: no flags known, generic kernels
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    model = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                if model and flags and key == "":
                    break
    return model, flags


def _best_isa(flags: set[str]) -> str:
    if {"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"} <= flags:
        return "avx512bf16" if "avx512_bf16" in flags else "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "generic"


@functools.lru_cache(maxsize=1)
def cpu_capability() -> CpuCapability:
    model, flags = _cpuinfo()
    isa = _best_isa(flags)
    cap = os.environ.get("ROLLOUT_CPU_ISA")
    if cap:
        if cap not in KERNEL_ISAS:
            raise ValueError(f"ROLLOUT_CPU_ISA={cap!r}: must be one of {', '.join(KERNEL_ISAS)}")
        isa = KERNEL_ISAS[min(KERNEL_ISAS.index(cap), KERNEL_ISAS.index(isa))]
    onednn_bf16 = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if os.environ.get("ROLLOUT_CPU_NATIVE_BF16", "") == "0":
        onednn_bf16 = False
    return CpuCapability(cpu_model=model, torch_isa=torch.backends.cpu.get_cpu_capability(),
                         flags=tuple(f for f in _FLAGS if f in flags), onednn_bf16=onednn_bf16,
                         amx="amx_bf16" in flags, kernel_isa=isa)
