"""The decode step taken apart, on any device: what the host spends staging it, what the forward graph and
the sampler graph take on the device (CUDA events; CPU: the wall clock), how many host synchronisations sit
inside it and how many kernels a layer launches. ``scripts/gpu_check.py`` runs it on a GPU; its ``--dry-run``
runs the same code here on a tiny model (the CUDA kernel plan under Triton's interpreter, the graphs'
bodies run eagerly).

- **syncs**: on CUDA, ``torch.cuda.set_sync_debug_mode("warn")`` over staging, both replays and the copy of
  the sampled tokens out of the graph (each warning one synchronisation); everywhere,
  ``rollout.kernels.audit.StepAudit`` over the graphs' bodies (the forward and the sampler), which refuses
  what would synchronise a GPU;
- **launches a layer**: ``StepAudit``'s count inside one decoder layer (operators that launch work and
  Triton kernels); on CUDA also the profiler's kernels in one eager step divided by the layers, and its
  top-20 table.
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Optional

import torch

from rollout.batch import ModelWorkerBatch, SamplingInputs
from rollout.random import uniforms


def decode_batch(rows: int, ctx_len: int, block_size: int, first_block: int = 0) -> ModelWorkerBatch:
    """``rows`` sequences, each ``ctx_len`` tokens long after this step, on blocks of their own."""
    per = -(-ctx_len // block_size)
    tables = [list(range(first_block + i * per, first_block + (i + 1) * per)) for i in range(rows)]
    return ModelWorkerBatch(input_ids=[11 + i % 50 for i in range(rows)], block_tables=tables, ctx_lens=[ctx_len] * rows,
                            q_lens=[1] * rows, logits_rows=list(range(rows)), sample_logits_idx=list(range(rows)),
                            sampling=None)


def rl_sampling(rows: int, top_p: float = 1.0) -> SamplingInputs:
    """What an RL rollout samples with: temperature 1 (top-p when asked), a seed per row."""
    seeds, positions = list(range(rows)), [7] * rows
    return SamplingInputs(temperatures=[1.0] * rows, uniforms=uniforms(seeds, positions).tolist(), seeds=seeds,
                          draw_positions=positions, top_ps=[top_p] * rows if top_p < 1 else None)


class _Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, repeat: int) -> float:
        """Median seconds of ``fn`` on the device (events) or the wall clock (CPU)."""
        times = []
        for _ in range(repeat):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def launches_per_layer(runner, graphs, bs: int) -> dict:
    """``StepAudit`` over one step's forward body and its sampler: launches inside one decoder layer by name,
    their sum, the step's total, the sampler's, and the syncs it saw."""
    from rollout.kernels.audit import StepAudit
    from rollout.layers.sampler import sample_static

    model = runner.model.model
    layer = model.layers[len(model.layers) // 2]
    name = "forward_carried" if model.carry_residual else "forward"
    plain = getattr(layer, name)
    inside: dict = {}

    def counted(*args, **kw):
        before = dict(audit.launches)
        out = plain(*args, **kw)
        inside.update({k: v - before.get(k, 0) for k, v in audit.launches.items() if v != before.get(k, 0)})
        return out

    setattr(layer, name, counted)
    try:
        with torch.inference_mode(), StepAudit(refuse=False) as audit:
            logits = graphs.run(bs)  # the bodies the graphs capture, run eagerly (the graphs' buffers untouched)
            forward_total = audit.num_launches
            sample_static(logits, graphs.sampling, graphs.raw_logprobs, filtered=True)
    finally:
        delattr(layer, name)
    return {"layer": inside, "per_layer": sum(inside.values()), "forward_total": forward_total,
            "sampler": audit.num_launches - forward_total, "audit_syncs": audit.syncs}


def profile_step(runner, graphs, bs: int) -> dict:
    """CUDA: the profiler's kernels in one eager step (the graph's body) per layer, and its top-20 table."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        graphs.run(bs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graphs.run(bs)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    layers = len(runner.model.model.layers)
    return {"kernels_per_step": len(kernels), "kernels_per_layer": len(kernels) / layers,
            "top20": prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)}


def measure(engine, rows_list=(1, 64, 256, 512), ctx_len: int = 256, repeat: int = 20,
            profile_rows: Optional[int] = 64) -> dict:
    """The step at each row count in ``rows_list`` on ``engine`` (its graphs when captured; else a graph
    runner whose bodies run eagerly)."""
    from rollout.executor.cuda_graph_runner import CudaGraphRunner

    runner = engine.worker.model_runner
    graphs = runner.graph_runner
    if graphs is None:
        graphs = CudaGraphRunner(runner, max(rows_list), batch_sizes=tuple(rows_list))
    rows_list = [r for r in rows_list if r <= graphs.max_bs]
    timer = _Timer(runner.device)
    out: dict = {"device": str(runner.device), "graphs": bool(graphs.graphs), "ctx_len": ctx_len, "rows": {}}
    for rows in rows_list:
        batch = decode_batch(rows, ctx_len, runner.block_size)
        if max(t[-1] for t in batch.block_tables) >= runner.kv.num_blocks:
            out["rows"][rows] = {"skipped": "the KV pool is too small for this many rows"}
            continue
        sampling = rl_sampling(rows)
        with torch.inference_mode():
            graphs.replay(batch)  # warm
            n, bs = graphs.last
            t0 = time.perf_counter()
            for _ in range(repeat):
                graphs.stage(batch)
            stage_s = (time.perf_counter() - t0) / repeat
            forward_s = timer(lambda: graphs.replay(batch), repeat)
            sampler_s = timer(lambda: graphs.sample(sampling), repeat)
            step_s = timer(lambda: (graphs.replay(batch), graphs.sample(sampling)), repeat)
            syncs = None
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        graphs.replay(batch)
                        graphs.sample(sampling)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                syncs = sum("synchroniz" in str(w.message) for w in seen)
        entry = {"padded_to": bs, "host_stage_ms": 1e3 * stage_s, "forward_ms": 1e3 * forward_s,
                 "sampler_ms": 1e3 * sampler_s, "step_ms": 1e3 * step_s, "syncs_in_step": syncs}
        entry.update(launches_per_layer(runner, graphs, bs))
        if profile_rows == rows and runner.device.type == "cuda":
            entry["profile"] = profile_step(runner, graphs, bs)
        out["rows"][rows] = entry
    return out
