"""How close a trainer's weight push is to its floor: the whole push (ZeRO-3 gather, pack, send,
commit, verify) against a bare ZeRO-3 all-gather of the same parameters on the same group, in one
run, colocated (each trainer rank's own engine, tensors) and disaggregated (a rollout server in its
own process, one weight-update group).

    rollout bench push-floor --model smollm2          # two trainer ranks (--trainer-ranks), started for you

The rounds interleave (bare gather, then each push) so the machine's drift touches all alike; the
ratio is the median over rounds of push / bare gather of the same round, against the bare gather of
the push's own buckets (``*_ratio``) and of every parameter at once (``*_ratio_to_all_at_once``).
Writes JSON (every round's phases) and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from trainer_bridge.bench import relaunch_under_torchrun

T = TypeVar("T")


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="rollout bench push-floor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer-ranks", type=int, default=2, help="trainer ranks (ZeRO-3 partitions over them)")
    ap.add_argument("--model", default="smollm2", help="'tiny', 'smollm2' or a Hugging Face folder")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--zero-stage", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--modes", default="colocated,disaggregated")
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args(argv)
    args.out = os.path.join(os.path.abspath(args.out_dir),
                            f"push_floor_{os.path.basename(args.model)}_{args.bucket_mb}mb.json")
    return args


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """(seconds between barriers on every rank, what ``fn`` returned)."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, out


def _targets(args, path: str, rank: int) -> tuple[dict, list]:
    """{mode: (target, what verify_pushed reads back from)} for each of ``args.modes``, and what to
    close afterwards (in order)."""
    import torch.distributed as dist

    modes = args.modes.split(",")
    targets: dict = {}
    cleanup: list = []
    if "colocated" in modes:
        from rollout import RolloutEngine
        from trainer_bridge.targets import ColocatedTarget

        engine = RolloutEngine(path, dtype=args.dtype, tp_size=1, kv_cache_tokens=2048, seed=0,
                               use_generation_config=False)
        targets["colocated"] = (ColocatedTarget(engine), engine)
        cleanup.append(engine.shutdown)
    if "disaggregated" in modes:
        from rollout.server import RolloutClient, launch_server
        from trainer_bridge.distributed_target import DistributedTarget
        from trainer_bridge.router import ReplicaRouter
        from weight_sync.process_group import free_port

        box = [free_port() if rank == 0 else 0]
        dist.broadcast_object_list(box)
        if rank == 0:  # one server, one thread: the trainer ranks share the cores
            server = launch_server(path, "--dtype", args.dtype, "--kv-cache-tokens", "2048",
                                   "--no-use-generation-config", port=box[0], num_threads=1, ready_timeout_s=None)
            cleanup.append(server.stop)
        client = RolloutClient(f"http://127.0.0.1:{box[0]}")
        cleanup.append(client.close)
        client.wait_ready(300)
        target = DistributedTarget([client], timeout_s=120)
        cleanup.insert(0, target.close)
        targets["disaggregated"] = (target, ReplicaRouter([client]))
    return targets, cleanup


def _summary(results: dict) -> dict:
    med = statistics.median
    return {"bare_bucketed_s": med(results["bare"]["bucketed"]), "bare_all_at_once_s": med(results["bare"]["all_at_once"]),
            **{f"{m}_push_s": med(r["total_s"] for r in runs) for m, runs in results["push"].items()},
            **{f"{m}_ratio": med(r["ratio_to_bare_bucketed"] for r in runs) for m, runs in results["push"].items()},
            **{f"{m}_ratio_to_all_at_once": med(r["ratio_to_bare_all_at_once"] for r in runs)
               for m, runs in results["push"].items()}}


