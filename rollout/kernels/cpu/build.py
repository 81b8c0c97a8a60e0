"""Building the project's C++ CPU kernels: one extension holding every instruction set's variant.

The source is C++ files in ``csrc/``: ``vec.h`` (the vector helpers every family shares) and one file per
kernel family (``SOURCES``, in the order they are included: a later family may call an earlier one's
functions). The kernels (``paged_decode``, ``bf16_linear``, ``tile_pack`` / ``tiled_linear``, ``rms_norm``,
``rope_and_cache``, ``sample_rows``, ``silu_mul``, ``scatter_scaled``, ``decode_layer``, ``moe_experts``, the
delta-push passes ``delta_*``) are C++
compiled on first use with the machine's compiler (``torch.utils.cpp_extension.load``, cached under
``TORCH_EXTENSIONS_DIR``). Their source is
compiled once per instruction set of ``cpu_capability.KERNEL_ISAS``, each copy in its own
translation unit and namespace under ``#pragma GCC target`` naming the ISA's extensions exactly (never
``-march=native``), with vectors of that ISA's width (``ROLLOUT_LANES``); a last unit holds the Python
bindings. The units include only the ATen headers they use (``torch/extension.h`` alone costs ~45 s
of compiler time) and ninja compiles them side by side. Which copy runs is decided at run time by the
CPU that runs it (``cpu_capability().kernel_isa``), so one build serves every processor it may be
found on, and a machine tests the variants below its own in the same process (``kernels_for``). No
``-ffast-math``: no licence to reassociate sums or approximate functions; results are the same on
every CPU that runs the same variant.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import types
from typing import Optional

from rollout.kernels.cpu.capability import KERNEL_ISAS, cpu_capability

logger = logging.getLogger(__name__)

FUNCTIONS = ("paged_decode", "bf16_linear", "tile_pack", "tiled_linear", "rms_norm", "rope_and_cache", "sample_rows",
             "silu_mul", "scatter_scaled", "decode_layer", "decode_stack", "moe_experts", "delta_fingerprint",
             "delta_diff_many", "delta_fingerprint_at", "delta_apply_many", "delta_check_many")
# passes over a whole model's weights that a trainer's or an engine's other threads need not wait behind: their
# bindings let go of the GIL while they run (their arguments are converted, and their result made, holding it)
RELEASE_GIL = frozenset(fn for fn in FUNCTIONS if fn.startswith("delta_"))
# the extensions each variant is compiled for, and its fp32 lanes per vector
CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# the kernel families' files, included in this order after vec.h; decode_layer / decode_stack (layer.cpp)
# and moe_experts (moe.cpp) call the kernels before them
SOURCES = ("paged_decode", "gemm", "norm", "rope", "sample", "act", "copy", "layer", "moe", "delta")
_TARGETS = {"generic": None, "avx2": "avx2,fma,f16c", "avx512": "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
            "avx512bf16": "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c"}
_LANES = {"generic": 4, "avx2": 8, "avx512": 16, "avx512bf16": 16}
# variants whose source takes AVX512-BF16's dot products (csrc/gemm.cpp's dot_rows)
_BF16_DOT = {"avx512bf16"}
_BINDING_HEADER = '#include "bindings.h"\n'

_lock = threading.Lock()
_built: dict[str, object] = {}
_failed: dict[str, str] = {}
_dispatch: dict[str, types.SimpleNamespace] = {}


def build_flags() -> list[str]:
    # -ffp-contract=fast: a * b + c may become one FMA where the variant's ISA has it (torch builds in
    # ISO C++ mode, where GCC contracts nothing); it changes no order of operations, and a build
    # gives the same bits every run
    return ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=fast"]


def declarations(body: str) -> str:
    """The C++ declaration of every function of ``FUNCTIONS`` defined in ``body`` (for the bindings'
    unit, which sees no kernel code)."""
    found = []
    for fn in FUNCTIONS:
        m = re.search(r"^(at::Tensor " + fn + r"\([^)]*\))\s*\{", body, re.M)
        if m is None:
            raise ValueError(f"kernel source defines no `at::Tensor {fn}(...) {{` at the start of a line")
        found.append(m.group(1) + ";")
    return "\n".join(found)


def translation_units(body: str) -> dict[str, str]:
    """One unit per ISA (``kernels_<isa>.cpp``, namespace ``rollout_<isa>``) including ``vec.h`` and the
    ``SOURCES`` files, and the Python bindings ``<fn>_<isa>`` (``bindings.cpp``), by file name; ``body``
    (the files' text, ``source_text()``) names the functions the bindings declare."""
    decls = declarations(body)
    parts = [_BINDING_HEADER] + [f"namespace rollout_{isa} {{\n{decls}\n}}" for isa in KERNEL_ISAS]
    parts.append("PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {")
    guard = ", py::call_guard<py::gil_scoped_release>()"
    parts += [f'  m.def("{fn}_{isa}", &rollout_{isa}::{fn}{guard if fn in RELEASE_GIL else ""});'
              for isa in KERNEL_ISAS for fn in FUNCTIONS]
    parts += ["}", ""]
    units = {"bindings.cpp": "\n".join(parts)}  # first: the longest to compile, ninja starts it first
    includes = [f'#include "{name}"' for name in ("vec.h",) + tuple(f"{s}.cpp" for s in SOURCES)]
    for isa in KERNEL_ISAS:
        target = _TARGETS[isa]
        units[f"kernels_{isa}.cpp"] = "\n".join([
            '#include "prelude.h"', "#pragma GCC push_options", f'#pragma GCC target("{target}")' if target else "",
            f"#define ROLLOUT_LANES {_LANES[isa]}", f"#define ROLLOUT_BF16_DOT {int(isa in _BF16_DOT)}",
            f"namespace rollout_{isa} {{", *includes, "}",
            "#pragma GCC pop_options", ""])
    return units


def module_name(name: str, source: str) -> str:
    digest = hashlib.sha256((source + " ".join(build_flags())).encode()).hexdigest()[:10]
    return f"rollout_{name}_{digest}"


def source_text() -> str:
    """``vec.h`` and every ``SOURCES`` file, in the order the units include them."""
    names = ("prelude.h", "bindings.h", "vec.h") + tuple(f"{name}.cpp" for name in SOURCES)
    return "".join(open(os.path.join(CSRC, name)).read() for name in names)


def _write_sources(module: str, units: dict[str, str]) -> list[str]:
    """The units as files in ``<extensions dir>/<module>_src`` (written whole, then renamed into place,
    so processes building at once never read a half-written file)."""
    from torch.utils.cpp_extension import get_default_build_root

    folder = os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root(), module + "_src")
    os.makedirs(folder, exist_ok=True)
    paths = []
    for fname, text in units.items():
        path = os.path.join(folder, fname)
        try:
            with open(path) as f:
                same = f.read() == text
        except OSError:
            same = False
        if not same:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        paths.append(path)
    return paths


