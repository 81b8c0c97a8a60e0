"""A rollout demo: build the embedded tiny model locally and run an RL-shaped rollout on it —
chat prompts, ``n`` samples each, per-token processed logprobs — then print a table and the
engine's counters. (The RL main job, GRPO with DeepSpeed, is ``make demo`` /
``examples/grpo_colocated.py``.)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="rollout demo", description=__doc__)
    ap.add_argument("--model-path", default=None, help="a Hugging Face folder (default: the embedded tiny model)")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args(argv)

    from rollout import RolloutEngine, SamplingParams
    from rollout.tools.tiny import make_tiny_model

    path = args.model_path
    if path is None:
        path = os.path.join(tempfile.gettempdir(), "rollout-demo-tiny")
        if not os.path.isfile(os.path.join(path, "model.safetensors")):
            make_tiny_model(path, "qwen2", hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                            num_kv_heads=2, tie_word_embeddings=True, embed_std=0.05, head_std=0.05)
    questions = ["What is two plus three?", "Name a fruit.", "Count with me.", "Hello, world!",
                 "Write a short story about a robot.", "What color is the sky?"]
    with RolloutEngine(path, dtype="float32", kv_cache_tokens=8192) as engine:
        prompts = [engine.apply_chat_template([{"role": "user", "content": questions[i % len(questions)]}])
                   for i in range(args.num_prompts)]
        sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, n=args.n, seed=1234)
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
        elapsed = time.perf_counter() - t0
        stats = engine.get_stats()
    print(f"{'prompt':>6} {'sample':>6} {'tokens':>6} {'sum logprob':>11} {'finish':>7}  text")
    for o in outs:
        print(f"{o.prompt_index:>6} {o.sample_index:>6} {len(o.output_token_ids):>6} "
              f"{sum(o.output_logprobs):>11.3f} {o.finish_reason:>7}  {o.text[:40]!r}")
    n_tok = sum(len(o.output_token_ids) for o in outs)
    print(f"\n{len(outs)} completions, {n_tok} tokens in {elapsed:.2f}s ({n_tok / elapsed:.0f} tok/s); "
          f"prompt tokens run {stats['num_prefill_tokens']}, shared by forked samples "
          f"{stats['num_shared_prefill_tokens']}, steps {stats['num_steps']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
