"""``rollout bench rl-step``: effective samples/s of whole RL steps on the engine's side.

Each step: generate the workload (``grpo-short`` by default) under the current weights; pause
generation; push the trainer's new weights (every parameter, ``update_weights_from_tensor`` from
one flattened bucket, as a colocated trainer does; the new weights are the old ones plus a small
deterministic change, so the model stays the model); the prefix cache is flushed with the update,
so the next step refills it (its prefills run again); continue. Per step it records:

- ``rollout_s``: generation wall time, and within it ``tail_s``: the long tail, from the moment fewer
  than a quarter of the peak batch is still running (or waiting) until the last sample ends — the time
  the last samples hold everyone up (``get_stats`` polled every 0.2 s from another thread);
- ``first_token_s``: the slowest time to first token (the cache refill: every prompt prefilled again);
- ``pause_s`` (pause + continue), ``sync_s`` (the update with its flush);
- ``samples_per_s``: samples over the whole step (rollout + pause + sync).

The trainer's own compute is not in it (``rollout bench rl-modes`` runs whole DeepSpeed loops).
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import threading
import time
from dataclasses import asdict, replace

import torch

from rollout.bench.common import (
    DEFAULT_WORKDIR,
    add_model_flags,
    build_model,
    machine,
    model_label,
    save_figure,
    write_result,
)
from rollout.bench.throughput import (
    SPEC_DRAFT_TOKENS,
    WORKLOADS,
    Features,
    add_feature_flags,
    features_from,
    make_prompts,
    spec_stats,
)
from rollout.engine.engine import run_on_own_thread


class _InFlight:
    """Polls the engine's running/waiting counts from a thread of its own while a rollout runs."""

    def __init__(self, engine, every_s: float = 0.2):
        self.engine, self.every_s = engine, every_s
        self.samples: list[tuple[float, int, int]] = []  # (time, running, running + waiting)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="rl-step-watch", daemon=True)

    def _poll(self):
        while not self._stop.wait(self.every_s):
            st = self.engine.get_stats()
            self.samples.append((time.perf_counter(), st["num_running"], st["num_running"] + st["num_waiting"]))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.end = time.perf_counter()

    @property
    def peak(self) -> int:
        return max((r for _, r, _ in self.samples), default=0)

    def tail_s(self) -> float:
        """From the first poll after the peak with under a quarter of the peak left, to the end."""
        peak_at = next((i for i, (_, r, _) in enumerate(self.samples) if r == self.peak), len(self.samples))
        below = [t for t, _, left in self.samples[peak_at:] if left < self.peak / 4]
        return self.end - below[0] if below else 0.0


def _new_weights(named: list[tuple[str, torch.Tensor]], step: int) -> list[tuple[str, torch.Tensor]]:
    """A trainer step's worth of change: every tensor nudged by a deterministic 1e-3 relative amount."""
    sign = 1.0 if step % 2 else -1.0
    return [(n, t + sign * 1e-3 * t) for n, t in named]


