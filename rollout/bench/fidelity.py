"""The throughput cost of RL-fidelity features, each against the default in one run: sampling
masks (top-k 50, top-p 0.9 sampling with and without ``return_sampling_mask``) and the
batch-invariant mode (``deterministic=True``). Writes JSON to ``--out-dir``.

    rollout bench fidelity --model smollm2 --prompts 16 --n 2 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import time

from rollout import RolloutEngine, SamplingParams
from rollout.bench.common import add_model_flags, add_output_flags, build_model, random_prompts


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    add_output_flags(ap)
    args = ap.parse_args(argv)
    path = build_model(args.model, args.workdir)
    prompts = random_prompts(path, args.prompts, 16, 48)
    sp = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=-1,
                        seed=5, ignore_eos=True)
    res = {"model": args.model, "dtype": args.dtype, "prompts": args.prompts, "n": args.n,
           "max_new_tokens": args.max_new_tokens, "prompt_tokens": sum(map(len, prompts))}
    truncated = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=0.9, top_k=50,
                               seed=5, ignore_eos=True)
    with RolloutEngine(path, dtype=args.dtype, kv_cache_tokens=8192) as e:
        e.generate(input_ids=prompts[:2], sampling_params=SamplingParams(max_new_tokens=2))  # warm-up
        for masks in (False, True, False, True):  # interleaved: drift hits both alike
            t0 = time.perf_counter()
            got = e.generate(input_ids=prompts, sampling_params=truncated, return_sampling_mask=masks)
            wall = time.perf_counter() - t0
            name = "masks_on" if masks else "masks_off"
            tps = sum(len(o.output_token_ids) for o in got) / wall
            res[name] = max(res.get(name, 0.0), tps)
        res["masks_mean_size"] = sum(len(m) for o in got for m in o.output_token_sampling_mask) / max(
            1, sum(len(o.output_token_sampling_mask) for o in got))
    res["masks_throughput_fraction"] = res["masks_on"] / res["masks_off"]
    print("masks:", res["masks_off"], res["masks_on"], res["masks_mean_size"], flush=True)
    outs = {}
    for det in (False, True):
        with RolloutEngine(path, dtype=args.dtype, kv_cache_tokens=8192, deterministic=det) as e:
            e.generate(input_ids=prompts[:2], sampling_params=SamplingParams(max_new_tokens=2))  # warm-up
            t0 = time.perf_counter()
            outs[det] = e.generate(input_ids=prompts, sampling_params=sp)
            wall = time.perf_counter() - t0
        tokens = sum(len(o.output_token_ids) for o in outs[det])
        res["deterministic" if det else "default"] = {"wall_s": wall, "tokens_per_s": tokens / wall}
        print(("deterministic" if det else "default"), json.dumps(res["deterministic" if det else "default"]),
              flush=True)
    res["throughput_fraction"] = res["deterministic"]["tokens_per_s"] / res["default"]["tokens_per_s"]
    res["same_tokens"] = [o.output_token_ids for o in outs[False]] == [o.output_token_ids for o in outs[True]]
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"fidelity_{args.model}_{args.dtype}.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
