"""What both GRPO examples share (``examples/grpo_colocated.py``, ``examples/grpo_disaggregated.py``):
their common flags, the model folder by name, the trainer (DeepSpeed over the launcher's ranks),
the loop's config from the flags and the step logger (a table on stdout, wandb offline without a
key, the reward curve)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import tempfile
from typing import Literal, cast

from trainer_bridge.ds_setup import ds_config, setup_deepspeed_env


def add_flags(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags both GRPO examples take (each adds its own in a group of its own)."""
    ap.add_argument("--model", default="tiny",
                    help="'tiny' (built locally), 'tiny-moe' (a tiny Qwen3-MoE, built locally), 'smollm2', or a "
                         "Hugging Face folder")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--n", "--group-size", dest="n", type=int, default=8,
                    help="samples per prompt (the GRPO group); under torch.distributed.run spell it --group-size "
                         "(its own parser takes --n for a prefix of --nnodes / --nproc-per-node)")
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--zero-stage", type=int, default=3, choices=[0, 1, 2, 3])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--top-k", type=int, default=-1, help="sampling truncation (masks are then returned and replayed)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--kl-coef", type=float, default=0.0)
    ap.add_argument("--tis-cap", type=float, default=None)
    ap.add_argument("--no-push", action="store_true", help="control run: never push weights to the engine")
    ap.add_argument("--control-steps", type=int, default=0, metavar="K",
                    help="a control arm inside the run: the rollouts of the first K steps run on the initial "
                         "weights (nothing pushed until then; their rewards stay flat)")
    ap.add_argument("--push-per-parameter", action="store_true",
                    help="gather and push one parameter at a time (the slow baseline) instead of buckets")
    ap.add_argument("--bucket-mb", type=int, default=64, help="push bucket size")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK",
                    help="train a peft LoRA adapter of this rank on every linear instead of the full weights; each "
                         "push moves only the adapter (0: full weights)")
    ap.add_argument("--lora-alpha", type=int, default=None, help="LoRA alpha (default: 2 x rank)")
    ap.add_argument("--true-on-policy", action="store_true",
                    help="the trainer computes its logprobs as the engine does in its batch-invariant mode (the engines "
                         "run deterministic=True at TP=1): the logprob difference is exactly 0 on every token")
    ap.add_argument("--routing-replay", action="store_true",
                    help="mixtures of experts: the engines return each token's experts and the trainer routes every "
                         "token to them (R3: rollout routing replay)")
    ap.add_argument("--delta-sync", action="store_true",
                    help="after the first full push, push only the elements that changed since the last one, against "
                         "the version the engine holds (checked before and after; a full push where it is refused)")
    ap.add_argument("--delta-anchor-every", type=int, default=0, metavar="N",
                    help="with --delta-sync: a full push after every N deltas (an anchor; 0: only where one is refused)")
    ap.add_argument("--dist-check-samples", type=int, default=1, metavar="K",
                    help="the full-distribution check: the engine's whole next-token distribution at the first "
                         "positions of K samples a rank and step, against the trainer's (0: off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="rl_runs/grpo")
    ap.add_argument("--no-wandb", action="store_true")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return ap


def model_path(name: str, seed: int, lora: bool = False) -> str:
    """The model folder by name. The tiny model of a LoRA run has an LM head of std 0.5 instead of 0.05:
    an adapter on the linears leaves the head frozen, and a head of std 0.05 lets the final hidden
    state move the even tokens' logits against the odd ones by well under one nat (the task could not be
    learned); the initial reward is the same (~0.5)."""
    if name == "smollm2":
        from rollout.tools.smollm2 import smollm2_path

        return smollm2_path()
    if name not in ("tiny", "tiny-moe"):
        return name
    from rollout.tools.tiny import make_tiny_model

    if name == "tiny-moe":  # Qwen3-MoE shaped: 32 experts, 4 routed per token, every layer sparse
        path = os.path.join(tempfile.gettempdir(), f"rollout-grpo-tiny-moe-{seed}")
        if not os.path.isfile(os.path.join(path, "model.safetensors")):
            make_tiny_model(path + ".tmp", "qwen3_moe", hidden_size=64, intermediate_size=128, num_layers=2,
                            num_heads=4, num_kv_heads=2, seed=seed, embed_std=0.05, head_std=0.05, with_tokenizer=True,
                            num_experts=32, num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[])
            os.replace(path + ".tmp", path) if not os.path.exists(path) else None
        return path

    path = os.path.join(tempfile.gettempdir(), f"rollout-grpo-tiny-{'lora-' if lora else ''}{seed}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        make_tiny_model(path + ".tmp", "llama", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, seed=seed, embed_std=0.05, head_std=0.5 if lora else 0.05,
                        with_tokenizer=True)
        os.replace(path + ".tmp", path) if not os.path.exists(path) else None
    return path


def build_trainer(args, on_model_folder=None, model_folder=None):
    """DeepSpeed over the launcher's ranks: (ds_engine, model folder, tied embeddings, rank, world).
    ``on_model_folder(path, rank)``, if given, runs as soon as the folder exists, before the trainer's
    model is loaded (what starts there overlaps the loading); ``model_folder(name, seed)`` finds or
    builds the folder (default ``model_path``; rank 0 first, the others after it)."""
    model_folder = model_folder or functools.partial(model_path, lora=bool(args.lora))
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
        path = model_folder(args.model, args.seed)
    dist.barrier()
    path = model_folder(args.model, args.seed)
    if on_model_folder is not None:
        on_model_folder(path, rank)

    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tied = bool(base.config.tie_word_embeddings)
    policy: torch.nn.Module = base
    if args.lora:
        from trainer_bridge.lora import LoraSpec, wrap_lora

        policy = wrap_lora(base, LoraSpec(args.lora, args.lora_alpha or 2 * args.lora))
    trained = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0)
    ds_engine, *_ = deepspeed.initialize(model=policy, optimizer=optimizer,
                                         config=ds_config(args.zero_stage, args.lr, dtype == torch.bfloat16, world))
    return ds_engine, path, tied, rank, world


