"""``rollout bench lora``: LoRA adapters against the base weights, in one run on one engine.

- push: ``load_lora_adapter_from_tensors`` of a rank-``--rank`` adapter on every linear (as a trainer
  holds it, fp32) against ``update_weights_from_tensor`` of the whole model in the engine's dtype and
  against a bare ``copy_`` of the adapter's bytes (each the best of ``--repeats``);
- distributed push: ``load_lora_adapter_from_distributed`` from a trainer process over gloo (the
  adapter held in one buffer, as ``trainer_bridge.lora.adapter_tensors`` holds it) in our
  buckets and in miles' one-broadcast-per-tensor layout, against bare broadcasts of the same bytes;
- push to first token: from the start of an adapter push to the first token served on it;
- decode: the decode step with adapters against the same batch on the base weights — one adapter
  at batch 1, 8 and 64, four adapters mixed at batch 64, alternating request by request and grouped
  (each adapter a run of requests) (32-token prompts, 32 new tokens, greedy).

Writes JSON and a PNG to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from safetensors.torch import load_file

from rollout import RolloutEngine, SamplingParams
from rollout.bench.common import add_model_flags, add_output_flags, best, build_model, machine, write_result
from rollout.tools.hf import hf_parameter_order
from rollout.weights.lora import wire_order
from weight_sync.distributed import ADAPTER_BUCKET_BYTES, WeightUpdateSender


def _adapter(path: str, folder: str, rank: int, seed: int) -> tuple[list, dict]:
    from rollout.tools.tiny import make_tiny_adapter

    if not os.path.isfile(os.path.join(folder, "adapter_model.safetensors")):
        make_tiny_adapter(path, folder, r=rank, lora_alpha=2 * rank, seed=seed, std=0.01)
    tensors = list(load_file(os.path.join(folder, "adapter_model.safetensors")).items())
    tensors = [tensors[i] for i in wire_order([n for n, _ in tensors])]  # as our trainer sends them
    return tensors, json.load(open(os.path.join(folder, "adapter_config.json")))


def _bench_push(engine: RolloutEngine, path: str, adapter: list, config: dict, repeats: int) -> dict:
    dtype = engine.dtype
    by_name = load_file(os.path.join(path, "model.safetensors"))
    full = [(n, by_name[n].to(dtype).contiguous()) for n in hf_parameter_order(path) if n in by_name]
    full_s = best(lambda: engine.update_weights_from_tensor(full, flush_cache=False), repeats)
    adapter_s = best(lambda: engine.load_lora_adapter_from_tensors("bench", adapter, config), repeats)
    dst = [torch.empty_like(t, dtype=torch.float32) for _, t in adapter]
    copy_s = best(lambda: torch._foreach_copy_(dst, [t for _, t in adapter]), repeats)
    adapter_bytes = sum(t.numel() * 4 for _, t in adapter)
    return {"full_push_s": full_s, "full_bytes": sum(t.numel() * t.element_size() for _, t in full),
            "adapter_push_s": adapter_s, "adapter_bytes": adapter_bytes, "bare_copy_s": copy_s,
            "adapter_vs_full": full_s / adapter_s, "fraction_of_raw": copy_s / adapter_s}


ADAPTER_LAYOUTS = ("direct", "rollout_bucket")  # miles' one broadcast per tensor; ours (its A, then its B)


# a broadcast that starts each timed transfer, received by the engine just before it: without it the
# sender runs ahead into the next transfer while the engine still finishes the last one, and the loopback
# socket buffers (4 MiB to send, up to 32 MiB to receive) hold megabytes of it before the receive is posted
# — a bare broadcast timed from its post then times only what was not already there
GO_BYTES = 64


def _adapter_sender(port: int, adapter: list, repeats: int) -> None:
    """The trainer's side (its own process): per layout and repeat, a bare broadcast of the adapter's
    bytes as one message, then the adapter as that layout sends it, held as our trainer holds it (in
    one buffer, ``trainer_bridge.lora.adapter_tensors``); each after a ``GO_BYTES`` start signal."""
    torch.set_num_threads(1)  # the engine's process computes beside it on the same cores
    import torch.distributed as dist

    from weight_sync.bucket import FlattenedTensorBucket
    from weight_sync.distributed import broadcast

    sender = WeightUpdateSender("127.0.0.1", port, 2, "bench-lora", timeout_s=120)
    held = FlattenedTensorBucket(adapter)
    flat, adapter = held.buffer, held.named_tensors()
    go = torch.zeros(GO_BYTES, dtype=torch.uint8)
    for load_format in ADAPTER_LAYOUTS:
        for _ in range(repeats + 1):
            broadcast(sender.group, go)
            if load_format == "direct":  # bare: every tensor's own broadcast, posted at once
                opts = dist.BroadcastOptions()
                opts.rootRank = 0
                for work in [sender.group.pg.broadcast([t], opts) for _, t in adapter]:
                    sender.group.wait(work)
            else:
                broadcast(sender.group, flat)
            broadcast(sender.group, go)
            sender.send(adapter, bucket_bytes=ADAPTER_BUCKET_BYTES, load_format=load_format)
    sender.close()


def _bench_distributed_push(engine: RolloutEngine, adapter: list, config: dict, repeats: int) -> dict:
    """``load_lora_adapter_from_distributed`` from a sender process over gloo, against bare broadcasts
    of the same bytes on the same group — one message for our buckets, one per tensor for miles'
    ``direct`` — each the best of ``repeats`` (at least 40), after one warm-up. Both sides start each
    transfer together (``GO_BYTES``); the push is timed by its caller, the bare broadcast from its post
    on the rank (the engine's call around it not counted)."""
    import multiprocessing as mp

    from weight_sync.process_group import free_port

    port = free_port()
    # ~5-10 ms a round on two shared cores, where rounds minutes apart differ by 2x: the best of 10 still
    # moved 0.50-0.71x between runs of one tree (Zen 4, e4d6984); 40 rounds cost ~0.5 s in our layout
    repeats = max(repeats, 40)
    proc = mp.get_context("spawn").Process(target=_adapter_sender, args=(port, adapter, repeats))
    proc.start()
    assert engine.init_weights_update_group("127.0.0.1", port, 1, 2, "bench-lora", timeout_s=120).success
    names, dtypes, shapes = WeightUpdateSender.describe(adapter)
    sizes = [t.numel() * t.element_size() for _, t in adapter]
    nbytes = sum(sizes)
    res = {"adapter_bytes": nbytes, "tensors": len(adapter),
           "start": f"each transfer after a {GO_BYTES}-byte broadcast both sides wait for"}
    for load_format in ADAPTER_LAYOUTS:
        raw, push = [], []
        for _ in range(repeats + 1):
            engine.probe_weights_update_group("bench-lora", GO_BYTES)  # both sides start together
            raw.append(engine.probe_weights_update_group("bench-lora", nbytes, sizes if load_format == "direct" else None))
            engine.probe_weights_update_group("bench-lora", GO_BYTES)
            t0 = time.perf_counter()
            out = engine.load_lora_adapter_from_distributed("dist", config, names, dtypes, shapes, "bench-lora",
                                                            load_format=load_format, bucket_bytes=ADAPTER_BUCKET_BYTES)
            push.append(time.perf_counter() - t0)
            assert out.success, out.message
        res[load_format] = {"push_s": min(push[1:]), "bare_broadcast_s": min(raw[1:]),
                            "fraction_of_raw": min(raw[1:]) / min(push[1:])}
    proc.join(120)
    engine.destroy_weights_update_group("bench-lora")
    engine.unload_lora_adapter("dist")
    return res


def adapter_pushes(engine: RolloutEngine, path: str, workdir: str, rank: int, repeats: int) -> dict:
    """A rank-``rank`` adapter on every linear of the model at ``path``: pushed in process (against a full
    push and a bare copy) and over a weight-update group (against bare broadcasts); what
    ``rollout bench weight-sync --lora-rank`` reports beside the full-weight paths."""
    folder = os.path.join(workdir, f"lora-{os.path.basename(path.rstrip('/'))}-r{rank}-0")
    adapter, config = _adapter(path, folder, rank, 0)
    res = _bench_push(engine, path, adapter, config, repeats)
    res["distributed"] = _bench_distributed_push(engine, adapter, config, repeats)
    engine.unload_lora_adapter("bench")
    return res


def _push_to_first_token(engine: RolloutEngine, adapter: list, config: dict, prompt: list[int], repeats: int) -> float:
    one = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)

    def run():
        engine.load_lora_adapter_from_tensors("fresh", adapter, config)
        engine.generate(input_ids=prompt, sampling_params=one, lora_path="fresh")

    return best(run, repeats)


