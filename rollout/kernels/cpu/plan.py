"""Which GEMM kernel a CPU engine's linear layers run at each number of rows, measured.

The kernels (``KERNELS``), for a layer with weight ``W``:

- ``linear``: plain ``F.linear`` (the reference every other one is tested against);
- ``onednn``: oneDNN with ``W`` packed once in its own dtype (bitwise ``F.linear``'s oneDNN kernel
  for bf16, without reordering the weight on every call);
- ``fp32``: oneDNN over an fp32 copy of a bf16 ``W`` (bf16 products are exact in fp32: only the
  summation order moves; the input is widened, the output rounded back). Without native bf16
  GEMMs this is the fast path from a few rows up; it doubles the weights' memory;
- ``own``: ``rollout.kernels.cpu.ops.bf16_linear``, the project's C++ kernel that reads bf16 (or fp32) ``W`` as it
  is and accumulates in fp32 (small batches: the fewest bytes read, streamed with prefetch);
- ``tiled``: ``rollout.kernels.cpu.ops.tiled_linear``, the project's register-tiled C++ GEMM over fp32
  panels of ``W`` (a copy: 4 bytes a value, so for bf16 weights an fp32 copy like ``fp32``'s, bound
  by ``kernels.fp32_gemm_rows`` as that one is). Measured on AMD EPYC (AVX2, 2 threads): 1.2-2.3x
  oneDNN's fp32 GEMM at 8-16 rows, 1.0-1.2x at 64, even at 128-256.

``plan_gemms`` times every candidate at 1, 2, 4, 8, 9, 16 ... 64 and 256 rows (``own`` up to 64; at 9
because its dot products, on CPUs with AVX512-BF16, end at 8 rows: the choice at 8 would otherwise
hold for 9-15 rows, where ``own`` runs its tiles) for each
weight shape of the model (as many distinct weights as it takes to stream them from memory, as in
a forward; the LM head as the one weight it is) and keeps the fastest per shape and row count;
larger forwards take the choice at 256. The plans are cached on disk per CPU, ISA, torch version,
thread count, dtype and shapes, so an engine measures once per machine and model shape and later
engines load the same choice. Explicit ``kernels.fp32_gemm_rows`` /
``kernels.small_gemm_rows`` bound the candidates (0: never), and with both given nothing is measured.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F

from rollout.kernels.choice import GEMM_KERNELS
from rollout.kernels.cpu import build, ops
from rollout.kernels.cpu.capability import cpu_capability
from rollout.kernels.cpu.packing import PLAIN, GemmPlan, GemmPlans, pack_weight, packed_linear

logger = logging.getLogger(__name__)

KERNELS = GEMM_KERNELS
CANDIDATE_ROWS = (1, 2, 4, 8, 9, 16, 32, 64, 256)
OWN_MAX_ROWS = 64  # the C++ kernel is a small-batch kernel: larger forwards are oneDNN's
STREAM_BYTES = 96 << 20  # distinct weights timed per shape add up to this (beyond the L3 caches seen)
# 3: oneDNN's kernels timed at every row count; 4: the tiled kernel among them; 5: kernels timed in rounds;
# 6: timed at 9 rows too (the small-batch kernel's dot products end at 8)
_CACHE_VERSION = 6
ROUNDS = 5  # rounds of timing, every candidate once per round (_time_rounds)
PRUNABLE = ("linear",)  # kernels dropped from larger row counts once 4x slower than the best
# The layer linears keep the small-batch kernel at a row count where, summed over a layer's linears, it
# is within this fraction of the fastest kernel of each: that kernel reads the weights themselves, and where
# every linear of a decode step takes it the whole layer stack runs as one C++ call
# (rollout.kernels.cpu.fused.decode_stack), which saves more than this (AMD EPYC Zen 4, SmolLM2 bf16 at 8
# rows: ~20 % of the step against layer by layer). Decided for the layer as a whole (the stack needs every
# linear; one linear's timing moves by 10 % between measurements, a layer's sum less), not the LM head's,
# and for bf16 engines only (measured there; fp32 plans take the fastest, so a prompt scored whole or after
# a cached prefix keeps the kernels, and the logprob bits, it had before).
OWN_MARGIN = 0.1


def _segments(choice: dict[int, str]) -> tuple[tuple[int, str], ...]:
    """{rows: kernel} at the candidate rows -> merged segments (a choice holds up to the next candidate)."""
    rows = sorted(choice)
    segs: list[list] = []
    for i, r in enumerate(rows):
        upto = rows[i + 1] - 1 if i + 1 < len(rows) else 1 << 62
        if segs and segs[-1][1] == choice[r]:
            segs[-1][0] = upto
        else:
            segs.append([upto, choice[r]])
    return tuple((u, k) for u, k in segs)


def prepare(kernel: str, w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x @ w.T`` through ``kernel``, its copies of ``w`` built once (what the engine runs)."""
    if kernel == "linear":
        return lambda x: F.linear(x, w)
    packed = pack_weight(w, None, GemmPlan(((1 << 62, kernel),)))
    return lambda x: packed_linear(x, w, None, packed)


