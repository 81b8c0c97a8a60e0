"""``rollout bench limits``: this machine's ceilings at the model's own decode shapes, and the
engine's decode step against them, in one run.

- memory: read GB/s (a reduction over a buffer as large as the model's weights) and copy GB/s;
- matmul FLOP/s of every linear shape of the model (QKV, O, gate-up, down, LM head) at each batch,
  with every GEMM kernel the engine can dispatch to here (``rollout.kernels.cpu.plan``);
- the **GEMM-only decode step**: every linear layer of one decode step at that batch (the LM head
  included), no attention, sampling or Python between them, each with the fastest of those kernels
  for it (plain ``F.linear``, oneDNN with a packed weight, oneDNN over fp32 copies of bf16 weights,
  the C++ bf16 kernel) — the arithmetic floor of a step;
- the **weight-read time**: the model's weight bytes over the read bandwidth — the floor of a
  small-batch step, which must read every weight once;
- the engine's decode step (``generate``, RL-shaped: prompts x n samples, temperature 1, logprobs),
  from the scheduler's decode-step clock (the whole step: scheduling, inputs, forward, sampling,
  results), split into forward, sampling and the rest; with ``--profile``, the torch profiler's
  top operators of a few decode steps per batch size.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from rollout.bench.common import (
    DEFAULT_WORKDIR,
    add_engine_arg_flag,
    add_model_flags,
    build_model,
    machine,
    model_label,
    parse_engine_args,
    save_figure,
    timed,
    write_result,
)
from rollout.engine.engine import run_on_own_thread

DEFAULT_BATCHES = (1, 8, 64, 256)


def linear_shapes(path: str, tp_size: int = 1) -> list[tuple[str, int, int, int]]:
    """(name, out features, in features, count per decode step) of every linear of one rank."""
    from rollout.models import ModelConfig

    cfg = ModelConfig.from_pretrained(path)
    hd, h = cfg.head_dim, cfg.hidden_size
    q, kv = cfg.num_attention_heads * hd // tp_size, max(1, cfg.num_key_value_heads // tp_size) * hd
    inter, layers = cfg.intermediate_size // tp_size, cfg.num_hidden_layers
    return [("qkv", q + 2 * kv, h, layers), ("o", h, q, layers), ("gate_up", 2 * inter, h, layers),
            ("down", h, inter, layers), ("lm_head", cfg.vocab_size // tp_size, h, 1)]


def weight_bytes(path: str, dtype: torch.dtype) -> int:
    """Bytes of the model's parameters in ``dtype`` (tied embeddings counted once)."""
    from rollout.models import ModelConfig

    cfg = ModelConfig.from_pretrained(path)
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = sum(o * i for name, o, i, _ in linear_shapes(path) if name != "lm_head") + 2 * cfg.hidden_size
    numel = per_layer * cfg.num_hidden_layers + cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return numel * elem + cfg.hidden_size * elem


def _synced(fn, device: torch.device):
    if device.type != "cuda":
        return fn

    def run():
        fn()
        torch.cuda.synchronize(device)
    return run