def run(model: str = "smollm2", workload: str = "grpo-short", dtype: str = "bfloat16", steps: int = 3,
        features: Features = Features(), max_num_seqs: int = 256, out_dir: str = "benchmarks/results",
        workdir: str = DEFAULT_WORKDIR, overrides: dict | None = None) -> dict:
    from safetensors.torch import load_file
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from rollout import RolloutEngine, SamplingParams
    from rollout.tools.hf import hf_parameter_order
    from weight_sync import FlattenedTensorBucket

    w = replace(WORKLOADS[workload], **{k: v for k, v in (overrides or {}).items() if v is not None})
    path = build_model(model, workdir)
    prompts = make_prompts(AutoTokenizer.from_pretrained(path), w.num_prompts)
    tdtype = getattr(torch, dtype)

    def trainer_weights():
        by_name = {}
        for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            by_name.update(load_file(f))
        return [(n, by_name[n].to(tdtype)) for n in hf_parameter_order(path) if n in by_name]

    # The trainer's side runs on threads that end: a trainer thread that stays would hold an
    # OpenMP team of its own and slow the engine's (see rollout.engine.engine.run_on_own_thread).
    named = run_on_own_thread(trainer_weights)
    kv_tokens = min(len(prompts) * w.n, max_num_seqs) * (max(map(len, prompts)) + w.max_new_tokens + 32)
    sp = SamplingParams(max_new_tokens=w.max_new_tokens, temperature=1.0, top_k=-1, top_p=1.0, n=w.n, seed=0,
                        ignore_eos=w.ignore_eos)
    label = model_label(model)
    result = {"benchmark": "rl-step", "machine": machine(),
              "config": {"model": label, "dtype": dtype, "workload": asdict(w), "features": asdict(features),
                         "steps": steps, "max_num_seqs": max_num_seqs}, "steps": []}
    with RolloutEngine(path, dtype=dtype, tp_size=features.tp_size, enable_overlap=features.overlap,
                       enable_prefix_caching=features.prefix, enable_cuda_graph=features.graphs,
                       kv_cache_tokens=kv_tokens, max_num_seqs=max_num_seqs, use_generation_config=False,
                       speculative_num_draft_tokens=SPEC_DRAFT_TOKENS if features.speculative else 0) as engine:
        engine.generate(input_ids=prompts[:1], sampling_params=SamplingParams(max_new_tokens=2))  # warm-up
        for step in tqdm(range(steps), desc=f"rl-step {w.name} {label}"):
            before = engine.get_stats()
            t0 = time.perf_counter()
            with _InFlight(engine) as watch:
                # seeds disjoint from step to step (sample i draws with seed + i): no step replays another's draws
                outs = engine.generate(input_ids=prompts, sampling_params=replace(sp, seed=step * 1_000_003))
            rollout_s = time.perf_counter() - t0
            first = max(o.time_to_first_token_s or 0.0 for o in outs)
            bucket = run_on_own_thread(lambda: FlattenedTensorBucket(_new_weights(named, step)))  # not timed
            t1 = time.perf_counter()
            engine.pause_generation()
            t2 = time.perf_counter()
            res = engine.update_weights_from_tensor(bucket, weight_version=f"step-{step + 1}")
            t3 = time.perf_counter()
            engine.continue_generation()
            t4 = time.perf_counter()
            if not res.success:
                raise RuntimeError(f"weight update failed: {res.message}")
            total = t4 - t0
            tokens = sum(len(o.output_token_ids) for o in outs)
            result["steps"].append({
                "rollout_s": rollout_s, "tail_s": watch.tail_s(), "peak_running": watch.peak,
                "first_token_s": first, "pause_s": (t2 - t1) + (t4 - t3), "sync_s": t3 - t2, "step_s": total,
                "samples": len(outs), "tokens": tokens, "samples_per_s": len(outs) / total,
                "tokens_per_s": tokens / total, **spec_stats(before, engine.get_stats())})
    kept = result["steps"][1:] or result["steps"]
    result["summary"] = {k: statistics.fmean(s[k] for s in kept) for k in kept[0]}
    f = features
    stem = f"rl_step_{w.name}_{label}_{dtype}_tp{f.tp_size}_overlap-{'on' if f.overlap else 'off'}" + \
        ("_spec-on" if f.speculative else "")
    write_result(result, out_dir, stem, plot)
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    steps = result["steps"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    x = list(range(1, len(steps) + 1))
    bottom = [0.0] * len(steps)
    parts = [("rollout (before tail)", lambda s: s["rollout_s"] - s["tail_s"]), ("long tail", lambda s: s["tail_s"]),
             ("pause", lambda s: s["pause_s"]), ("weight sync", lambda s: s["sync_s"])]
    for label, fn in parts:
        vals = [fn(s) for s in steps]
        ax.bar(x, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, s in enumerate(steps):
        ax.annotate(f"{s['samples_per_s']:.1f}/s", (x[i], bottom[i]), ha="center", va="bottom", fontsize=7)
    cfg = result["config"]
    ax.set_xticks(x)
    ax.set_xlabel("RL step")
    ax.set_ylabel("seconds")
    ax.set_title(f"rl-step {cfg['workload']['name']} on {cfg['model']} {cfg['dtype']} (samples/s on top)", fontsize=9)
    save_figure(fig, path, ax)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="rollout bench rl-step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap)
    ap.add_argument("--workload", default="grpo-short", choices=[k for k, v in WORKLOADS.items() if not v.score])
    ap.add_argument("--steps", type=int, default=3, help="RL steps (the first warms up and is left out of the summary)")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    add_feature_flags(ap)
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--workdir", default=DEFAULT_WORKDIR)
    args = ap.parse_args(argv)
    res = run(args.model, args.workload, args.dtype, args.steps, features_from(args), args.max_num_seqs, args.out_dir,
              args.workdir, {"num_prompts": args.num_prompts, "n": args.n, "max_new_tokens": args.max_new_tokens})
    s = res["summary"]
    print(f"rl-step: {s['samples_per_s']:.2f} samples/s (rollout {s['rollout_s']:.2f} s of which tail {s['tail_s']:.2f}, "
          f"pause {s['pause_s']:.3f}, sync {s['sync_s']:.3f}, first token {s['first_token_s']:.2f})")
    return res


if __name__ == "__main__":
    main()
