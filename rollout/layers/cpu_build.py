"""Building the project's C++ CPU kernels: one extension holding every instruction set's variant.

The kernels (``paged_decode``, ``bf16_linear``, ``rms_norm``, ``rope_and_cache``) are C++ compiled on first use with the
machine's compiler (``torch.utils.cpp_extension.load_inline``, cached under
``TORCH_EXTENSIONS_DIR``). Their source is compiled once per instruction set of
``cpu_capability.KERNEL_ISAS`` in one translation unit: each copy in its own namespace under
``#pragma GCC target`` naming the ISA's extensions exactly (never ``-march=native``), with vectors of
that ISA's width (``ROLLOUT_LANES``). Which copy runs is decided at run time by the CPU that runs it
(``cpu_capability().kernel_isa``), so one build serves every processor it may be found on, and a
machine tests the variants below its own in the same process (``kernels_for``). No
``-ffast-math``: no licence to reassociate sums or approximate functions; results are the same on
every CPU that runs the same variant.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import types
from typing import Optional

from rollout.layers.cpu_capability import KERNEL_ISAS, cpu_capability

logger = logging.getLogger(__name__)

FUNCTIONS = ("paged_decode", "bf16_linear", "rms_norm", "rope_and_cache")
# the extensions each variant is compiled for, and its fp32 lanes per vector
_TARGETS = {"generic": None, "avx2": "avx2,fma,f16c", "avx512": "avx512f,avx512bw,avx512vl,avx2,fma,f16c"}
_LANES = {"generic": 4, "avx2": 8, "avx512": 16}
_HEADER = """#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
"""

_lock = threading.Lock()
_built: dict[str, object] = {}
_failed: dict[str, str] = {}
_dispatch: dict[str, types.SimpleNamespace] = {}


def build_flags() -> list[str]:
    # -ffp-contract=fast: a * b + c may become one FMA where the variant's ISA has it (torch builds in
    # ISO C++ mode, where GCC contracts nothing); it changes no order of operations, and a build
    # gives the same bits every run
    return ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=fast"]


def combined_source(body: str) -> str:
    """``body`` once per ISA (namespace ``rollout_<isa>``) and the Python bindings ``<fn>_<isa>``."""
    parts = [_HEADER]
    for isa in KERNEL_ISAS:
        target = _TARGETS[isa]
        parts += ["#pragma GCC push_options", f'#pragma GCC target("{target}")' if target else "",
                  f"#define ROLLOUT_LANES {_LANES[isa]}", f"namespace rollout_{isa} {{", body, "}",
                  "#undef ROLLOUT_LANES", "#pragma GCC pop_options"]
    parts.append("PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {")
    parts += [f'  m.def("{fn}_{isa}", &rollout_{isa}::{fn});' for isa in KERNEL_ISAS for fn in FUNCTIONS]
    parts.append("}")
    return "\n".join(parts)


def module_name(name: str, source: str) -> str:
    digest = hashlib.sha256((source + " ".join(build_flags())).encode()).hexdigest()[:10]
    return f"rollout_{name}_{digest}"


def _source() -> str:
    from rollout.layers import cpu_gemm, cpu_norm, cpu_rope, paged_decode_cpu

    return combined_source(paged_decode_cpu.SOURCE + cpu_gemm.SOURCE + cpu_norm.SOURCE + cpu_rope.SOURCE)


def _module() -> Optional[object]:
    """The compiled extension, built once per process; None (the reason logged once) where it
    cannot be built — callers then keep their torch path."""
    name = "cpu_kernels"
    if name in _built or name in _failed:
        return _built.get(name)
    with _lock:
        if name not in _built and name not in _failed:
            try:
                from torch.utils.cpp_extension import load_inline

                source = _source()
                _built[name] = load_inline(module_name(name, source), cpp_sources=[source], functions=None,
                                           extra_cflags=build_flags(), extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as exc:  # no compiler, no headers: the torch path serves
                _failed[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
                logger.warning("CPU kernel %s unavailable (%s); the torch path serves instead", name, _failed[name])
    return _built.get(name)


def kernels_for(isa: str) -> Optional[types.SimpleNamespace]:
    """The kernels of one ISA variant (``FUNCTIONS``). Only ISAs
    this CPU runs are given out (one above it would die on an illegal instruction)."""
    found = _dispatch.get(isa)
    if found is not None:
        return found
    runnable = cpu_capability().runnable_isas
    if isa not in runnable:
        raise ValueError(f"no {isa!r} kernels on this CPU (it runs: {', '.join(runnable)})")
    mod = _module()
    if mod is None:
        return None
    found = _dispatch[isa] = types.SimpleNamespace(isa=isa, **{fn: getattr(mod, f"{fn}_{isa}") for fn in FUNCTIONS})
    return found


def kernels() -> Optional[types.SimpleNamespace]:
    """Every C++ CPU kernel of the project (one compile, ~40 s, then cached), the variant of this
    CPU's ``kernel_isa``: ``paged_decode`` (``rollout.layers.paged_decode_cpu``), ``bf16_linear``
    (``rollout.layers.cpu_gemm``), ``rms_norm`` (``rollout.layers.cpu_norm``) and ``rope_and_cache``
    (``rollout.layers.cpu_rope``). None where it
    cannot be built."""
    return kernels_for(cpu_capability().kernel_isa)


def build_error(name: str = "cpu_kernels") -> Optional[str]:
    """Why ``name`` could not be built (None: built, or not tried yet)."""
    return _failed.get(name)