def memory_bandwidth(nbytes: int, repeats: int, device: torch.device) -> dict:
    """Read GB/s (sum over ``nbytes`` viewed as fp32: one pass, vectorised) and copy GB/s (bytes
    copied per second; each byte is read once and written once)."""
    n = max(1, nbytes // 4)
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    read_s = timed(_synced(lambda: src.sum(), device), repeats)
    copy_s = timed(_synced(lambda: dst.copy_(src), device), repeats)
    return {"buffer_bytes": n * 4, "read_s": read_s, "read_gb_s": n * 4 / read_s / 1e9,
            "copy_s": copy_s, "copy_gb_s": n * 4 / copy_s / 1e9}


def _kernels(w: torch.Tensor, device: torch.device) -> dict:
    """Every GEMM kernel the engine can dispatch to for a ``w.dtype`` model on this machine
    (``rollout.kernels.cpu.plan``): plain ``F.linear`` and, on CPU, oneDNN over a packed copy, oneDNN
    over an fp32 copy of bf16 weights, the C++ kernel reading bf16 weights — each exactly as the
    engine runs it."""
    if device.type != "cpu":
        return {"linear": lambda x: F.linear(x, w)}
    from rollout.kernels.cpu.plan import candidates, prepare

    return {k: prepare(k, w) for k in dict.fromkeys(["linear", *candidates(w.dtype, None, None)])}


@torch.inference_mode()
def gemm_steps(shapes, batches, dtype: torch.dtype, repeats: int, device: torch.device, progress=None) -> dict:
    """Per batch size: each linear shape of one decode step with every kernel, over as many distinct
    weights as a step has of it (so they stream from memory as in the model, not from cache):
    seconds and FLOP/s. The GEMM-only step takes the fastest kernel of each shape."""
    out = {str(b): {"gemm_step_s": 0.0, "shapes": {}} for b in batches}
    every: list[torch.Tensor] = []
    for name, out_f, in_f, count in shapes:
        weights = [torch.randn(out_f, in_f, dtype=dtype, device=device) for _ in range(count)]
        if device.type == "cuda":
            every.extend(weights)
        kernels = [_kernels(w, device) for w in weights]
        for b in batches:
            x = torch.randn(b, in_f, dtype=dtype, device=device)
            times = {k: timed(_synced(lambda k=k: [ks[k](x) for ks in kernels], device), repeats)
                     for k in kernels[0]}
            best = min(times, key=times.get)
            out[str(b)]["shapes"][name] = {"shape": [b, in_f, out_f], "count": count, "s": times[best], "kernel": best,
                                           "kernels_s": times, "gflop_s": 2 * b * in_f * out_f * count / times[best] / 1e9}
            out[str(b)]["gemm_step_s"] += times[best]
        if progress is not None:
            progress.update(1)
    if device.type == "cuda":  # the floor: every GEMM of a step replayed from one graph, timed by events
        for b in batches:
            out[str(b)]["gemm_step_loop_s"] = out[str(b)]["gemm_step_s"]  # launched from Python, synced
            out[str(b)]["gemm_step_s"] = graphed_gemm_step(every, b, repeats)
    return out


@torch.inference_mode()
def graphed_gemm_step(weights: list[torch.Tensor], rows: int, repeats: int) -> float:
    """CUDA: seconds of one decode step's GEMMs alone (``rows`` x every weight, in order), captured in a graph
    and timed with events over ``repeats`` replays: what the forward cannot beat, with no launch cost in it."""
    device = weights[0].device
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype, device=device) for w in weights}

    def step():
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def engine_decode_steps(path: str, dtype: str, batches, context: int, steps: int, tp_size: int, overlap: bool,
                        profile_dir=None, progress=None, engine_args: dict | None = None,
                        kernels: dict | None = None) -> dict:
    """The engine's decode step at each batch size (and, into ``kernels``, what it dispatches to):
    B samples (B/8 prompts x n=8, or one prompt when B < 8) of ``context`` random prompt tokens,
    ``steps`` new tokens each, sampled at temperature 1 with logprobs, EOS ignored. Means over the
    decode-only steps."""
    from rollout import RolloutEngine, SamplingParams

    out = {}
    max_b = max(batches)
    kv_tokens = max_b * (context + steps + 2 * 16) + 64
    with RolloutEngine(path, dtype=dtype, tp_size=tp_size, enable_overlap=overlap, kv_cache_tokens=kv_tokens,
                       max_num_seqs=max_b, use_generation_config=False, seed=0, **(engine_args or {})) as engine:
        if kernels is not None:
            runner = engine.worker.model_runner
            kernels.update(gemm_plans=runner.gemm_plans.as_dict(), gemm_plans_text=runner.gemm_plans.describe(),
                           paged_attention=runner.use_paged_kernel)
        vocab = engine.model_config.vocab_size
        gen = torch.Generator().manual_seed(0)
        for b in batches:
            n = 8 if b >= 8 else 1
            prompts = [torch.randint(10, vocab, (context,), generator=gen).tolist() for _ in range(b // n)]
            sp = SamplingParams(max_new_tokens=steps, temperature=1.0, top_k=-1, top_p=1.0, n=n, seed=1,
                                ignore_eos=True)
            engine.generate(input_ids=[p[:8] for p in prompts], sampling_params=SamplingParams(
                max_new_tokens=3, n=n, ignore_eos=True, temperature=1.0))  # warm-up at this batch size
            before = engine.get_stats()
            engine.generate(input_ids=prompts, sampling_params=sp)
            after = engine.get_stats()
            num = after["num_decode_steps"] - before["num_decode_steps"]
            step = (after["decode_step_time_s"] - before["decode_step_time_s"]) / max(num, 1)
            fwd = (after["decode_forward_time_s"] - before["decode_forward_time_s"]) / max(num, 1)
            smp = (after["decode_sample_time_s"] - before["decode_sample_time_s"]) / max(num, 1)
            mean_b = (after["decode_step_batch"] - before["decode_step_batch"]) / max(num, 1)
            out[str(b)] = {"step_s": step, "forward_s": fwd, "sample_s": smp, "other_s": max(0.0, step - fwd - smp),
                           "num_steps": num, "mean_batch": mean_b, "context": [context, context + steps],
                           # preemptions, graph replays, eager decode steps and graph samplings in the run
                           **{k: after[k] - before[k] for k in ("num_preemptions", "num_graph_replays",
                                                                "num_eager_decode_steps", "num_graph_samples")},
                           # the thread count its forwards ended on and how often they dropped to one
                           # (rollout.executor.cpu_threads: cores shared with another computing process)
                           **{k: after[k] for k in ("cpu_threads", "cpu_thread_drops") if k in after}}
            if profile_dir is not None:
                out[str(b)]["profile"] = _profile(engine, b, context + steps // 2, 5, profile_dir)
            if progress is not None:
                progress.update(1)
    return out


def step_events(path: str, dtype: str, batches, context: int, engine_args: dict | None = None) -> dict:
    """CUDA: host staging, forward graph and sampler graph of a decode step at each batch, by events."""
    from rollout import RolloutEngine
    from rollout.bench.step import measure

    max_b = max(batches)
    args = {"max_num_seqs": max_b, "cuda_graph_max_bs": max_b, **(engine_args or {})}
    with RolloutEngine(path, dtype=dtype, kv_cache_tokens=max_b * (context + 32) + 64, **args) as engine:
        return measure(engine, tuple(batches), ctx_len=context, profile_rows=None)


def _profile(engine, batch: int, context: int, steps: int, out_dir: str) -> str:
    """Top operators (self CPU time) of ``steps`` decode steps at this batch and context, run by
    the engine's TP worker on the engine's loop thread (where steps run) over KV blocks of its
    pool: decode only, no prefill, no scheduler. The table is written next to the results."""
    from torch.profiler import ProfilerActivity, profile

    from rollout.batch import ModelWorkerBatch, SamplingInputs

    worker = engine.worker
    per_seq = -(-(context + 1) // worker.model_runner.block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]

    def decode_step():
        b = ModelWorkerBatch(input_ids=[11] * batch, block_tables=tables, ctx_lens=[context + 1] * batch,
                             q_lens=[1] * batch, logits_rows=list(range(batch)),
                             sample_logits_idx=list(range(batch)),
                             sampling=SamplingInputs(temperatures=[1.0] * batch, uniforms=[0.5] * batch))
        result = worker.forward_batch_generation(b)
        if result.delay_sample_func is not None:
            result = result.delay_sample_func(b.sampling)
        result.next_token_ids.tolist()

    def run():
        decode_step()  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                decode_step()
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)

    table = engine._loop.call(run)
    path = os.path.join(out_dir, f"profile_b{batch}.txt")
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "w") as f:
        f.write(f"{steps} decode steps, batch {batch}, context {context + 1}\n{table}")
    return path


NEIGHBOUR_BATCHES = (8, 64)
_NEIGHBOUR = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
a = torch.randn(384, 384)
end = time.monotonic() + float(sys.argv[2])
print("ready", flush=True)
while time.monotonic() < end:  # matmuls with its own OpenMP team until killed (or the time limit)
    (a @ a).sum()
"""


def busy_neighbour(threads: int, limit_s: float = 1800.0):
    """A second process doing matmuls on ``threads`` threads of its own (the environment this
    process would give its children: ``rollout.openmp.child_env``), started and ready; the caller
    terminates it. It stops by itself after ``limit_s``."""
    import subprocess
    import sys

    from rollout.openmp import child_env

    proc = subprocess.Popen([sys.executable, "-c", _NEIGHBOUR, str(threads), str(limit_s)], env=child_env(),
                            stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError("the busy neighbour did not start")
    return proc


def run(model: str, dtype: str = "bfloat16", batches=DEFAULT_BATCHES, context: int = 128, steps: int = 16,
        tp_size: int = 1, overlap: bool = False, repeats: int = 5, profile: bool = False,
        out_dir: str = "benchmarks/results", workdir: str = DEFAULT_WORKDIR, engine: bool = True,
        engine_args: dict | None = None, tag: str = "", busy_caller: bool = False,
        busy_neighbour_on: bool = False) -> dict:
    from tqdm import tqdm

    path = build_model(model, workdir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tdtype = getattr(torch, dtype)
    shapes = linear_shapes(path, tp_size)
    wbytes = weight_bytes(path, tdtype) // tp_size
    label = model_label(model)
    stem = f"limits_{label}_{dtype}_tp{tp_size}{tag}"
    result = {"benchmark": "limits", "machine": machine(),
              "config": {"model": label, "dtype": dtype, "batches": list(batches), "context": context,
                         "decode_steps": steps, "tp_size": tp_size, "overlap": overlap, "repeats": repeats,
                         "device": device.type, "engine_args": engine_args or {}, "busy_caller": busy_caller,
                         "busy_neighbour": busy_neighbour_on},
              "weight_bytes": wbytes}
    with tqdm(total=len(shapes) + 1 + (len(batches) if engine else 0), desc=f"limits {label}") as bar:
        # on a thread that ends: its OpenMP team must not outlive it (see rollout.engine.engine.run_on_own_thread)
        mem = run_on_own_thread(lambda: memory_bandwidth(max(wbytes, 64 << 20), repeats, device))
        result["memory"] = mem
        result["weight_read_s"] = wbytes / (mem["read_gb_s"] * 1e9)
        bar.update(1)
        result["gemm"] = run_on_own_thread(lambda: gemm_steps(shapes, batches, tdtype, repeats, device, bar))
        if busy_caller:  # the caller's thread runs parallel torch work too, as a colocated trainer's does
            a = torch.randn(1024, 1024)
            (a @ a).sum()
        if engine:
            prof_dir = os.path.join(out_dir, stem + "_profiles") if profile else None
            result["engine_kernels"] = {}
            result["engine"] = engine_decode_steps(path, dtype, batches, context, steps, tp_size, overlap, prof_dir,
                                                   bar, engine_args, result["engine_kernels"])
            if device.type == "cuda" and tp_size == 1:  # the step split by CUDA events (rollout.bench.step)
                result["step_events"] = step_events(path, dtype, batches, context, engine_args)
        if engine and busy_neighbour_on:  # the same decode steps again, beside a process computing on its own threads
            nb = [b for b in batches if b in NEIGHBOUR_BATCHES] or list(batches)
            neighbour = busy_neighbour(torch.get_num_threads())
            try:
                busy = engine_decode_steps(path, dtype, nb, context, steps, tp_size, overlap, None, None, engine_args)
            finally:
                neighbour.terminate()
                neighbour.wait(30)
            result["busy_neighbour"] = {
                "neighbour_threads": torch.get_num_threads(), "engine": busy,
                "throughput_over_alone": {b: result["engine"][b]["step_s"] / e["step_s"] for b, e in busy.items()}}
    if engine:
        result["ratios"] = {b: {"step_over_gemm_step": e["step_s"] / result["gemm"][b]["gemm_step_s"],
                                "step_over_weight_read": e["step_s"] / result["weight_read_s"]}
                            for b, e in result["engine"].items()}
    write_result(result, out_dir, stem, plot)
    return result


def summary_lines(result: dict) -> list[str]:
    lines = [f"{result['config']['model']} {result['config']['dtype']}: weights {result['weight_bytes'] / 1e6:.0f} MB, "
             f"read {result['memory']['read_gb_s']:.1f} GB/s -> weight read {1e3 * result['weight_read_s']:.1f} ms, "
             f"copy {result['memory']['copy_gb_s']:.1f} GB/s"]
    first = next(iter(result["gemm"].values()))["shapes"]
    lines.append("  GEMM kernels timed (every one the engine can dispatch to here): "
                 + ", ".join(next(iter(first.values()))["kernels_s"]))
    for b, g in result["gemm"].items():
        line = f"  batch {b:>4}: GEMM-only step {1e3 * g['gemm_step_s']:8.1f} ms"
        if "engine" in result:
            e, r = result["engine"][b], result["ratios"][b]
            line += (f" | engine step {1e3 * e['step_s']:8.1f} ms (forward {1e3 * e['forward_s']:.1f}, sample "
                     f"{1e3 * e['sample_s']:.1f}, other {1e3 * e['other_s']:.1f}) = {r['step_over_gemm_step']:.2f}x GEMM, "
                     f"{r['step_over_weight_read']:.2f}x weight read")
        lines.append(line)
    if "engine_kernels" in result:
        lines.append(f"  engine GEMMs: {result['engine_kernels'].get('gemm_plans_text')}; paged decode attention: "
                     f"{result['engine_kernels'].get('paged_attention')}")
    for b, r in result.get("busy_neighbour", {}).get("throughput_over_alone", {}).items():
        busy = result["busy_neighbour"]["engine"][b]
        threads = f" (forwards ended on {busy['cpu_threads']} thread(s), dropped to one {busy['cpu_thread_drops']}x)" \
            if "cpu_threads" in busy else ""
        lines.append(f"  batch {b:>4} beside a busy neighbour: {r:.2f}x the throughput alone{threads}")
    return lines


def plot(result: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    batches = list(result["gemm"])
    x = range(len(batches))
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    gemm = [1e3 * result["gemm"][b]["gemm_step_s"] for b in batches]
    ax.bar([i - 0.2 for i in x], gemm, width=0.4, label="GEMM-only step", color="tab:gray")
    if "engine" in result:
        bottom = [0.0] * len(batches)
        for part, color in (("forward_s", "tab:blue"), ("sample_s", "tab:orange"), ("other_s", "tab:green")):
            vals = [1e3 * result["engine"][b][part] for b in batches]
            ax.bar([i + 0.2 for i in x], vals, width=0.4, bottom=bottom, color=color,
                   label=f"engine step: {part[:-2]}")
            bottom = [a + v for a, v in zip(bottom, vals)]
        for i, b in enumerate(batches):
            r = result["ratios"][b]
            ax.annotate(f"{r['step_over_gemm_step']:.2f}x GEMM\n{r['step_over_weight_read']:.2f}x read",
                        (i + 0.2, bottom[i]), ha="center", va="bottom", fontsize=7)
        ax.set_ylim(top=3 * max(bottom))
    ax.axhline(1e3 * result["weight_read_s"], ls="--", lw=0.8, color="black", label="weight read")
    ax.set_yscale("log")
    ax.set_xticks(list(x), [f"batch {b}" for b in batches])
    ax.set_ylabel("ms per decode step")
    cfg = result["config"]
    ax.set_title(f"{cfg['model']} {cfg['dtype']} TP={cfg['tp_size']}, context {cfg['context']}: decode step vs limits",
                 fontsize=9)
    save_figure(fig, path, ax)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="rollout bench limits", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap)
    ap.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)), help="decode batch sizes")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens of each sample")
    ap.add_argument("--steps", type=int, default=16, help="decode steps measured per batch size")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--overlap", choices=["on", "off"], default="off")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="also write the profiler's top operators per batch size")
    ap.add_argument("--no-engine", action="store_true", help="the machine's ceilings only")
    add_engine_arg_flag(ap)
    ap.add_argument("--tag", default="", help="appended to the result's file name (e.g. _no-kernel)")
    ap.add_argument("--busy-caller", action="store_true",
                    help="run parallel torch work on the calling thread first (it then holds an OpenMP team of its "
                         "own, as a colocated trainer's thread does) to measure what that costs the engine")
    ap.add_argument("--busy-neighbour", action="store_true",
                    help="time the decode steps at batch 8 and 64 again while a second process does matmuls on as "
                         "many threads of its own on the same cores (a trainer or client beside the engine); reports "
                         "the throughput beside it over the throughput alone (a fair share on shared cores: 0.5)")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--workdir", default=DEFAULT_WORKDIR)
    args = ap.parse_args(argv)
    result = run(args.model, args.dtype, [int(b) for b in args.batches.split(",")], args.context, args.steps,
                 args.tp_size, args.overlap == "on", args.repeats, args.profile, args.out_dir, args.workdir,
                 engine=not args.no_engine, engine_args=parse_engine_args(args.engine_arg), tag=args.tag,
                 busy_caller=args.busy_caller, busy_neighbour_on=args.busy_neighbour)
    print("\n".join(summary_lines(result)))
    return result


if __name__ == "__main__":
    main()
