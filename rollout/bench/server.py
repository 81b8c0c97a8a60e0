"""Server load benchmark: the same workload through the in-process engine and through
``rollout serve`` on loopback, then the server again while weights are refreshed from disk every
few seconds, and the server behind the field's router (``--router``: sglang-router or SMG, one replica,
so the router's own cost shows). Reports requests/s, tokens/s and p50/p99 latency; the server's cost
is its tokens/s against the in-process engine's, the router's its tokens/s against the server's
direct. Writes JSON and a PNG to ``--out-dir``.

    rollout bench server-load --model smollm2 --requests 200 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from rollout import RolloutEngine
from rollout.bench.common import (
    add_model_flags,
    add_output_flags,
    build_model,
    machine,
    random_prompts,
    write_result,
)
from rollout.server import launch_server
from rollout.server.router import launch_router, router_available
from rollout.tools.server_load import run_in_process_load, run_server_load


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--refresh-every-s", type=float, default=3.0)
    ap.add_argument("--router", choices=["auto", "none", "sglang-router", "smg"], default="auto",
                    help="run the load through this router too (auto: sglang-router if installed)")
    add_output_flags(ap)
    args = ap.parse_args(argv)
    path = build_model(args.model, args.workdir)
    prompts = random_prompts(path, args.requests, 16, 64)
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                "ignore_eos": True, "seed": 1}
    engine_kw = dict(dtype=args.dtype, kv_cache_tokens=args.requests * (64 + args.max_new_tokens + 16))
    res = {"model": args.model, "dtype": args.dtype, "requests": args.requests, "max_new_tokens": args.max_new_tokens,
           "threads": torch.get_num_threads(), "machine": machine()}

    with RolloutEngine(path, **engine_kw) as engine:
        run_in_process_load(engine, prompts[:8], sampling)  # warm-up
        res["in_process"] = run_in_process_load(engine, prompts, sampling)["summary"]
    print("in-process:", json.dumps(res["in_process"]), flush=True)

    server = launch_server(path, "--dtype", args.dtype, "--kv-cache-tokens", str(engine_kw["kv_cache_tokens"]),
                           "--allowed-weight-dirs", os.path.dirname(os.path.abspath(path)), ready_timeout_s=600)
    url = server.url
    with server, server.client() as client:
        run_server_load(url, prompts[:8], sampling)  # warm-up
        res["server"] = run_server_load(url, prompts, sampling)["summary"]
        print("server:", json.dumps(res["server"]), flush=True)
        k = [0]

        def refresh(_):
            k[0] += 1
            return client.update_weights_from_disk(path, weight_version=f"refresh-{k[0]}")

        run = run_server_load(url, prompts, sampling, refresh=refresh, refresh_every_s=args.refresh_every_s,
                              spread_s=2 * args.refresh_every_s)
        res["server_with_refreshes"] = {**run["summary"], "refreshes": len(run["refreshes"]),
                                        "refresh_seconds": [r.seconds for r in run["refreshes"]],
                                        "errors": run["errors"][:5]}
        print("server + refreshes:", json.dumps(res["server_with_refreshes"]), flush=True)
        kind = args.router if args.router != "auto" else ("sglang-router" if router_available("sglang-router")
                                                          else "none")
        if kind != "none":
            with launch_router([url], kind) as router:
                run_server_load(router.url, prompts[:8], sampling)  # warm-up
                res["router"] = {**run_server_load(router.url, prompts, sampling)["summary"], "kind": kind}
            res["router_fraction_of_server_tokens_per_s"] = (res["router"]["tokens_per_s"]
                                                             / res["server"]["tokens_per_s"])
            print(f"through {kind}:", json.dumps(res["router"]), flush=True)
    res["server_fraction_of_in_process_tokens_per_s"] = res["server"]["tokens_per_s"] / res["in_process"]["tokens_per_s"]
    write_result(res, args.out_dir, f"server_load_{args.model.replace('/', '_')}_{args.dtype}", _plot)
    print(json.dumps({k: v for k, v in res.items() if not isinstance(v, dict)}, indent=1))
    return res


def _plot(res: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    runs = [("in-process", res["in_process"]), ("server", res["server"]),
            ("server +\nrefreshes", res["server_with_refreshes"])]
    if "router" in res:
        runs.append((f"through\n{res['router']['kind']}", res["router"]))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    colors = ["#888", "#3a7", "#37a", "#a73"][:len(runs)]
    axes[0].bar([n for n, _ in runs], [r["tokens_per_s"] for _, r in runs], color=colors)
    axes[0].set_ylabel("tokens/s")
    axes[0].set_title(f"{res['model']} {res['dtype']}, {res['requests']} concurrent requests")
    x = range(len(runs))
    axes[1].bar([i - 0.2 for i in x], [r["p50_s"] for _, r in runs], width=0.4, label="p50")
    axes[1].bar([i + 0.2 for i in x], [r["p99_s"] for _, r in runs], width=0.4, label="p99")
    axes[1].set_xticks(list(x), [n for n, _ in runs])
    axes[1].set_ylabel("latency (s)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.0f}s")
