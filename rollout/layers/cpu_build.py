"""Building the project's C++ CPU kernels: one recipe, keyed by the instruction set.

Each kernel is C++ compiled on first use with the machine's compiler
(``torch.utils.cpp_extension.load_inline``, cached under ``TORCH_EXTENSIONS_DIR``). The flags name
the ISA of ``cpu_capability().kernel_isa`` (never ``-march=native``) and no ``-ffast-math``
(no licence to reassociate sums or approximate functions): results are the same on every CPU
that runs the same ISA build. The module name carries the ISA and a hash of source and flags, so
a cache filled on one processor (or by older source) is never loaded for another.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import Optional

from rollout.layers.cpu_capability import cpu_capability

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_built: dict[str, object] = {}
_failed: dict[str, str] = {}


def build_flags() -> list[str]:
    cap = cpu_capability()
    # -ffp-contract=fast: a * b + c may become one FMA (torch builds in ISO C++ mode, where GCC
    # contracts nothing); it changes no order of operations, and a build gives the same bits every run
    return ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=fast", *cap.compile_flags,
            f"-DROLLOUT_LANES={cap.vector_lanes}"]


def module_name(name: str, source: str) -> str:
    flags = build_flags()
    digest = hashlib.sha256((source + " ".join(flags)).encode()).hexdigest()[:10]
    return f"rollout_{name}_{cpu_capability().kernel_isa}_{digest}"


def build(name: str, source: str, functions: list[str]) -> Optional[object]:
    """The compiled module for this CPU's kernel ISA, built once per process; None (the reason
    logged once) where it cannot be built — callers then keep their torch path."""
    if name in _built or name in _failed:
        return _built.get(name)
    with _lock:
        if name not in _built and name not in _failed:
            try:
                from torch.utils.cpp_extension import load_inline

                _built[name] = load_inline(module_name(name, source), cpp_sources=[source], functions=functions,
                                           extra_cflags=build_flags(), extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as exc:  # no compiler, no headers: the torch path serves
                _failed[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
                logger.warning("CPU kernel %s unavailable (%s); the torch path serves instead", name, _failed[name])
    return _built.get(name)


def kernels() -> Optional[object]:
    """Every C++ CPU kernel of the project in one extension (one compile, ~30 s, then cached):
    ``paged_decode`` (``rollout.layers.paged_decode_cpu``), ``bf16_linear`` (``rollout.layers.cpu_gemm``)
    and ``rms_norm`` (``rollout.layers.cpu_norm``). None where it cannot be built."""
    built = _built.get("cpu_kernels")  # every linear layer asks: the hot path is one dict lookup
    if built is not None:
        return built
    from rollout.layers import cpu_gemm, cpu_norm, paged_decode_cpu

    return build("cpu_kernels", paged_decode_cpu.SOURCE + cpu_gemm.SOURCE + cpu_norm.SOURCE,
                 ["paged_decode", "bf16_linear", "rms_norm"])


def build_error(name: str = "cpu_kernels") -> Optional[str]:
    """Why ``name`` could not be built (None: built, or not tried yet)."""
    return _failed.get(name)