def _time_rounds(fns: dict[str, Callable[[], object]], rounds: int = ROUNDS) -> dict[str, float]:
    """The least time of each function over ``rounds`` rounds, each round timing every function once
    in turn: a slow spell of the machine (another process, a neighbour VM) hits every kernel alike
    instead of deciding the choice. Timed one kernel after another (3 runs each), a noisy minute once
    cached a plan that ran the 960x576 q/k/v GEMM on the small-batch kernel at 8 rows, 2x slower there
    than oneDNN (AMD EPYC Zen 4; ``benchmarks/NOTES.md``)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, math.inf)
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


@torch.inference_mode()
def measure(dtype: torch.dtype, shapes: list[tuple[int, int, int]], kernels: list[str],
            rows_list=CANDIDATE_ROWS) -> dict[str, dict[str, dict[int, float]]]:
    """Seconds of one pass over ``copies`` distinct weights of each (out, in, copies) shape, per
    shape, kernel and rows: {"OUTxIN": {kernel: {rows: s}}}. Plain ``F.linear`` 4x slower than the best
    for a shape at some rows is not timed at larger ones (it only falls further behind: the bf16 one
    without native bf16 converts every call). oneDNN's kernels are timed at every row count: they
    are the large-batch kernels, and slow at one row says nothing of 256 (a 4x cut there once made
    an engine run bf16 ``F.linear`` at 224 rows, 538 ms a step of 1.4 s)."""
    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict[str, dict[int, float]]] = {}
    for o, i, copies in shapes:
        weights = [(torch.randn(o, i, generator=gen) * 0.05).to(dtype) for _ in range(copies)]
        fns = {k: [prepare(k, w) for w in weights] for k in kernels}
        times: dict[str, dict[int, float]] = {k: {} for k in kernels}
        live = list(kernels)
        for rows in rows_list:
            x = torch.randn(rows, i, generator=gen).to(dtype)
            live = [k for k in live if k != "own" or rows <= OWN_MAX_ROWS]
            for k, t in _time_rounds({k: (lambda fs=fns[k]: [f(x) for f in fs]) for k in live}).items():
                times[k][rows] = t
            best = min(times[k][rows] for k in live)
            keep = [k for k in live if k not in PRUNABLE or times[k][rows] <= 4 * best]
            if all(k == "own" for k in keep):  # larger forwards need one of oneDNN's kernels: keep the fastest
                keep.append(min((k for k in live if k != "own"), key=lambda k: times[k][rows]))
            live = keep
        out[f"{o}x{i}"] = times
        del weights, fns
    return out


def _cache_path() -> str:
    root = os.environ.get("ROLLOUT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "rollout-worker")
    return os.path.join(root, "cpu_gemm_plans.json")


def _read_cache() -> dict:
    try:
        with open(_cache_path()) as f:
            data = json.load(f)
        return data if data.get("version") == _CACHE_VERSION else {}
    except (OSError, ValueError):
        return {}


def _store_first(key: str, value: dict) -> dict:
    """Store ``value`` under ``key`` unless a plan is there already, and return the stored one: the
    first process to measure wins (the TP ranks of one engine measure at once and must agree, and
    every later engine on this machine must choose as the first did)."""
    import fcntl

    path = _cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = _read_cache() or {"version": _CACHE_VERSION}
            stored = data.setdefault("plans", {}).setdefault(key, value)
            if stored is value:
                fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1)
                os.replace(tmp, path)  # readers see the old file or the new one, never half of one
            return stored
    except OSError as exc:  # a read-only home: measured again next time
        logger.info("could not cache the CPU GEMM plan at %s (%s)", path, exc)
        return value


def candidates(dtype: torch.dtype, fp32_rows: Optional[int], small_rows: Optional[int]) -> list[str]:
    """The kernels a CPU engine of ``dtype`` may use here."""
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16):
        return ["linear"]
    built = ops.load() is not None
    own = small_rows != 0 and built
    if dtype == torch.float32:
        return ["linear", "onednn", *(["own"] if own else []), *(["tiled"] if built else [])]
    # oneDNN packs bf16 weights only where it has native bf16; elsewhere the base is plain F.linear
    out = [_bf16_base()]
    if fp32_rows != 0:
        out.append("fp32")
    if own:
        out.append("own")
    if fp32_rows != 0 and built:
        out.append("tiled")
    return out


def _bf16_base() -> str:
    return "onednn" if cpu_capability().onednn_bf16 else "linear"


def _allowed(kernel: str, rows: int, fp32_rows: Optional[int], small_rows: Optional[int],
             dtype: torch.dtype = torch.bfloat16) -> bool:
    if kernel == "own" and rows > OWN_MAX_ROWS:
        return False
    fp32_copy = kernel == "fp32" or (kernel == "tiled" and dtype != torch.float32)
    if fp32_copy and fp32_rows is not None:
        return rows >= fp32_rows > 0
    if kernel == "own" and small_rows is not None:
        return rows <= small_rows
    return True


def _timed(kernels: dict[str, dict[int, float]], at: int, rows: int, fp32_rows: Optional[int],
           small_rows: Optional[int], dtype: torch.dtype) -> dict[str, float]:
    """Each kernel allowed at ``rows`` with its time at the candidate row count ``at``."""
    return {k: t[at] for k, t in kernels.items() if at in t and _allowed(k, rows, fp32_rows, small_rows, dtype)}


def _stack_rows(timings: dict[tuple[int, int], dict[str, dict[int, float]]], shapes: list[tuple[int, int]],
                dtype: torch.dtype, fp32_rows: Optional[int], small_rows: Optional[int]) -> frozenset:
    """The candidate row counts at which every linear of a layer (``shapes``, one per linear) keeps the
    small-batch kernel: its time summed over them within ``OWN_MARGIN`` of the fastest kernels' sum."""
    if dtype != torch.bfloat16:
        return frozenset()
    kept = set()
    for at in CANDIDATE_ROWS:
        timed = [_timed(timings[s], at, at, fp32_rows, small_rows, dtype) for s in shapes]
        if timed and all("own" in t for t in timed) and \
                sum(t["own"] for t in timed) <= (1 + OWN_MARGIN) * sum(min(t.values()) for t in timed):
            kept.add(at)
    return frozenset(kept)