def _decode_step_s(engine: RolloutEngine, prompts: list[list[int]], loras, new_tokens: int) -> float:
    """Seconds per decode step: a run of ``new_tokens`` minus a 1-token run (its prefill), per step."""
    def run(n: int) -> float:
        sp = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=sp, lora_path=loras, return_logprob=False)
        return time.perf_counter() - t0

    run(2)  # warm: the row counts' kernels and copies
    return (min(run(new_tokens) for _ in range(2)) - min(run(1) for _ in range(2))) / (new_tokens - 1)


def _bench_decode(engine: RolloutEngine, adapters: list, config: dict, vocab: int, new_tokens: int,
                  batches: list[int]) -> dict:
    for i, a in enumerate(adapters):
        assert engine.load_lora_adapter_from_tensors(f"a{i}", a, config).success
    g = torch.Generator().manual_seed(0)
    out = {}
    top, many = max(batches), len(adapters)
    for batch, mix, grouped in [(b, 1, False) for b in batches] + [(top, many, False), (top, many, True)]:
        prompts = torch.randint(3, vocab, (batch, 32), generator=g).tolist()
        base = _decode_step_s(engine, prompts, None, new_tokens)
        # mixed: the adapters alternate request by request, or (grouped) each takes a run of requests, as a
        # trainer's prompts of one run (or one policy version) come together
        loras = [f"a{i * mix // batch if grouped else i % mix}" for i in range(batch)]
        lora = _decode_step_s(engine, prompts, loras, new_tokens)
        out[f"batch{batch}_adapters{mix}{'_grouped' if grouped else ''}"] = {
            "base_step_s": base, "lora_step_s": lora, "lora_over_base": lora / base}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="rollout bench lora", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,8,64", help="decode batches with one adapter; four mixed at the largest")
    add_output_flags(ap)
    args = ap.parse_args(argv)
    path = build_model(args.model, args.workdir)
    folder = os.path.join(args.workdir, f"lora-{os.path.basename(path.rstrip('/'))}-r{args.rank}")
    adapters = [_adapter(path, f"{folder}-{i}", args.rank, i) for i in range(4)]
    config = adapters[0][1]
    res: dict = {"benchmark": "lora", "machine": machine(),
                 "config": {"model": args.model, "dtype": args.dtype, "rank": args.rank, "repeats": args.repeats,
                            "new_tokens": args.new_tokens}}
    top = max(int(b) for b in args.batches.split(","))
    with RolloutEngine(path, dtype=args.dtype, kv_cache_tokens=top * (32 + args.new_tokens) + 256,
                       use_generation_config=False) as engine:
        res["push"] = _bench_push(engine, path, adapters[0][0], config, args.repeats)
        res["distributed_push"] = _bench_distributed_push(engine, adapters[0][0], config, args.repeats)
        prompt = [5] * 32
        res["push_to_first_token_s"] = _push_to_first_token(engine, adapters[0][0], config, prompt, args.repeats)
        for name in ("bench", "fresh"):
            engine.unload_lora_adapter(name)
        res["decode"] = _bench_decode(engine, [a for a, _ in adapters], config, engine.model_config.vocab_size,
                                      args.new_tokens, [int(b) for b in args.batches.split(",")])
    print(json.dumps({k: v for k, v in res.items() if k != "machine"}, indent=1), flush=True)
    write_result(res, args.out_dir, "lora", plot)
    return res


def plot(res: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.5))
    push = res["push"]
    dist = res["distributed_push"]["rollout_bucket"]
    bars = a.bar(["full push", "adapter push", "bare copy", "adapter over\nthe group", "bare\nbroadcast"],
                 [push["full_push_s"] * 1e3, push["adapter_push_s"] * 1e3, push["bare_copy_s"] * 1e3,
                  dist["push_s"] * 1e3, dist["bare_broadcast_s"] * 1e3])
    a.bar_label(bars, fmt="%.1f", fontsize=8)
    a.tick_params(axis="x", labelsize=7)
    a.set_ylabel("ms")
    a.set_title(f"rank {res['config']['rank']}: {push['adapter_bytes'] / 1e6:.1f} MB adapter, "
                f"{push['full_bytes'] / 1e6:.0f} MB model", fontsize=9)
    labels = list(res["decode"])
    bars = b.bar(labels, [res["decode"][k]["lora_over_base"] for k in labels])
    b.bar_label(bars, fmt="%.2f", fontsize=8)
    b.axhline(1.0, ls="--", lw=0.8, color="gray")
    b.set_ylabel("decode step with adapters / base")
    b.tick_params(axis="x", labelsize=7, rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
