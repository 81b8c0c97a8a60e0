"""``rollout bench speculation``: exact speculation against plain decoding on one engine in one run (the
engine speculates; ``SamplingParams.speculative=False`` turns it off per request), on the workloads of
the speculation issue.

- **Two epochs of the same prompts** (``grpo-short`` by default: 64 chat prompts x n=8, up to 256 new
  tokens, temperature 1, EOS allowed): epoch 1 fills the drafter with its rollouts; one real training
  step follows (``rollout bench acceptance``'s: Adam, a policy gradient on a group-normalised reward, fp32
  ``transformers``), pushed with ``update_weights_from_tensor``; epoch 2 draws with seeds disjoint from
  epoch 1's, once with speculation on and then — the prefix cache flushed — once with it off (on first,
  so that no rollout drawn with epoch 2's seeds is in the drafter when they are guessed). Per run:
  rollout seconds, its long tail (``rollout bench rl-step``'s: from under a quarter of the peak batch
  left to the end), samples/s, verify steps and tokens per verify step; and the share of samples whose
  tokens are the same in both runs (all of them in fp32; in bf16 a verify's rows round differently).
- **Batch 1, a repeated prompt**: one prompt decoded once (what the drafter then holds), then decoded
  again on and off — with a new seed at temperature 1, and greedy (its tokens replayed: the ceiling).

Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from rollout.bench.common import add_model_flags, add_output_flags, build_model, machine, model_label, write_result
from rollout.bench.throughput import SPEC_DRAFT_TOKENS, WORKLOADS, spec_stats


def _rollout(engine, prompts, sp) -> tuple[dict, list]:
    from rollout.bench.rl_step import _InFlight

    before = engine.get_stats()
    t0 = time.perf_counter()
    with _InFlight(engine, every_s=0.05) as watch:
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
    rollout_s = time.perf_counter() - t0
    tokens = sum(len(o.output_token_ids) for o in outs)
    stats = spec_stats(before, engine.get_stats())
    return {"rollout_s": rollout_s, "tail_s": watch.tail_s(), "peak_running": watch.peak, "samples": len(outs),
            "tokens": tokens, "samples_per_s": len(outs) / rollout_s, "tokens_per_s": tokens / rollout_s,
            **stats}, outs


def _ratio(off: float, on: float):
    return off / on if on > 0 else None


def _epochs(engine, path: str, prompts: list, sp, n: int, lr: float) -> dict:
    from rollout.bench.acceptance import Seq, _train_step
    from rollout.engine.engine import run_on_own_thread

    res = {}
    res["epoch1"], outs = _rollout(engine, prompts, sp)
    seqs = [Seq(o.prompt_index, prompts[o.prompt_index], list(o.output_token_ids)) for o in outs]
    new = run_on_own_thread(lambda: _train_step(path, seqs, n, lr))
    done = engine.update_weights_from_tensor([(name, t.to(engine.dtype)) for name, t in new], weight_version="step-1")
    if not done.success:
        raise RuntimeError(f"weight update failed: {done.message}")
    second = replace(sp, seed=1_000_003)  # seeds disjoint from epoch 1's (sample i draws with seed + i)
    res["epoch2_on"], on = _rollout(engine, prompts, second)
    engine.flush_cache()
    res["epoch2_off"], off = _rollout(engine, prompts, replace(second, speculative=False))
    res["epoch2_same_tokens"] = sum(a.output_token_ids == b.output_token_ids for a, b in zip(on, off)) / len(on)
    res["tail_speedup"] = _ratio(res["epoch2_off"]["tail_s"], res["epoch2_on"]["tail_s"])
    res["rollout_speedup"] = _ratio(res["epoch2_off"]["rollout_s"], res["epoch2_on"]["rollout_s"])
    return res


def _batch1(engine, prompt: list[int], max_new: int) -> dict:
    from rollout import SamplingParams

    out = {}
    for name, params in (("t1_new_seed", dict(temperature=1.0, top_k=-1, top_p=1.0)), ("greedy", dict(temperature=0.0))):
        sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True, seed=5, **params)
        engine.generate(input_ids=[prompt], sampling_params=sp)  # the drafter holds this
        again = replace(sp, seed=7)
        runs = {}
        for mode, p in (("on", again), ("off", replace(again, speculative=False))):
            engine.flush_cache()
            before = engine.get_stats()
            t0 = time.perf_counter()
            o = engine.generate(input_ids=[prompt], sampling_params=p)[0]
            s = time.perf_counter() - t0
            runs[mode] = {"seconds": s, "tokens": len(o.output_token_ids), "tokens_per_s": len(o.output_token_ids) / s,
                          "output": o.output_token_ids, **spec_stats(before, engine.get_stats())}
        out[name] = {"on": {k: v for k, v in runs["on"].items() if k != "output"},
                     "off": {k: v for k, v in runs["off"].items() if k != "output"},
                     "same_tokens": runs["on"]["output"] == runs["off"]["output"],
                     "speedup": _ratio(runs["off"]["seconds"], runs["on"]["seconds"])}
    return out


def run(args) -> dict:
    from transformers import AutoTokenizer

    from rollout import RolloutEngine, SamplingParams
    from rollout.bench.throughput import make_prompts

    w = WORKLOADS[args.workload]
    w = replace(w, **{k: v for k, v in (("num_prompts", args.num_prompts), ("n", args.n),
                                         ("max_new_tokens", args.max_new_tokens)) if v is not None})
    path = build_model(args.model, args.workdir)
    prompts = make_prompts(AutoTokenizer.from_pretrained(path), w.num_prompts)
    kv = min(len(prompts) * w.n, 256) * (max(map(len, prompts)) + max(w.max_new_tokens, args.batch1_tokens) + 32)
    sp = SamplingParams(max_new_tokens=w.max_new_tokens, temperature=args.temperature, top_k=-1, top_p=1.0, n=w.n,
                        seed=0, ignore_eos=w.ignore_eos)
    with RolloutEngine(path, dtype=args.dtype, kv_cache_tokens=kv, use_generation_config=False,
                       speculative_num_draft_tokens=args.k, speculative_max_batch=args.max_batch) as engine:
        engine.generate(input_ids=prompts[:1], sampling_params=SamplingParams(max_new_tokens=2))  # warm-up
        result = {"benchmark": "speculation", "machine": machine(),
                  "config": {"model": model_label(args.model), "dtype": args.dtype, "workload": w.name,
                             "num_prompts": w.num_prompts, "n": w.n, "max_new_tokens": w.max_new_tokens,
                             "temperature": args.temperature, "k": args.k, "max_batch": args.max_batch,
                             "lr": args.lr, "batch1_tokens": args.batch1_tokens},
                  "epochs": _epochs(engine, path, prompts, sp, w.n, args.lr),
                  "batch1": _batch1(engine, prompts[0], args.batch1_tokens)}
    e, b = result["epochs"], result["batch1"]
    x = lambda v: "n/a" if v is None else f"{v:.2f}x"  # noqa: E731 - a tail too short to poll has no ratio
    print(f"epoch 2: tail {x(e['tail_speedup'])}, rollout {x(e['rollout_speedup'])}, "
          f"{e['epoch2_on'].get('tokens_per_verify', 0):.2f} tokens/verify; batch 1 T=1 new seed "
          f"{x(b['t1_new_seed']['speedup'])}, greedy {x(b['greedy']['speedup'])}")
    tag = "" if args.max_batch == 64 else f"_max-batch{args.max_batch}"
    write_result(result, args.out_dir, f"speculation_{w.name}_{model_label(args.model)}_{args.dtype}_k{args.k}{tag}", plot)
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    from rollout.bench.common import save_figure

    e, b, cfg = result["epochs"], result["batch1"], result["config"]
    fig, (a, c) = plt.subplots(1, 2, figsize=(10, 3.4))
    runs = ["epoch1", "epoch2_on", "epoch2_off"]
    head = [e[r]["rollout_s"] - e[r]["tail_s"] for r in runs]
    a.bar(runs, head, label="rollout before the tail")
    a.bar(runs, [e[r]["tail_s"] for r in runs], bottom=head, label="long tail")
    a.set_ylabel("seconds")
    a.set_title(f"{cfg['model']} {cfg['dtype']} {cfg['workload']} ({cfg['num_prompts']}x{cfg['n']}, "
                f"T={cfg['temperature']:g}), k={cfg['k']}: tail {e['tail_speedup'] or 0:.2f}x, "
                f"rollout {e['rollout_speedup'] or 0:.2f}x", fontsize=8)
    names = list(b)
    x = range(len(names))
    c.bar([i - 0.2 for i in x], [b[n]["off"]["tokens_per_s"] for n in names], width=0.4, label="off")
    c.bar([i + 0.2 for i in x], [b[n]["on"]["tokens_per_s"] for n in names], width=0.4, label="on")
    c.set_xticks(list(x), names)
    c.set_ylabel("tokens/s, batch 1")
    save_figure(fig, path, legend_ax=a)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="rollout bench speculation", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap)
    ap.add_argument("--workload", default="grpo-short", choices=["grpo-short", "grpo-long"])
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--n", type=int, default=None, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=1.0, help="the workload's (grpo-short: 1.0)")
    ap.add_argument("--k", type=int, default=SPEC_DRAFT_TOKENS, help="speculative_num_draft_tokens")
    ap.add_argument("--max-batch", type=int, default=64, help="speculative_max_batch (the engine's default: 64)")
    ap.add_argument("--lr", type=float, default=1e-5, help="the training step's Adam learning rate")
    ap.add_argument("--batch1-tokens", type=int, default=256, help="tokens decoded in the batch-1 runs")
    add_output_flags(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
