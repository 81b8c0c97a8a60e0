"""Multi-turn GRPO with tool calls: the model is asked the colour of a fruit, calls a ``lookup`` tool
with the fruit as argument, reads the tool's answer and says it; then the next fruit (four assistant
turns per episode: call, answer, call, answer). Every turn goes through the model's chat template
(Qwen2.5's, tools rendered) and the Hermes tool-call parser; each trajectory is the tokens the engine
sampled plus the tokens the template appended for the environment, and only the sampled ones are
trained (``trainer_bridge.multiturn``, ``trainer_bridge.grpo_multiturn``).

The embedded tiny model (a Qwen2-shaped model, its tokenizer trained locally with Qwen2.5's special
tokens) first gets a short supervised warm-up (150 steps, under a minute): demonstrations that write
valid tool calls, calling the asked fruit and saying its colour 40 % of the time and a random one
otherwise (``--warmup-right``) — a weak policy (mean reward ~0.35). GRPO then has to raise it. (From a
warm-up on the format alone — reward at chance, 0.25 — the tiny model's policy gradient is too noisy
to find the task in a few minutes, and learning rates that would move it faster break the format.)

CPU, colocated (each trainer rank hosts an engine and plays its share of the episodes; sessions keep each
episode's KV between turns):
    python -m torch.distributed.run --nproc_per_node 2 examples/grpo_multiturn.py
Against rollout servers this script starts (each episode a session pinned to one replica):
    python -m torch.distributed.run --nproc_per_node 1 examples/grpo_multiturn.py --replicas 2
The same through the field's router (turns resend the history with the episode as X-SMG-Routing-Key):
    python -m torch.distributed.run --nproc_per_node 1 examples/grpo_multiturn.py --replicas 2 --router smg
Asynchronous, pushes landing between and inside turns (each token's weight version recorded):
    python -m torch.distributed.run --nproc_per_node 1 examples/grpo_multiturn.py --replicas 2 \\
        --max-staleness 1 --partial-rollouts
The control run (weights never pushed: the engine keeps the warm-up policy): add ``--no-push``.
SmolLM2-135M-Instruct instead: ``--model smollm2`` (its ChatML template renders no tools: the tool and
the Hermes call format are described in the system message; no warm-up by default).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import rollout  # noqa: E402,F401  first: its OpenMP defaults must be set before torch loads (rollout.openmp)
from trainer_bridge.grpo_setup import add_flags, build_trainer, grpo_config, step_logger  # noqa: E402

OWN_FLAGS = ("fruits", "max_turns", "warmup_steps", "warmup_right", "replicas", "router", "no_sessions",
             "max_staleness", "partial_rollouts")


def parse(argv=None):
    """(this script's own flags, the flags shared with the other GRPO examples)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    own = ap.add_argument_group("multi-turn")
    own.add_argument("--fruits", type=int, default=2, help="questions per episode (two assistant turns each)")
    own.add_argument("--max-turns", type=int, default=None, help="assistant turns per episode (default 2 x fruits)")
    own.add_argument("--warmup-steps", type=int, default=None,
                     help="supervised warm-up steps before RL (default: 150 for tiny, 0 otherwise)")
    own.add_argument("--warmup-right", type=float, default=0.4,
                     help="how often the warm-up's demonstrations call the asked fruit and say its colour (else at random)")
    own.add_argument("--replicas", type=int, default=0, help="play against this many local rollout servers (0: colocated)")
    own.add_argument("--router", default=None, choices=["sglang-router", "smg"],
                     help="with --replicas: put the field's router in front (routing keys instead of sessions)")
    own.add_argument("--no-sessions", action="store_true", help="resend each turn's whole history (prefix cache)")
    own.add_argument("--max-staleness", type=int, default=0,
                     help="with --replicas: play the next step's episodes while this one trains (0: synchronous)")
    own.add_argument("--partial-rollouts", action="store_true",
                     help="with --replicas: land each push in the middle of running turns (pause in place)")
    ap = add_flags(ap)
    ap.set_defaults(steps=30, max_new_tokens=32, n=8, prompts_per_step=8, lr=1e-3, out_dir="rl_runs/multiturn")
    args = vars(ap.parse_args(argv))
    own_args = argparse.Namespace(**{k: args.pop(k) for k in OWN_FLAGS})
    if (own_args.router or own_args.max_staleness or own_args.partial_rollouts) and not own_args.replicas:
        ap.error("--router, --max-staleness and --partial-rollouts need --replicas")
    return own_args, argparse.Namespace(**args)


def main(argv=None) -> list:
    own, args = parse(argv)
    from lookup_task import lookup_model, lookup_tasks, make_lookup_env

    warmup = own.warmup_steps if own.warmup_steps is not None else (150 if args.model in ("tiny", "tiny-moe") else 0)
    servers: list = []

    def on_folder(path: str, rank: int) -> None:
        if own.replicas and rank == 0:
            from grpo_disaggregated import start_servers

            servers.extend(start_servers(path, own.replicas, 1, args.dtype, args.seed, routed=args.routing_replay))

    def model_folder(name: str, seed: int) -> str:
        return lookup_model(name, seed, warmup, own.warmup_right)

    try:
        ds_engine, path, tied, rank, world = build_trainer(args, on_model_folder=on_folder, model_folder=model_folder)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from trainer_bridge.grpo_multiturn import run_grpo_multiturn
    from trainer_bridge.multiturn import MultiTurnRunner

    tokenizer = AutoTokenizer.from_pretrained(path)
    max_turns = own.max_turns or 2 * own.fruits
    tasks = lookup_tasks(own.fruits)
    log, finish = step_logger(args, rank)
    cfg = grpo_config(args, release_memory=not own.replicas, max_staleness=own.max_staleness)
    parser = "hermes"  # the tiny model's template implies it; SmolLM2's ChatML does not name one
    clients, router, target, engine = [], None, None, None
    try:
        if own.replicas:
            from rollout.server import RolloutClient
            from rollout.server.router import launch_router
            from trainer_bridge import DistributedTarget, ReplicaRouter, ReplicaSet

            box = [[s.url for s in servers]]
            dist.broadcast_object_list(box)
            clients = [RolloutClient(u) for u in box[0]]
            for c in clients:
                c.wait_ready(300)
            replicas = ReplicaSet(clients)
            target = DistributedTarget(replicas, master_address="127.0.0.1", group_name="grpo-multiturn",
                                       partial_rollouts=own.partial_rollouts)
            service = ReplicaRouter(replicas)  # what pushes are verified against (every replica)
            if own.router:  # the episodes go through the field's router, each pinned by its routing key
                router = launch_router([c.base_url for c in clients], kind=own.router, policy="manual")
                clients.append(RolloutClient(router.url))
                runner = MultiTurnRunner(clients[-1], tokenizer, max_turns=max_turns, max_total_tokens=2048,
                                         sessions=False, routing_keys=True, tool_call_parser=parser)
            else:  # each episode a session on one replica
                runner = MultiTurnRunner(service, tokenizer, max_turns=max_turns, max_total_tokens=2048,
                                         sessions=not own.no_sessions, tool_call_parser=parser)
        else:
            from rollout import RolloutEngine

            engine = RolloutEngine(path, dtype=args.dtype, tp_size=1, kv_cache_tokens=16384, seed=args.seed,
                                   use_generation_config=False, enable_return_routed_experts=args.routing_replay)
            service = engine
            runner = MultiTurnRunner(engine, tokenizer, max_turns=max_turns, max_total_tokens=2048,
                                     sessions=not own.no_sessions, tool_call_parser=parser)
        logs = run_grpo_multiturn(cfg, ds_engine, service, tasks, make_lookup_env(tokenizer), runner,
                                  tie_word_embeddings=tied, log_fn=log, target=target)
        finish(logs)
        if target is not None:
            target.close()
    finally:
        if engine is not None:
            engine.shutdown()
        if router is not None:
            router.stop()
        for c in clients:
            c.close()
        for s in servers:
            s.stop()
    dist.barrier()
    return logs


if __name__ == "__main__":
    main()
