"""``rollout bench weight-sync``: every update path against its raw transport, in the same run.

- tensor (in-process): ``update_weights_from_tensor`` vs a bare ``copy_`` of the same bytes into
  a destination of the same dtype; also the fixed overhead of an update (a one-tensor update);
- shared memory (from a second process): sender write + engine load vs a bare copy out of the
  same shared segment;
- distributed (a separate sender process over gloo, several bucket sizes): the update vs a bare
  broadcast of the same bytes on the same group, once with the sender holding separate tensors
  (packed per bucket) and once holding them in one ``FlattenedTensorBucket`` (sent with no copy);
  and SGLang's layouts as its clients send them (slime, AReaL): one broadcast per tensor vs the
  same bare per-tensor broadcasts, and ``flattened_bucket`` vs one bare broadcast of its bytes;
- disk: ``update_weights_from_disk`` vs a plain read of the same files with a warm page cache;
- LoRA (``--lora-rank``, 0: off): an adapter of that rank on every linear, pushed in process against a
  full push and a bare copy, and over a weight-update group against bare broadcasts of its bytes
  (``rollout.bench.lora.adapter_pushes``; ``rollout bench lora`` adds push-to-first-token and decode).

``--delta``: delta pushes against full pushes of the same steps after real Adam steps (``rollout.bench.delta``).

Writes JSON and a PNG to ``--out-dir``. Models: SmolLM2-135M-sized and Qwen2-0.5B-sized (bf16).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

import torch
from safetensors.torch import load_file

from rollout import RolloutEngine
from rollout.bench.common import DEFAULT_WORKDIR, best, build_model, machine, write_result
from rollout.tools.hf import hf_parameter_order
from weight_sync import FlattenedTensorBucket, SharedMemoryBucket
from weight_sync.distributed import WeightUpdateSender
from weight_sync.layout import layout
from weight_sync.process_group import free_port

SENDER_LAYOUTS = ("tensors", "flat")  # separate tensors (packed per bucket) / one FlattenedTensorBucket


def _sender(port, world, tensors, bucket_sizes, repeats):
    sender = WeightUpdateSender("127.0.0.1", port, world, "bench", timeout_s=120)
    from weight_sync.distributed import broadcast

    packed = FlattenedTensorBucket(tensors)  # the model kept in one buffer: sent with no copy
    flat = packed.named_tensors()
    for bucket in bucket_sizes:
        for source in (tensors, flat):
            for _ in range(repeats + 2):
                # The raw transport: one broadcast of the model's own bytes (a never-written buffer
                # would be read from the kernel's zero page, faster than any real data).
                broadcast(sender.group, packed.buffer)
                sender.send(source, bucket_bytes=bucket)
    flat_bytes = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in tensors])
    for load_format in SGLANG_LAYOUTS:
        for _ in range(repeats + 2):
            if load_format == "direct":  # bare: every tensor's own broadcast, posted at once
                for work in [sender.group.pg.broadcast([t], _root0()) for _, t in tensors]:
                    sender.group.wait(work)
            else:
                broadcast(sender.group, flat_bytes)
            sender.send(tensors, load_format=load_format)


SGLANG_LAYOUTS = ("direct", "flattened_bucket")


def _root0():
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


def _shm_sender(handle_q, go_q, tensors, repeats):
    bucket = SharedMemoryBucket()
    for _ in range(repeats):
        go_q.get()
        t0 = time.perf_counter()
        handle = bucket.write(tensors)
        handle_q.put((handle, time.perf_counter() - t0))
    go_q.get()
    bucket.close()


def _bench_tensor(engine, tensors, dtype: torch.dtype, repeats: int) -> dict:
    """In-process tensors against a raw copy into memory laid out like the engine's own
    (consecutive views of one flat buffer, pages already touched): the physical floor."""
    flat = torch.zeros(sum(t.numel() for _, t in tensors), dtype=dtype)
    dests, offset = [], 0
    for _, t in tensors:
        dests.append(flat[offset: offset + t.numel()].view(t.shape))
        offset += t.numel()
    raw_fn = lambda: [d.copy_(t) for d, (_, t) in zip(dests, tensors)]  # noqa: E731
    upd_fn = lambda: engine.update_weights_from_tensor(tensors, check_finite=False)  # noqa: E731
    # Both run once first: the loop thread's OpenMP team then exists, as it does in any serving
    # engine (a process whose only OpenMP user is one thread copies faster, but is not an engine).
    raw_fn(), upd_fn()
    raw = upd = float("inf")
    for _ in range(4 * repeats):  # interleaved, so drift hits both alike (this machine's noise is ~20%)
        raw, upd = min(raw, best(raw_fn, 1)), min(upd, best(upd_fn, 1))
    engine.update_weights_from_tensor(tensors, check_finite=False)  # back to the real weights
    upd_checked = best(lambda: engine.update_weights_from_tensor(tensors), repeats)
    one = [tensors[-1]]
    overhead = best(lambda: engine.update_weights_from_tensor(one, partial=True, check_finite=False), repeats * 3)
    return {"raw_copy_s": raw, "update_s": upd, "update_finite_check_s": upd_checked,
            "fraction_of_raw": raw / upd, "fixed_overhead_ms": 1e3 * overhead}


def _bench_shared_memory(engine, tensors, repeats: int) -> dict:
    """Shared-memory buckets written by another process, against a raw copy out of the same bucket."""
    from weight_sync.shm import open_shared_bucket

    ctx = mp.get_context("spawn")
    handle_q, go_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_shm_sender, args=(handle_q, go_q, tensors, repeats))
    proc.start()
    dests = [torch.empty_like(t) for _, t in tensors]
    shm_times, raw_shm = [], []
    for _ in range(repeats):
        go_q.put(1)
        handle, write_s = handle_q.get(timeout=300)
        opened = open_shared_bucket(handle)
        t0 = time.perf_counter()
        for d, (_, t) in zip(dests, opened.named_tensors):
            d.copy_(t)
        raw_shm.append(time.perf_counter() - t0)
        opened.close()
        t0 = time.perf_counter()
        out = engine.update_weights_from_tensor(handle, check_finite=False)
        shm_times.append(time.perf_counter() - t0)
        assert out.success, out.message
    go_q.put(1)
    proc.join(60)
    return {"raw_shm_copy_s": min(raw_shm), "update_s": min(shm_times), "sender_write_s": write_s,
            "fraction_of_raw": min(raw_shm) / min(shm_times)}


def _bench_distributed(engine, tensors, bucket_sizes: list[int], repeats: int, nbytes: int) -> dict:
    """Over gloo with a separate sender, per bucket size and sender layout, against the sender's
    raw broadcast of the same bytes."""
    port = free_port()
    proc = mp.get_context("spawn").Process(target=_sender, args=(port, 2, tensors, bucket_sizes, repeats))
    raw_bytes = layout((n, t.dtype, tuple(t.shape)) for n, t in tensors)[1]
    proc.start()
    assert engine.init_weights_update_group("127.0.0.1", port, 1, 2, "bench", timeout_s=120).success
    names = [n for n, _ in tensors]
    dtypes = [str(t.dtype).replace("torch.", "") for _, t in tensors]
    shapes = [list(t.shape) for _, t in tensors]
    res = {}
    for bucket in bucket_sizes:
        for source in SENDER_LAYOUTS:
            raw_b, upd_b = [], []
            for _ in range(repeats + 2):
                raw_b.append(engine.probe_weights_update_group("bench", raw_bytes))
                t0 = time.perf_counter()
                out = engine.update_weights_from_distributed(names, dtypes, shapes, "bench", load_format="rollout_bucket",
                                                             bucket_bytes=bucket, check_finite=False)
                upd_b.append(time.perf_counter() - t0)
                assert out.success, out.message
                split = out.detail
            res[f"{bucket >> 20}MiB {source}"] = {
                "raw_broadcast_s": min(raw_b), "update_s": min(upd_b), "fraction_of_raw": min(raw_b) / min(upd_b),
                "last_receive_s": split.get("receive_s"), "last_commit_s": split.get("commit_s"),
                "received_in_place_fraction": split.get("received_in_place_bytes", 0) / nbytes}
    sizes = [t.numel() * t.element_size() for _, t in tensors]
    for load_format in SGLANG_LAYOUTS:
        raw_b, upd_b = [], []
        for _ in range(repeats + 2):
            raw_b.append(engine.probe_weights_update_group("bench", sum(sizes),
                                                           sizes if load_format == "direct" else None))
            t0 = time.perf_counter()
            out = engine.update_weights_from_distributed(names, dtypes, shapes, "bench", load_format=load_format,
                                                         check_finite=False)
            upd_b.append(time.perf_counter() - t0)
            assert out.success, out.message
        res[f"sglang {load_format}"] = {"raw_broadcast_s": min(raw_b), "update_s": min(upd_b),
                                         "fraction_of_raw": min(raw_b) / min(upd_b), "tensors": len(sizes)}
    proc.join(120)
    engine.destroy_weights_update_group("bench")
    return res


def _bench_disk(engine, path: str, repeats: int) -> dict:
    """From the folder with a warm page cache, against reading its files."""
    files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
    disk_bytes = sum(os.path.getsize(f) for f in files)
    buf = bytearray(max(os.path.getsize(f) for f in files))

    def read_all():
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                fh.readinto(buf)
    read_all()
    raw_read = best(read_all, repeats)
    disk = best(lambda: engine.update_weights_from_disk(path, check_finite=False), repeats)
    disk_checked = best(lambda: engine.update_weights_from_disk(path), repeats)
    return {"file_bytes": disk_bytes, "raw_read_s": raw_read, "update_s": disk,
            "update_finite_check_s": disk_checked, "fraction_of_raw": raw_read / disk}


def bench_model(name: str, path: str, dtype: torch.dtype, repeats: int, bucket_sizes: list[int], lora_rank: int = 0,
                workdir: str = DEFAULT_WORKDIR) -> dict:
    # in the model's own order, as a trainer sends its state_dict (the file lists names alphabetically)
    by_name = load_file(os.path.join(path, "model.safetensors"))
    tensors = [(n, by_name[n].to(dtype).contiguous()) for n in hf_parameter_order(path) if n in by_name]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    res = {"model": name, "bytes": nbytes, "dtype": str(dtype)}
    with RolloutEngine(path, dtype=str(dtype).replace("torch.", ""), kv_cache_tokens=256) as engine:
        res["tensor"] = _bench_tensor(engine, tensors, dtype, repeats)
        res["shared_memory"] = _bench_shared_memory(engine, tensors, repeats)
        res["distributed"] = _bench_distributed(engine, tensors, bucket_sizes, repeats, nbytes)
        res["disk"] = _bench_disk(engine, path, repeats)
        if lora_rank:
            from rollout.bench.lora import adapter_pushes

            res["lora"] = {"rank": lora_rank, **adapter_pushes(engine, path, workdir, lora_rank, repeats)}
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="rollout bench weight-sync", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,qwen2-0.5b-random")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mib", default="32,128,512")
    ap.add_argument("--lora-rank", type=int, default=16, help="a LoRA adapter of this rank pushed too (0: none)")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--workdir", default=DEFAULT_WORKDIR)
    ap.add_argument("--delta", action="store_true",
                    help="instead: delta pushes against full pushes of the same steps after real Adam steps "
                         "(rollout.bench.delta; --lrs, --steps)")
    ap.add_argument("--lrs", default="1e-6,1e-5", help="with --delta: the learning rates, each from the same start")
    ap.add_argument("--steps", type=int, default=3, help="with --delta: optimizer steps per learning rate")
    ap.add_argument("--trainer-dtypes", default="float32,bfloat16",
                    help="with --delta: the trainers, each from the same start: float32 (the module and Adam in fp32), "
                         "bfloat16 (a bf16 module, Adam on fp32 master weights, as DeepSpeed's bf16 optimizer)")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.delta:
        return _delta_main(args, dtype)
    buckets = [int(b) << 20 for b in args.bucket_mib.split(",")]
    from tqdm import tqdm

    results = {"benchmark": "weight-sync", "machine": machine(),
               "config": {"models": args.models, "dtype": args.dtype, "repeats": args.repeats,
                          "bucket_mib": args.bucket_mib, "lora_rank": args.lora_rank}, "models": []}
    for name in tqdm(args.models.split(","), desc="weight-sync"):
        res = bench_model(name, build_model(name, args.workdir), dtype, args.repeats, buckets, args.lora_rank,
                          args.workdir)
        print(json.dumps(res, indent=1), flush=True)
        results["models"].append(res)
    write_result(results, args.out_dir, "weight_sync", plot)
    return results


def _delta_main(args, dtype: torch.dtype) -> dict:
    from tqdm import tqdm

    from rollout.bench import delta

    lrs = [float(x) for x in args.lrs.split(",")]
    results = {"benchmark": "weight-sync-delta", "machine": machine(),
               "config": {"models": args.models, "dtype": args.dtype, "lrs": lrs, "steps": args.steps,
                          "trainer_dtypes": args.trainer_dtypes}, "models": []}
    trainers = tuple(args.trainer_dtypes.split(","))
    for name in tqdm(args.models.split(","), desc="weight-sync --delta"):
        path = build_model(name, args.workdir)
        res = {"model": name, "dtype": str(dtype),
               "delta": delta.delta_pushes(path, dtype, lrs, args.steps, trainer_dtypes=trainers)}
        res["bytes"] = next(iter(res["delta"].values()))["steps"][0]["full_bytes"]
        print(json.dumps(res, indent=1), flush=True)
        results["models"].append(res)
    write_result(results, args.out_dir, "weight_sync_delta", delta.plot)
    return results


def plot(results: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results["models"]), figsize=(5 * len(results["models"]), 3.5), squeeze=False)
    for ax, res in zip(axes[0], results["models"]):
        labels = ["tensor", "shm", "disk"] + [f"dist {k}" for k in res["distributed"]]
        vals = [res["tensor"]["fraction_of_raw"], res["shared_memory"]["fraction_of_raw"],
                res["disk"]["fraction_of_raw"]] + [v["fraction_of_raw"] for v in res["distributed"].values()]
        if "lora" in res:
            labels += ["lora in process", "lora over group"]
            vals += [res["lora"]["fraction_of_raw"], res["lora"]["distributed"]["rollout_bucket"]["fraction_of_raw"]]
        bars = ax.bar(labels, vals)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.axhline(0.8, ls="--", lw=0.8, color="gray")
        ax.axhline(0.7, ls=":", lw=0.8, color="gray")
        ax.set_ylabel("raw transport time / update time")
        ax.set_title(f"{res['model']} ({res['bytes'] / 1e6:.0f} MB {res['dtype']})", fontsize=9)
        ax.tick_params(axis="x", labelsize=7, rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
