"""OpenMP settings for processes that share cores with other computing processes.

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

Where they are applied: the ``rollout`` command (before it imports torch), the environment of
spawned TP ranks and of the servers the examples start. A library user must set them before
importing torch (``import rollout`` first does, where they are not set already):
``GOMP_SPINCOUNT=2000`` beside other computing processes; ``OMP_NUM_THREADS`` to the cores this
process should use. Values already in the environment are never overridden.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Optional

DEFAULTS = {"GOMP_SPINCOUNT": "2000"}


def apply_defaults(environ=os.environ) -> dict[str, str]:
    """Put ``DEFAULTS`` into ``environ`` where unset; returns what was set. Effective only before
    libgomp loads (``import torch``) in this process, and for every process started after it."""
    set_now = {k: v for k, v in DEFAULTS.items() if k not in environ}
    environ.update(set_now)
    return set_now


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
