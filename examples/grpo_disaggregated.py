"""GRPO with disaggregated rollout: DeepSpeed trains in this job while rollout servers (engine
replicas in their own processes — on GPUs, their own devices or hosts) generate. One trainer feeds
every replica: prompts are routed by load (all samples of a prompt on one replica), and each step's
weights are broadcast once over one weight-update group every replica joins, then committed.

CPU, the embedded tiny model, two local replicas started by this script, one or two trainer ranks
(ZeRO-3 gathers on every trainer rank; rank 0 broadcasts to the replicas; each rank routes its share
of the prompts):
    python -m torch.distributed.run --nproc_per_node 1 examples/grpo_disaggregated.py --replicas 2
    python -m torch.distributed.run --nproc_per_node 2 examples/grpo_disaggregated.py --replicas 2
Against servers already running (``rollout serve --model-path ... --port ...``):
    python -m torch.distributed.run --nproc_per_node 1 examples/grpo_disaggregated.py \\
        --engine-url http://host1:30000 --engine-url http://host2:30000 --master-address <this host>
LoRA (``--lora RANK``): the trainer trains a peft adapter and each step broadcasts only its tensors
(``/load_lora_adapter_from_distributed``, miles' route), loaded on every replica as a new version
of the adapter the rollouts run on; the base weights never move.
Synchronous (staleness 0): every rollout uses the weights of the step before it; ``--max-staleness 1``
generates the next step's rollouts while this one trains. A replica that dies is named in the step
log and dropped; the others carry on, and once it answers again (restarted at its URL) it rejoins
with a fresh weight group and the current weights.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import rollout  # noqa: E402,F401  first: its OpenMP defaults must be set before torch loads (rollout.openmp)
from trainer_bridge.grpo_setup import add_flags, build_trainer, grpo_config, step_logger  # noqa: E402

OWN_FLAGS = ("replicas", "engine_url", "server_tp_size", "master_address", "group_timeout", "partial_rollouts",
             "max_staleness", "stale_policy")


def parse(argv=None):
    """(this script's own flags, the flags shared with the colocated loop), from one parser: --help
    shows this script's description and every flag."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    own = ap.add_argument_group("disaggregated")
    own.add_argument("--replicas", type=int, default=2, help="local rollout servers to start (without --engine-url)")
    own.add_argument("--engine-url", action="append", default=None, help="a running rollout server (repeatable)")
    own.add_argument("--server-tp-size", type=int, default=1, help="TP size of each local server")
    own.add_argument("--master-address", default="127.0.0.1", help="this trainer's address, as the servers reach it")
    own.add_argument("--group-timeout", type=float, default=60.0,
                     help="seconds before a weight group gives up on a replica that stopped answering")
    own.add_argument("--partial-rollouts", action="store_true",
                     help="land each push in the middle of running rollouts (pause in place) instead of after them")
    own.add_argument("--max-staleness", type=int, default=0,
                     help="generate up to this many steps ahead with older weights (0: synchronous)")
    own.add_argument("--stale-policy", default="keep", choices=["drop", "keep", "tis"],
                     help="tokens older than --max-staleness: drop them from the loss, keep them, or weight them")
    args = vars(add_flags(ap).parse_args(argv))
    return (argparse.Namespace(**{k: args.pop(k) for k in OWN_FLAGS}), argparse.Namespace(**args))


def start_servers(path: str, n: int, tp: int, dtype: str, seed: int, on_policy: bool = False,
                  routed: bool = False) -> list:
    """``n`` local ``rollout serve`` processes on free loopback ports, one thread each on CPU (not waited for);
    ``on_policy``: with SGLang's deterministic-inference flag (the batch-invariant mode); ``routed``: recording
    each token's experts (routing replay)."""
    from rollout.server import launch_server

    extra = (["--enable-deterministic-inference"] if on_policy else []) + \
        (["--enable-return-routed-experts"] if routed else [])
    # --max-top-logprobs-num -1: the trainer's full-distribution check asks for the whole vocabulary
    return [launch_server(path, "--dtype", dtype, "--tp-size", str(tp), "--kv-cache-tokens", "4096", "--seed",
                          str(seed), "--no-use-generation-config", "--max-top-logprobs-num", "-1", *extra,
                          num_threads=1, ready_timeout_s=None)
            for _ in range(n)]


def served_versions(replicas, lora_name):
    """Each replica's weight version; with LoRA, the version of the adapter it serves (None: down)."""
    from trainer_bridge import ReplicaRouter

    if lora_name is None:
        return ReplicaRouter(replicas).get_weight_versions()
    return [next((a["weight_version"] for a in c.get_server_info()["lora_adapters"]
                  if a["name"] == lora_name and a["current"]), None) for c in replicas.replicas]


def main(argv=None) -> list:
    own, args = parse(argv)
    if args.true_on_policy and own.server_tp_size != 1:
        raise SystemExit(f"--true-on-policy needs servers at TP=1 (got --server-tp-size {own.server_tp_size})")
    servers: list = []  # the local replicas rank 0 starts

    def start_local_replicas(path: str, rank: int) -> None:  # they come up while the trainer loads
        if not own.engine_url and rank == 0:
            servers.extend(start_servers(path, own.replicas, own.server_tp_size, args.dtype, args.seed,
                                         args.true_on_policy, args.routing_replay))

    try:
        ds_engine, path, tied, rank, world = build_trainer(args, on_model_folder=start_local_replicas)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    import torch.distributed as dist
    from parity_task import parity_task

    from rollout.models import ModelConfig
    from rollout.server import RolloutClient
    from trainer_bridge import DistributedTarget, ReplicaRouter, ReplicaSet
    from trainer_bridge.grpo import run_grpo
    from trainer_bridge.serving import RolloutService

    urls = own.engine_url
    if not urls:  # rank 0 started the local replicas; every trainer rank reaches them by URL
        box = [[s.url for s in servers]]
        dist.broadcast_object_list(box)
        urls = box[0]
    clients = [RolloutClient(u) for u in urls]
    try:
        for c in clients:
            c.wait_ready(300)
        replicas = ReplicaSet(clients)  # which replicas serve the current weights, shared by router and target
        # each trainer rank routes its share of the prompts; one server is a rollout service by itself
        service: RolloutService = ReplicaRouter(replicas) if len(clients) > 1 else clients[0]
        target = DistributedTarget(replicas, master_address=own.master_address, group_name="grpo",
                                   partial_rollouts=own.partial_rollouts, timeout_s=own.group_timeout)
        prompts, reward = parity_task(ModelConfig.from_pretrained(path).vocab_size)
        log, finish = step_logger(args, rank)
        cfg = grpo_config(args, release_memory=False, max_staleness=own.max_staleness, stale_policy=own.stale_policy)
        logs = run_grpo(cfg, ds_engine, service, prompts, reward,
                        tie_word_embeddings=tied, log_fn=log, target=target)
        finish(logs)
        if rank == 0:
            print(f"rollout service: {type(service).__name__}; replica versions:", served_versions(replicas, cfg.lora_name),
                  flush=True)
        target.close()
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.stop()
    dist.barrier()
    return logs


if __name__ == "__main__":
    main()