def _module() -> Optional[object]:
    """The compiled extension, built once per process; None (the reason logged once) where it
    cannot be built — callers then keep their torch path."""
    name = "cpu_kernels"
    if name in _built or name in _failed:
        return _built.get(name)
    with _lock:
        if name not in _built and name not in _failed:
            try:
                from torch.utils.cpp_extension import load

                body = source_text()
                units = translation_units(body)
                module = module_name(name, body + "".join(units[k] for k in sorted(units)))
                _built[name] = load(module, sources=_write_sources(module, units), extra_cflags=build_flags(),
                                    extra_include_paths=[CSRC], extra_ldflags=["-fopenmp"], verbose=False)
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
    """Every C++ CPU kernel of the project (one build, ~30-45 s on two cores, then cached), the variant of
    this CPU's ``kernel_isa``: ``paged_decode`` (``csrc/paged_decode.cpp``), ``bf16_linear``, ``tile_pack``
    and ``tiled_linear`` (``gemm.cpp``), ``rms_norm`` (``norm.cpp``), ``rope_and_cache`` (``rope.cpp``),
    ``sample_rows`` (``sample.cpp``), ``silu_mul`` (``act.cpp``), ``scatter_scaled`` (``copy.cpp``),
    ``decode_layer`` and ``decode_stack`` (``layer.cpp``), ``moe_experts`` (``moe.cpp``), ``delta_fingerprint``,
    ``delta_diff_many``, ``delta_fingerprint_at``, ``delta_apply_many`` and ``delta_check_many``
    (``delta.cpp``); their Python faces are
    ``rollout.kernels.cpu.ops`` and ``.fused``. None where it cannot be built."""
    return kernels_for(cpu_capability().kernel_isa)


def build_error(name: str = "cpu_kernels") -> Optional[str]:
    """Why ``name`` could not be built (None: built, or not tried yet)."""
    return _failed.get(name)
