"""The throughput cost of RL-fidelity features, each against the default in one run:

- the batch-invariant mode (``deterministic=True``: every kernel computes a row in an order that does not
  depend on the batch, so a token's logprobs are the same bits in any batch, chunk, cache state or
  overlap), on a named throughput workload (``grpo-short`` by default: 64 chat prompts x n=8, up to 256
  new tokens, temperature 1, EOS on), the two engines run one after the other and then again in the
  other order, each side's best of two kept (drift hits both alike);
- sampling masks (top-k 50, top-p 0.9 sampling with and without ``return_sampling_mask``) on a smaller
  batch (``--prompts`` x ``--n``, ``--max-new-tokens``).

Writes ``fidelity_<model>_<dtype>.json`` and a plot to ``--out-dir``, with the machine it ran on.

    rollout bench fidelity --model smollm2
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from rollout import RolloutEngine, SamplingParams
from rollout.bench.common import (
    add_model_flags,
    add_output_flags,
    build_model,
    machine,
    model_label,
    random_prompts,
    save_figure,
    write_result,
)
from rollout.bench.throughput import WORKLOADS, Features, make_prompts, run_engine


def mode_cost(path: str, dtype: str, workload: str, num_prompts: int | None, max_new_tokens: int | None,
              rounds: int = 2) -> dict:
    """The workload through a default engine and a ``deterministic=True`` one, alternating (default first,
    then the other order), each side's best round kept; the ratio of their useful tokens per second."""
    from transformers import AutoTokenizer

    w = WORKLOADS[workload]
    w = replace(w, **{k: v for k, v in (("num_prompts", num_prompts), ("max_new_tokens", max_new_tokens)) if v})
    prompts = make_prompts(AutoTokenizer.from_pretrained(path), w.num_prompts)
    runs: dict[str, list[dict]] = {"default": [], "deterministic": []}
    for r in range(rounds):
        order = ("default", "deterministic") if r % 2 == 0 else ("deterministic", "default")
        for name in order:
            got = run_engine(path, dtype, prompts, w, Features(), 256, {"deterministic": name == "deterministic"})
            runs[name].append(got)
            print(f"round {r} {name}: {got['tokens_per_s']:.1f} tokens/s ({got['tokens']} tokens, {got['seconds']:.1f} s)",
                  flush=True)
    best = {name: max(rs, key=lambda g: g["tokens_per_s"]) for name, rs in runs.items()}
    return {"workload": {"name": w.name, "num_prompts": w.num_prompts, "n": w.n, "max_new_tokens": w.max_new_tokens},
            "default": best["default"], "deterministic": best["deterministic"],
            "rounds": {name: [g["tokens_per_s"] for g in rs] for name, rs in runs.items()},
            "throughput_fraction": best["deterministic"]["tokens_per_s"] / best["default"]["tokens_per_s"]}


def mask_cost(path: str, dtype: str, prompts: int, n: int, max_new_tokens: int) -> dict:
    """top-k 50 / top-p 0.9 sampling with and without ``return_sampling_mask``, interleaved, best of two."""
    ids = random_prompts(path, prompts, 16, 48)
    sp = SamplingParams(n=n, max_new_tokens=max_new_tokens, temperature=1.0, top_p=0.9, top_k=50, seed=5,
                        ignore_eos=True)
    res: dict = {}
    with RolloutEngine(path, dtype=dtype, kv_cache_tokens=8192) as e:
        e.generate(input_ids=ids[:2], sampling_params=SamplingParams(max_new_tokens=2))  # warm-up
        for masks in (False, True, False, True):
            t0 = time.perf_counter()
            got = e.generate(input_ids=ids, sampling_params=sp, return_sampling_mask=masks)
            tps = sum(len(o.output_token_ids) for o in got) / (time.perf_counter() - t0)
            name = "masks_on" if masks else "masks_off"
            res[name] = max(res.get(name, 0.0), tps)
        sizes = [len(m) for o in got for m in o.output_token_sampling_mask]
    res["masks_mean_size"] = sum(sizes) / max(1, len(sizes))
    res["masks_throughput_fraction"] = res["masks_on"] / res["masks_off"]
    return res


def plot(result: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = ["default", "deterministic"]
    vals = [result[k]["tokens_per_s"] for k in names]
    bars = ax.bar(["default", "batch-invariant"], vals, color=["tab:blue", "tab:green"])
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    w = result["workload"]
    ax.set_ylabel("useful tokens / s")
    ax.set_title(f"{w['name']} on {result['model']} {result['dtype']}: batch-invariant "
                 f"{result['throughput_fraction']:.2f}x the default\n{result['machine']['cpu']}", fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="rollout bench fidelity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap)
    ap.add_argument("--workload", default="grpo-short", choices=[k for k, v in WORKLOADS.items()
                                                                 if not v.score and not v.turns and v.lengths == (0, 0)])
    ap.add_argument("--num-prompts", type=int, default=None, help="override the workload's number of prompts")
    ap.add_argument("--mode-max-new-tokens", type=int, default=None, help="override the workload's max_new_tokens")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the two engines, alternating their order")
    ap.add_argument("--prompts", type=int, default=16, help="the mask measurement's prompts")
    ap.add_argument("--n", type=int, default=2, help="the mask measurement's samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="the mask measurement's new tokens")
    add_output_flags(ap)
    args = ap.parse_args(argv)
    path = build_model(args.model, args.workdir)
    res = {"benchmark": "fidelity", "machine": machine(), "model": model_label(args.model), "dtype": args.dtype}
    res.update(mode_cost(path, args.dtype, args.workload, args.num_prompts, args.mode_max_new_tokens, args.rounds))
    res["masks"] = mask_cost(path, args.dtype, args.prompts, args.n, args.max_new_tokens)
    print(json.dumps({k: res[k] for k in ("throughput_fraction", "rounds", "masks")}, indent=1))
    write_result(res, args.out_dir, f"fidelity_{model_label(args.model)}_{args.dtype}", plot)
    return res


if __name__ == "__main__":
    main()
