"""GRPO with a colocated rollout engine: DeepSpeed trains, rollout-worker generates, on the same
ranks (each trainer rank hosts one TP rank of the engine; weights move as tensors).

CPU, the embedded tiny model (the main job):
    python -m torch.distributed.run --nproc_per_node 2 examples/grpo_colocated.py
GPUs, any Hugging Face folder, launched by any of:
    torchrun --nproc_per_node 8 examples/grpo_colocated.py --model /path/to/hf --tp-size 2 --zero-stage 3
    deepspeed --num_gpus 8 examples/grpo_colocated.py --model ...
    accelerate launch --use_deepspeed --num_processes 8 examples/grpo_colocated.py --model ...
The real SmolLM2-135M: ``--model smollm2``.

Task: a prompt starts with one of two marker tokens; the reward is the fraction of completion
tokens whose id has the parity that marker asks for. A policy has to read its prompt to win.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import rollout  # noqa: E402,F401  first: its OpenMP defaults must be set before torch loads (rollout.openmp)
from trainer_bridge.grpo_setup import add_flags, build_trainer, grpo_config, step_logger  # noqa: E402


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    own = ap.add_argument_group("colocated")
    own.add_argument("--tp-size", type=int, default=None, help="engine TP size (default: the world size)")
    own.add_argument("--no-release", action="store_true", help="keep the engine's memory while training")
    return add_flags(ap).parse_args(argv)


def main(argv=None) -> list:
    args = parse(argv)
    ds_engine, path, tied, rank, world = build_trainer(args)
    import torch.distributed as dist
    from parity_task import parity_task

    from rollout import RolloutEngine
    from rollout.models import ModelConfig
    from trainer_bridge.grpo import run_grpo

    # default: the largest TP size that divides the world and splits the model (TP=1: one engine per rank);
    # true on-policy: TP=1 (a TP=2 engine splits each row-parallel sum in two, which the trainer does not)
    tp = args.tp_size or (1 if args.true_on_policy else
                          max(t for t in ModelConfig.from_pretrained(path).valid_tp_sizes(world) if world % t == 0))
    if args.true_on_policy and tp != 1:
        raise SystemExit(f"--true-on-policy needs engines at TP=1 (got --tp-size {tp})")
    engine = RolloutEngine(path, dtype=args.dtype, tp_size=tp, launch="external" if tp > 1 else "spawn",
                           kv_cache_tokens=4096, seed=args.seed, use_generation_config=False,
                           deterministic=args.true_on_policy, enable_return_routed_experts=args.routing_replay)
    prompts, reward = parity_task(engine.model_config.vocab_size)
    log, finish = step_logger(args, rank)
    logs = run_grpo(grpo_config(args, release_memory=not args.no_release), ds_engine, engine, prompts, reward,
                    tie_word_embeddings=tied, log_fn=log)
    finish(logs)
    engine.shutdown()
    dist.barrier()
    return logs


if __name__ == "__main__":
    main()
