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
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import rollout  # noqa: E402,F401  first: its OpenMP defaults must be set before torch loads (rollout.openmp)
from trainer_bridge.ds_setup import ds_config, setup_deepspeed_env  # noqa: E402


def add_flags(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags the colocated and the disaggregated loop share."""
    ap.add_argument("--model", default="tiny", help="'tiny' (built locally), 'smollm2', or a Hugging Face folder")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (the GRPO group)")
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--zero-stage", type=int, default=3, choices=[0, 1, 2, 3])
    ap.add_argument("--tp-size", type=int, default=None, help="engine TP size (default: the world size)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--top-k", type=int, default=-1, help="sampling truncation (masks are then returned and replayed)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--max-staleness", type=int, default=0,
                    help="disaggregated only: generate up to this many steps ahead with older weights (0: sync)")
    ap.add_argument("--stale-policy", default="keep", choices=["drop", "keep", "tis"],
                    help="tokens older than --max-staleness: drop them from the loss, keep them, or weight them")
    ap.add_argument("--kl-coef", type=float, default=0.0)
    ap.add_argument("--tis-cap", type=float, default=None)
    ap.add_argument("--no-push", action="store_true", help="control run: never push weights to the engine")
    ap.add_argument("--no-release", action="store_true", help="keep the engine's memory while training")
    ap.add_argument("--push-per-parameter", action="store_true",
                    help="gather and push one parameter at a time (the slow baseline) instead of buckets")
    ap.add_argument("--bucket-mb", type=int, default=64, help="push bucket size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="rl_runs/grpo")
    ap.add_argument("--no-wandb", action="store_true")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return ap


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_flags(ap).parse_args(argv)


def model_path(name: str, seed: int) -> str:
    if name == "smollm2":
        from rollout.tools.smollm2 import smollm2_path

        return smollm2_path()
    if name != "tiny":
        return name
    from rollout.tools.tiny import make_tiny_model

    path = os.path.join(tempfile.gettempdir(), f"rollout-grpo-tiny-{seed}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        make_tiny_model(path + ".tmp", "llama", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, seed=seed, embed_std=0.05, head_std=0.05, with_tokenizer=True)
        os.replace(path + ".tmp", path) if not os.path.exists(path) else None
    return path


def build_trainer(args, on_model_folder=None):
    """DeepSpeed over the launcher's ranks: (ds_engine, model folder, tied embeddings, rank, world).
    ``on_model_folder(path, rank)``, if given, runs as soon as the folder exists, before the trainer's
    model is loaded (what starts there overlaps the loading)."""
    setup_deepspeed_env()
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    torch.manual_seed(args.seed)
    if rank == 0:  # one process builds the tiny model; the others wait for it
        path = model_path(args.model, args.seed)
    dist.barrier()
    path = model_path(args.model, args.seed)
    if on_model_folder is not None:
        on_model_folder(path, rank)

    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tied = bool(policy.config.tie_word_embeddings)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    ds_engine, *_ = deepspeed.initialize(model=policy, optimizer=optimizer,
                                         config=ds_config(args.zero_stage, args.lr, dtype == torch.bfloat16, world))
    return ds_engine, path, tied, rank, world


def grpo_config(args, release_memory: bool = True):
    from trainer_bridge.grpo import GRPOConfig

    return GRPOConfig(steps=args.steps, prompts_per_step=args.prompts_per_step, n=args.n,
                      max_new_tokens=args.max_new_tokens, temperature=args.temperature, lr=args.lr,
                      kl_coef=args.kl_coef, tis_cap=args.tis_cap, push_weights=not args.no_push,
                      top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                      repetition_penalty=args.repetition_penalty,
                      release_memory=release_memory and not args.no_release and not args.no_push, seed=args.seed,
                      out_dir=args.out_dir, push_per_parameter=args.push_per_parameter,
                      bucket_bytes=args.bucket_mb << 20, max_staleness=args.max_staleness,
                      stale_policy=args.stale_policy)


def step_logger(args, rank: int):
    """(log one step, finish the run): a table on stdout, wandb (offline without a key), the curve."""
    from trainer_bridge.grpo import write_logs

    run = None
    if rank == 0 and not args.no_wandb:
        import wandb

        run = wandb.init(project="rollout-worker-grpo", config=vars(args), dir=tempfile.gettempdir(),
                         mode=os.environ.get("WANDB_MODE", "offline"))
    if rank == 0:
        print(f"{'step':>4} {'reward':>7} {'tok/s':>7} {'rollout s':>9} {'train s':>7} {'sync s':>6} "
              f"{'|dlogp| mean':>12} {'max':>9} {'unmasked max':>12} {'released MB':>11}", flush=True)

    def log(x):
        print(f"{x.step:>4} {x.reward:>7.3f} {x.rollout_tok_s:>7.0f} {x.rollout_s:>9.3f} {x.train_s:>7.3f} "
              f"{x.sync_s:>6.3f} {x.mismatch_mean:>12.2e} {x.mismatch_max:>9.2e} {x.mismatch_unmasked_max:>12.2e} "
              f"{x.engine_released_bytes / 2**20:>11.1f}", flush=True)
        if run is not None:
            run.log({k: v for k, v in vars(x).items() if isinstance(v, (int, float))}, step=x.step)

    def finish(logs) -> None:
        if rank == 0:
            png = write_logs(logs, args.out_dir)
            print(f"reward curve: {png}")
            if run is not None:
                run.finish()

    return log, finish


def main(argv=None) -> list:
    args = parse(argv)
    ds_engine, path, tied, rank, world = build_trainer(args)
    import torch.distributed as dist
    from parity_task import parity_task

    from rollout import RolloutEngine
    from rollout.models import ModelConfig
    from trainer_bridge.grpo import run_grpo

    # default: the largest TP size that divides the world and splits the model (TP=1: one engine per rank)
    tp = args.tp_size or max(t for t in ModelConfig.from_pretrained(path).valid_tp_sizes(world) if world % t == 0)
    engine = RolloutEngine(path, dtype=args.dtype, tp_size=tp, launch="external" if tp > 1 else "spawn",
                           kv_cache_tokens=4096, seed=args.seed, use_generation_config=False)
    prompts, reward = parity_task(engine.model_config.vocab_size)
    log, finish = step_logger(args, rank)
    logs = run_grpo(grpo_config(args), ds_engine, engine, prompts, reward, tie_word_embeddings=tied, log_fn=log)
    finish(logs)
    engine.shutdown()
    dist.barrier()
    return logs


if __name__ == "__main__":
    main()