def _choose(timings: dict[str, dict[int, float]], dtype: torch.dtype, fp32_rows: Optional[int],
            small_rows: Optional[int], how: str, own_at: frozenset = frozenset()) -> GemmPlan:
    """The fastest timed kernel at each row count, or the small-batch one at the candidate row counts
    ``own_at`` (``_stack_rows``, for a layer's linear)."""
    # explicit bounds are honoured at their own row counts, timed as the candidate just below
    points = sorted({*CANDIDATE_ROWS, OWN_MAX_ROWS + 1, *([fp32_rows] if fp32_rows else []),
                     *([small_rows + 1] if small_rows else [])})
    choice = {}
    for r in points:
        at = max(c for c in CANDIDATE_ROWS if c <= r)
        timed = _timed(timings, at, r, fp32_rows, small_rows, dtype)
        if not timed:
            choice[r] = _bf16_base() if dtype == torch.bfloat16 else "linear"
            continue
        choice[r] = "own" if at in own_at and "own" in timed else min(timed, key=timed.get)
    return GemmPlan(_segments(choice), how, timings)


def _copies(shapes: list[tuple[int, int]], num_layers: int) -> int:
    """Distinct weights per layer shape to time: as many layers as stream from memory, as in a forward."""
    layer_bytes = sum(o * i for o, i in shapes) * 4
    return max(1, min(num_layers, -(-STREAM_BYTES // max(layer_bytes, 1))))


def plan_gemms(dtype: torch.dtype, shapes: list[tuple[int, int]], num_layers: int,
               fp32_rows: Optional[int] = None, small_rows: Optional[int] = None,
               head_shape: Optional[tuple[int, int]] = None, kernel: Optional[str] = None) -> GemmPlans:
    """The plans for a CPU engine of ``dtype`` whose layers have these (out, in) weight shapes (and
    an LM head of ``head_shape``, timed as the one weight it is): one per shape. ``kernel``: that one
    at every row count for every shape (nothing measured; it must be one this engine can run here)."""
    all_shapes = list(dict.fromkeys([*shapes, *([head_shape] if head_shape else [])]))
    if kernel is not None:
        allowed = ["linear", *candidates(dtype, None, None)]
        if "onednn" in allowed and dtype == torch.bfloat16:
            allowed.append("chunked")  # the batch-invariant mode's (rollout.kernels.cpu.invariant)
        if kernel not in allowed:
            raise ValueError(f"kernels.gemm={kernel!r} cannot run for {dtype} here; this CPU and build offer: "
                             f"{', '.join(dict.fromkeys(allowed))}")
        return GemmPlans(tuple((s, GemmPlan(((1 << 62, kernel),), "fixed")) for s in all_shapes))
    kernels = candidates(dtype, fp32_rows, small_rows)
    if dtype == torch.bfloat16 and fp32_rows is not None and small_rows is not None:  # fully given: nothing to measure
        choice = {}
        bounds = {1, OWN_MAX_ROWS + 1, *([small_rows + 1] if small_rows else []), *([fp32_rows] if fp32_rows else [])}
        for r in sorted(bounds):
            choice[r] = next((k for k in ("own", "fp32") if k in kernels and _allowed(k, r, fp32_rows, small_rows)),
                             _bf16_base())
        return GemmPlans(tuple((s, GemmPlan(_segments(choice), "fixed")) for s in all_shapes))
    if kernels == ["linear"]:
        return GemmPlans(tuple((s, PLAIN) for s in all_shapes))
    cap = cpu_capability()
    own = build.module_name("bf16_gemm", build.source_text()) if "own" in kernels else "-"  # new source: new key
    copies = _copies(shapes, num_layers)
    timed_shapes = [(o, i, copies if (o, i) in shapes else 1) for o, i in all_shapes]
    key = (f"{cap.cpu_model}|{cap.kernel_isa}|{own}|bf16 {cap.onednn_bf16}|torch {torch.__version__}|threads "
           f"{torch.get_num_threads()}|{str(dtype)}|{timed_shapes}|{','.join(kernels)}")
    cached = _read_cache().get("plans", {}).get(key)
    how = "cached"
    if cached is None:
        t0 = time.perf_counter()
        cached = _store_first(key, {"timings": measure(dtype, timed_shapes, kernels)})
        how = "measured"
        logger.info("measured CPU GEMM kernels for %s in %.2fs", dtype, time.perf_counter() - t0)
    timings = {(o, i): {k: {int(r): t for r, t in v.items()} for k, v in cached["timings"][f"{o}x{i}"].items()}
               for o, i in all_shapes}
    own_at = _stack_rows(timings, shapes, dtype, fp32_rows, small_rows)
    return GemmPlans(tuple((s, _choose(timings[s], dtype, fp32_rows, small_rows, how,
                                       own_at if s in shapes else frozenset()))  # the LM head: the fastest
                           for s in all_shapes))
