"""Rollout throughput: our engine vs Hugging Face ``generate`` on the same model, dtype and
prompts, in one run. RL-shaped workload: chat prompts x ``n`` samples, temperature 1, top-k and
top-p off on both sides; one variant stops at EOS, one ignores it. Reports useful tokens/s of
both (tokens up to and including EOS), their ratio, and sampler ms per step; writes JSON and PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child.",
    "List three prime numbers.", "What is 17 times 3?", "Name a color of the rainbow.",
    "Give me a synonym for happy.", "Why is the sky blue?", "Translate 'good morning' to Spanish.",
    "What do bees make?", "Describe a cat in one sentence.", "What is the boiling point of water?",
    "Tell me a fun fact about octopuses.", "How many legs does a spider have?", "What is 2 + 2?",
    "Suggest a name for a pet robot.",
]


def build_model(name: str, workdir: str) -> str:
    if os.path.isdir(name):
        return name
    if name == "smollm2":
        from rollout.tools.smollm2 import smollm2_path

        return smollm2_path()
    from rollout.tools.tiny import make_tiny_model

    if name == "qwen2-0.5b-random":
        path = os.path.join(workdir, "qwen2-0.5b-random")
        if not os.path.isfile(os.path.join(path, "model.safetensors")):
            make_tiny_model(path, "qwen2", hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                            num_kv_heads=2, vocab_size=151936, tie_word_embeddings=True, dtype=torch.bfloat16,
                            embed_std=0.02, head_std=0.02, max_position_embeddings=4096)
        return path
    if name == "tiny":
        path = os.path.join(workdir, "tiny-llama")
        if not os.path.isfile(os.path.join(path, "model.safetensors")):
            make_tiny_model(path, "llama", hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                            num_kv_heads=2, embed_std=0.02, head_std=0.02)
        return path
    raise ValueError(f"unknown model {name!r}: a folder, 'smollm2', 'qwen2-0.5b-random' or 'tiny'")


def make_prompts(tokenizer, num_prompts: int) -> list[list[int]]:
    prompts = []
    for i in range(num_prompts):
        q = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (variant {i // len(QUESTIONS)})")
        msgs = [{"role": "user", "content": q}]
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(q)["input_ids"]
        prompts.append(list(ids))
    return prompts


def useful_lengths(seqs: torch.Tensor, eos_ids: set[int], ignore_eos: bool) -> list[int]:
    out = []
    for row in seqs.tolist():
        n = len(row)
        if not ignore_eos:
            n = next((i + 1 for i, t in enumerate(row) if t in eos_ids), n)
        out.append(n)
    return out


def run_hf(path, dtype, prompts, n, max_new_tokens, ignore_eos, eos_ids, hf_batch) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else next(iter(eos_ids))
    torch.manual_seed(0)
    total, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), hf_batch):
        chunk = prompts[i: i + hf_batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                      num_return_sequences=n, pad_token_id=pad)
        if ignore_eos:
            kwargs["min_new_tokens"] = max_new_tokens
        else:
            kwargs["eos_token_id"] = sorted(eos_ids)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, **kwargs)
        total += sum(useful_lengths(out[:, width:], eos_ids, ignore_eos))
    elapsed = time.perf_counter() - t0
    return {"tokens": total, "seconds": elapsed, "tokens_per_s": total / elapsed}


def run_engine(path, dtype, prompts, n, max_new_tokens, ignore_eos, tp_size, overlap) -> dict:
    from rollout import RolloutEngine, SamplingParams

    kv_tokens = len(prompts) * n * (max(map(len, prompts)) + max_new_tokens + 16)
    with RolloutEngine(path, dtype=dtype, tp_size=tp_size, enable_overlap=overlap, kv_cache_tokens=kv_tokens,
                       max_num_seqs=len(prompts) * n, use_generation_config=False) as engine:
        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, top_k=-1, top_p=1.0, n=n, seed=0,
                            ignore_eos=ignore_eos)
        engine.generate(input_ids=prompts[:1], sampling_params=SamplingParams(max_new_tokens=2))  # warm-up
        base = engine.get_stats()
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
        elapsed = time.perf_counter() - t0
        stats = engine.get_stats()
    steps = stats["num_sample_steps"] - base["num_sample_steps"]
    total = sum(len(o.output_token_ids) for o in outs)
    return {"tokens": total, "seconds": elapsed, "tokens_per_s": total / elapsed, "steps": steps,
            "sampler_ms_per_step": 1e3 * (stats["sample_time_s"] - base["sample_time_s"]) / max(steps, 1),
            "forward_ms_per_step": 1e3 * (stats["forward_time_s"] - base["forward_time_s"]) / max(steps, 1)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="rollout bench throughput", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2",
                    help="a model folder, 'smollm2' (PyPI package), 'qwen2-0.5b-random' or 'tiny'")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--variants", default="eos,ignore_eos", help="comma list of: eos, ignore_eos")
    ap.add_argument("--hf-batch", type=int, default=32, help="prompts per Hugging Face generate call")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--overlap", choices=["on", "off"], default="off")
    ap.add_argument("--skip-hf", action="store_true", help="measure only our engine")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--workdir", default=os.path.join(os.path.expanduser("~"), ".cache", "rollout-worker"))
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    path = build_model(args.model, args.workdir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = make_prompts(tokenizer, args.num_prompts)
    from rollout.models import ModelConfig

    eos_ids = set(ModelConfig.from_pretrained(path).eos_token_ids) | {tokenizer.eos_token_id}
    dtype = getattr(torch, args.dtype)
    results = {"model": args.model, "dtype": args.dtype, "num_prompts": args.num_prompts, "n": args.n,
               "max_new_tokens": args.max_new_tokens, "tp_size": args.tp_size, "overlap": args.overlap,
               "threads": torch.get_num_threads(), "variants": {}}
    for variant in args.variants.split(","):
        ignore = variant == "ignore_eos"
        ours = run_engine(path, args.dtype, prompts, args.n, args.max_new_tokens, ignore, args.tp_size,
                          args.overlap == "on")
        entry = {"engine": ours}
        if not args.skip_hf:
            hf = run_hf(path, dtype, prompts, args.n, args.max_new_tokens, ignore, eos_ids, args.hf_batch)
            entry["hf_generate"] = hf
            entry["ratio"] = ours["tokens_per_s"] / hf["tokens_per_s"]
        results["variants"][variant] = entry
        print(json.dumps({variant: entry}, indent=1), flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"throughput_{os.path.basename(args.model.rstrip('/'))}_{args.dtype}"
                                      f"_tp{args.tp_size}_overlap-{args.overlap}")
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    _plot(results, stem + ".png")
    return results


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(results["variants"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.35
    for j, system in enumerate(["engine", "hf_generate"]):
        vals = [results["variants"][v].get(system, {}).get("tokens_per_s", 0) for v in variants]
        bars = ax.bar([i + j * width for i in range(len(variants))], vals, width,
                      label="rollout-worker" if system == "engine" else "HF generate")
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([i + width / 2 for i in range(len(variants))], variants)
    ax.set_ylabel("useful tokens / s")
    ax.set_title(f"{results['model']} {results['dtype']}: {results['num_prompts']} prompts x n={results['n']}, "
                 f"{results['max_new_tokens']} new", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