def main(argv=None) -> dict:
    args = parse(argv)
    if "LOCAL_RANK" not in os.environ:  # not a rank yet: start the ranks, each running this
        own = sys.argv[1:] if argv is None else list(argv)
        relaunch_under_torchrun("trainer_bridge.bench.push_floor", args.trainer_ranks, own)
    from trainer_bridge.grpo_setup import build_trainer

    ns = argparse.Namespace(model=args.model, seed=0, dtype=args.dtype, lr=1e-5, zero_stage=args.zero_stage, lora=0,
                            lora_alpha=None)
    ds_engine, path, tied, rank, world = build_trainer(ns)
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from rollout.bench.common import machine
    from trainer_bridge.grpo import verify_pushed
    from trainer_bridge.push import full_numel, gathered, param_buckets, push_weights

    bucket_bytes = args.bucket_mb << 20
    module = ds_engine.module
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    params = list(module.parameters())

    buckets = [[p for _, p in bucket] for bucket in param_buckets(module, dtype, bucket_bytes)]

    def bare_bucketed():  # the push's own buckets gathered (and freed), nothing else done
        for bucket in buckets:
            with gathered(bucket):
                pass

    def bare_all():  # every parameter gathered at once (and freed)
        with gathered(params):
            pass

    results: dict = {"machine": machine(),
                     "config": {**vars(args), "out": os.path.basename(args.out), "world_size": world, "num_params": sum(
                         full_numel(p) for p in params)},
                     "bare": {"bucketed": [], "all_at_once": []}, "push": {}}
    targets, cleanup = _targets(args, path, rank)

    def push_once(mode: str, k: int) -> dict:
        target, reader = targets[mode]

        def once():
            stats = push_weights(ds_engine, target, version=f"{mode}-{k}", bucket_bytes=bucket_bytes,
                                 tie_word_embeddings=tied)
            t = time.perf_counter()
            ok = verify_pushed(stats, reader)
            return stats, time.perf_counter() - t, ok

        total, (stats, verify_s, ok) = timed(once)
        if not stats.result.success or not ok:
            raise RuntimeError(f"{mode}: push failed or did not verify: {stats.result.message}")
        return {"total_s": total, "verify_s": verify_s, **stats.phases, "num_buckets": stats.num_buckets}

    # interleaved, so that this machine's drift (two trainer ranks and the engines share its cores)
    # touches every measurement alike; the first round warms groups and buffers and is not kept
    for k in tqdm(range(args.repeats + 1), desc="push vs bare gather", disable=rank != 0):
        bare = {"bucketed": timed(bare_bucketed)[0], "all_at_once": timed(bare_all)[0]}
        pushes = {mode: push_once(mode, k) for mode in targets}
        if k:
            for name, v in bare.items():
                results["bare"][name].append(v)
            for mode, r in pushes.items():
                r["ratio_to_bare_bucketed"] = r["total_s"] / bare["bucketed"]
                r["ratio_to_bare_all_at_once"] = r["total_s"] / bare["all_at_once"]
                results["push"].setdefault(mode, []).append(r)
    for fn in cleanup:
        fn()
    if rank == 0:
        results["summary"] = _summary(results)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        plot(results, args.out.rsplit(".", 1)[0] + ".png")
        print(json.dumps(results["summary"], indent=1), flush=True)
    dist.barrier()
    return results


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = ["gather_s", "pack_s", "transfer_s", "commit_s", "verify_s"]
    rows = [("bare gather", {"gather_s": statistics.median(results["bare"]["bucketed"])})]
    for mode, runs in results["push"].items():
        med = {p: statistics.median(r.get(p, 0.0) for r in runs) for p in phases}
        med["other_s"] = max(0.0, statistics.median(r["total_s"] for r in runs) - sum(med.values()))
        rows.append((mode, med))
    fig, ax = plt.subplots(figsize=(6, 2.8))
    for i, (_label, med) in enumerate(rows):
        left = 0.0
        for p in phases + ["other_s"]:
            v = med.get(p, 0.0)
            ax.barh(i, v, left=left, color=f"C{(phases + ['other_s']).index(p)}", label=p if i == 1 else None)
            left += v
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_xlabel("seconds (median)")
    ax.set_title("weight push vs bare ZeRO-3 all-gather")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