def grpo_config(args, release_memory: bool, max_staleness: int = 0, stale_policy: str = "keep"):
    """The loop's config from the shared flags (checked as it is built); ``release_memory`` and the
    staleness options are the caller's (colocated: ``--no-release``; disaggregated: ``--max-staleness``)."""
    from trainer_bridge.grpo import GRPOConfig

    return GRPOConfig(steps=args.steps, prompts_per_step=args.prompts_per_step, n=args.n,
                      max_new_tokens=args.max_new_tokens, temperature=args.temperature, lr=args.lr,
                      kl_coef=args.kl_coef, tis_cap=args.tis_cap, push_weights=not args.no_push,
                      control_steps=args.control_steps,
                      top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                      repetition_penalty=args.repetition_penalty,
                      release_memory=release_memory and not args.no_push, seed=args.seed,
                      out_dir=args.out_dir, push_per_parameter=args.push_per_parameter,
                      bucket_bytes=args.bucket_mb << 20, max_staleness=max_staleness, stale_policy=stale_policy,
                      lora_name="policy" if args.lora else None, true_on_policy=args.true_on_policy,
                      dist_check_samples=args.dist_check_samples, routing_replay=args.routing_replay,
                      delta_sync=args.delta_sync, delta_anchor_every=args.delta_anchor_every)


def step_logger(args, rank: int):
    """(log one step, finish the run): a table on stdout, wandb (offline without a key), the curve."""
    from trainer_bridge.grpo import write_logs

    run = None
    if rank == 0 and not args.no_wandb:
        import wandb

        mode = os.environ.get("WANDB_MODE", "offline")
        if mode not in ("online", "offline", "disabled", "shared"):
            raise ValueError(f"WANDB_MODE={mode!r}: use online, offline, disabled or shared")
        run = wandb.init(project="rollout-worker-grpo", config=vars(args), dir=tempfile.gettempdir(),
                         mode=cast(Literal["online", "offline", "disabled", "shared"], mode))
    if rank == 0:
        print(f"{'step':>4} {'reward':>7} {'tok/s':>7} {'rollout s':>9} {'train s':>7} {'sync s':>6} "
              f"{'|dlogp| mean':>12} {'max':>9} {'unmasked max':>12} {'released MB':>11}", flush=True)

    def log(x):
        print(f"{x.step:>4} {x.reward:>7.3f} {x.rollout_tok_s:>7.0f} {x.rollout_s:>9.3f} {x.train_s:>7.3f} "
              f"{x.sync_s:>6.3f} {x.mismatch_mean:>12.2e} {x.mismatch_max:>9.2e} {x.mismatch_unmasked_max:>12.2e} "
              f"{x.engine_released_bytes / 2**20:>11.1f}", flush=True)
        if run is not None:
            run.log({k: v for k, v in dataclasses.asdict(x).items() if isinstance(v, (int, float))}, step=x.step)

    def finish(logs) -> None:
        if rank == 0:
            png = write_logs(logs, args.out_dir)
            print(f"reward curve: {png}")
            if run is not None:
                run.finish()

    return log, finish
