"""How many threads a CPU forward computes with: all of this process's, or one while its cores are shared.

A decode step on CPU is a few hundred short parallel regions (each GEMM, the attention, ...) with
Python between them. Between two regions libgomp's idle thread spins before it sleeps; one that has
gone to sleep is woken through the kernel, which on the machines measured costs 50-150 us a region
(~150 regions a step: 5-8 ms of a 25-35 ms SmolLM2 step at 8 rows; ``benchmarks/NOTES.md``). Spinning
long enough to span the gaps keeps the step fast — alone. Beside another process that computes on
the same cores (a trainer, a load-test client) the spinning threads take the cores it needs and both
collapse (a server 30x slower, measured), while one thread a process shares the cores fairly.

``rollout.openmp`` bounds the spin, which shares cores well and costs the sleeps. A process alone
on its cores may spin unbounded instead (``GOMP_SPINCOUNT=300000``) and turn this on
(``kernels.adapt_threads``): ``ThreadGovernor`` watches how much of the time this process's threads were
runnable they spent waiting for a core (the kernel's ``schedstat`` run delay, summed over the
process's threads): alone on its cores that is ~0; when another process computes on them it is a
third or more. Above ``drop_above`` the forwards run on one thread; back on all of them once the share
waiting stays below ``return_below`` after a hold, the hold doubling (up to ``max_hold_s``) each time
the cores turn out to be still shared, so a neighbour that stays costs a probe every half minute at
most. Decisions are made once per window of runnable time, never per step, and the numbers are read
from ``/proc`` (on a kernel without schedstat the governor stays off and says so once). On by default for
bf16 engines, off for fp32 ones and in the batch-invariant mode (``KernelChoice.adapt_threads``):
torch split a reduction over the vocabulary by thread count where there were fewer rows than threads (a
[1, 49152] sum differs in its last bits between one and two), so logprobs computed on one thread differed
from two threads' — a server and an in-process engine of the same model disagreeing while the suite's
other processes ran. That reduction on the decode path (the sampler's ``logsumexp`` for greedy rows and
raw logprobs, ``rollout.layers.sampler.token_logprob``) is now a row-wise ``log_softmax``; a bf16
engine's tokens, output and prompt logprobs are then the same bits on one thread as on two (measured:
prompts of 5-700 tokens, decode at 1-72 rows), an fp32 engine's logprobs are not (oneDNN's fp32 GEMMs and
torch's fp32 reductions split by thread count; ``benchmarks/NOTES.md``). Beside a busy neighbour the
governor keeps a bf16 SmolLM2 engine at 0.6x its speed alone against 0.4x on two threads (AMD EPYC Zen
4).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Optional

import torch

logger = logging.getLogger(__name__)


_run_times_lock = threading.Lock()
_seen: dict[str, tuple[int, int]] = {}  # thread id -> its (on-core, waiting) nanoseconds when last read
_ended = [0, 0]  # the last-read nanoseconds of threads that have ended since


def process_run_times() -> Optional[tuple[float, float]]:
    """(seconds on a core, seconds runnable but waiting for one), summed over this process's
    threads since they started; None where the kernel does not report them. Never decreases: a
    thread that ended keeps the time it had when last read (the kernel drops its entry)."""
    current: dict[str, tuple[int, int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                fields = f.read().split()
        except OSError:  # a thread that ended meanwhile
            continue
        if len(fields) >= 2:
            current[tid] = (int(fields[0]), int(fields[1]))
    with _run_times_lock:
        for tid, (on_cpu, waiting) in _seen.items():
            now = current.get(tid)
            if now is None or now[0] < on_cpu:  # ended (or its id reused by a newer thread)
                _ended[0] += on_cpu
                _ended[1] += waiting
        _seen.clear()
        _seen.update(current)
        on_cpu = _ended[0] + sum(v[0] for v in current.values())
        waiting = _ended[1] + sum(v[1] for v in current.values())
    return on_cpu / 1e9, waiting / 1e9


class ThreadGovernor:
    """Picks the thread count of this process's forwards (see the module's text); ``before_forward``
    on the thread that computes, before each forward."""

    def __init__(self, threads: int, window_s: float = 0.3, drop_above: float = 0.15, return_below: float = 0.05,
                 hold_s: float = 1.0, max_hold_s: float = 30.0,
                 read: Callable[[], Optional[tuple[float, float]]] = process_run_times,
                 clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 get_threads: Callable[[], int] = torch.get_num_threads):
        self.full = threads
        self.current = threads
        self.window_s, self.drop_above, self.return_below = window_s, drop_above, return_below
        self.base_hold_s, self.max_hold_s = hold_s, max_hold_s
        self.hold_s = hold_s
        self._read, self._clock, self._set, self._get = read, clock, set_threads, get_threads
        self._last = read()
        self.enabled = threads > 1 and self._last is not None
        if threads > 1 and self._last is None:
            logger.info("this kernel reports no run delay (/proc/self/task/*/schedstat): forwards keep %d threads "
                        "even where the cores are shared", threads)
        self._hold_until = 0.0
        self._next_read = 0.0
        self._returned_at: Optional[float] = None
        self.num_drops = 0
        self.last_waiting_share = 0.0

    def before_forward(self) -> None:
        if not self.enabled:
            return
        if self._get() != self.current:  # a forward on another thread than the last one's
            self._set(self.current)
        now = self._clock()
        if now < max(self._hold_until, self._next_read):
            return
        # /proc is read a few times per window of wall time, never every step (one file per thread)
        self._next_read = now + self.window_s / 4
        reading = self._read()
        if reading is None:
            return
        on_cpu, waiting = reading[0] - self._last[0], reading[1] - self._last[1]
        if on_cpu + waiting < self.window_s:  # not enough runnable time yet to judge
            return
        self._last = reading
        share = waiting / (on_cpu + waiting)
        self.last_waiting_share = share
        if self.current == self.full and share > self.drop_above:
            self._drop(now, share)
        elif self.current != self.full and share < self.return_below:
            self._returned_at = now
            self._switch(self.full)
            logger.info("cores no longer shared (%.0f%% of runnable time waiting): forwards on %d threads again",
                        100 * share, self.full)

    def _drop(self, now: float, share: float) -> None:
        # back too soon (within a few windows of the last return): the neighbour is still there
        quick = self._returned_at is not None and now - self._returned_at < self.hold_s + 4 * self.window_s
        self.hold_s = min(self.max_hold_s, 2 * self.hold_s) if quick else self.base_hold_s
        self._hold_until = now + self.hold_s
        self.num_drops += 1
        self._switch(1)
        logger.info("cores shared with another computing process (%.0f%% of runnable time waiting for a core): "
                    "forwards on one thread, trying %d again in %.0f s", 100 * share, self.full, self.hold_s)

    def _switch(self, threads: int) -> None:
        self.current = threads
        self._set(threads)
        self._last = self._read() or self._last  # the next window starts now, on the new thread count

    def stats(self) -> dict:
        return {"cpu_threads": self.current, "cpu_thread_drops": self.num_drops,
                "cpu_waiting_share": round(self.last_waiting_share, 3)}
