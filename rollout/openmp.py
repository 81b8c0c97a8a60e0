"""Process-level CPU runtime settings: OpenMP for processes that share cores with other computing
processes, and glibc's allocator for the large temporaries of CPU forwards.

libgomp (torch's OpenMP runtime on Linux) reads its settings once, when it loads — at
``import torch`` — so they must be in the environment before that. By default a libgomp thread
that finds no work spins for up to ~300,000 iterations before it sleeps. Alone on its cores that
keeps the many short parallel regions of a decode step fast; with another process computing on the
same cores (a trainer, a load-test client) the spinning threads take the cores the other process
needs, and both collapse (measured: a server 30x slower beside a client computing with its own
threads). ``DEFAULTS`` bounds the spin (``GOMP_SPINCOUNT=2000``: a waiting thread sleeps after about a
microsecond). Measured on SmolLM2 decode (2 cores, AMD EPYC; ``benchmarks/NOTES.md``): beside a
neighbour computing on two threads of its own, batch 8 / 64 keep 0.51-0.61 / 0.47-0.50 of their
speed alone (libgomp's default spin: 0.23 / 0.25; 20000: 0.19-0.29 / 0.16-0.17), and alone the
steps stay within this machine's run-to-run noise of the default's.

The bound has a price alone: every parallel region of a step then wakes the other thread through
the kernel. Measured on AMD EPYC Zen 4 (SmolLM2 bf16, ``rollout bench limits``, alternating runs;
``benchmarks/NOTES.md``): batch 1 16.0-16.9 ms a step bounded against 13.3 ms at libgomp's default spin;
at batch 8 and 64 within the noise now that a layer is one C++ call. Unbounded, processes that compute
side by side (a trainer and an engine, TP ranks) slow each other: the suite's multi-process tests took
15-75 % longer. So the bound stays; a process alone on its cores may unset it (``GOMP_SPINCOUNT=300000``).
Beside a computing process a bf16 engine's forwards also drop to one thread (``kernels.adapt_threads``, on by
default for bf16 engines: ``rollout.executor.cpu_threads``).

Where they are applied: the ``rollout`` command (before it imports torch), the environment of
spawned TP ranks and of the servers the examples start. A library user must set them before
importing torch (``import rollout`` first does, where they are not set already):
``GOMP_SPINCOUNT=2000`` beside other computing processes; ``OMP_NUM_THREADS`` to the cores this
process should use. Values already in the environment are never overridden.

The allocator (glibc): every block past malloc's mmap threshold (at most 32 MB as glibc adapts it),
and every block a thread other than the main one allocates past its arena's 64 MB heaps, is mapped
afresh and unmapped when freed, so a decode step's logits and sampler temporaries (78 MB each at
128 rows of a 151,936-word vocabulary) page-fault and are zeroed again every step. Measured (AMD
EPYC, on the engine's own thread): a bf16 -> fp32 copy of such logits 44 ms into a new tensor, 7.6 ms
with ``MALLOC_DEFAULTS``; the Qwen2-0.5B-shape decode step at batch 128 1583-1664 -> 1462-1470 ms.
``MALLOC_DEFAULTS`` puts every thread on the main arena and keeps freed blocks up to 1 GB for
reuse (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``): glibc reads them
when a process starts, so they go into children's environments, and ``apply_defaults`` also sets
them in this process through ``mallopt`` (threads started before keep their arenas). The process
then keeps its peak heap; the engine hands free pages back (``malloc_trim``) when it releases
memory. Set any of them yourself to keep glibc's choice (e.g. ``MALLOC_ARENA_MAX=8``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Optional

MALLOC_DEFAULTS = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
                   "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
DEFAULTS = {"GOMP_SPINCOUNT": "2000", **MALLOC_DEFAULTS}
_MALLOPT = {"MALLOC_ARENA_MAX": -8, "MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_TRIM_THRESHOLD_": -1}  # glibc's M_*


def apply_defaults(environ=os.environ) -> dict[str, str]:
    """Put ``DEFAULTS`` into ``environ`` where unset; returns what was set. The OpenMP ones are
    effective only before libgomp loads (``import torch``) in this process, and for every process
    started after it; the allocator ones are also applied to this process (``mallopt``) when
    ``environ`` is its own environment."""
    set_now = {k: v for k, v in DEFAULTS.items() if k not in environ}
    environ.update(set_now)
    if environ is os.environ:
        _mallopt({k: v for k, v in set_now.items() if k in _MALLOPT})
    return set_now


def _mallopt(values: Mapping[str, str]) -> None:
    if not values or not sys.platform.startswith("linux"):
        return
    import contextlib
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl, ...): its allocator does what it does
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        for key, value in values.items():
            libc.mallopt(_MALLOPT[key], int(value))


def child_env(num_threads: Optional[int] = None, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The environment for a process this one starts: ours, with ``DEFAULTS`` where unset and
    ``OMP_NUM_THREADS`` when given."""
    env = dict(os.environ if base is None else base)
    apply_defaults(env)
    if num_threads is not None:
        env["OMP_NUM_THREADS"] = str(num_threads)
    return env


def libgomp_loaded() -> bool:
    """Whether torch (and with it libgomp) is already imported: then settings apply only to children."""
    return "torch" in sys.modules
