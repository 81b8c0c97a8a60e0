"""GRPO with a colocated rollout engine.

Each step: rollouts with processed logprobs (the behaviour policy) -> rewards -> group-normalised
advantages over the ``n`` samples of a prompt -> the trainer recomputes the same tokens' logprobs
(with top-k / top-p / min-p or penalties on, the engine returns each token's sampling mask and the
trainer replays it, ``trainer_bridge.replay``; otherwise logits / temperature) and reports the
train/rollout mismatch, masked and unmasked -> clipped policy-gradient loss (optional KL to a frozen
reference, optional truncated importance sampling) -> one DeepSpeed step -> the new weights are
pushed into the engine as one transaction whose version is the step. Colocated cycle: release the
engine's KV and weights -> train -> resume weights -> push -> resume KV -> generate.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Optional

import psutil
import torch
import torch.distributed as dist

from trainer_bridge.push import DEFAULT_PUSH_BUCKET_BYTES, push_weights
from trainer_bridge.replay import replay_logprobs
from trainer_bridge.replicas import ReplicaError
from trainer_bridge.targets import ColocatedTarget, WeightTarget

logger = logging.getLogger(__name__)


@dataclass
class GRPOConfig:
    steps: int = 25
    prompts_per_step: int = 8
    n: int = 8
    max_new_tokens: int = 6
    temperature: float = 1.0
    lr: float = 1e-2
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    tis_cap: Optional[float] = None  # truncated importance sampling: weight min(exp(train - rollout), cap)
    top_k: int = -1  # sampling truncation: with any of these on, masks are returned and replayed
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    push_weights: bool = True  # False: the engine keeps the initial weights (a control run)
    release_memory: bool = True  # colocated: free the engine's KV and weights while training
    bucket_bytes: int = DEFAULT_PUSH_BUCKET_BYTES
    push_per_parameter: bool = False  # the baseline most integrations use: one gather + hand-off per parameter
    seed: int = 0
    out_dir: str = "rl_runs/demo"
    verify_push: bool = True  # after each push, read a few weights back from the engine and compare
    # Asynchronous (disaggregated only): the rollout for step k+1 runs while step k trains, with the
    # weights served then; a sample is at most max_staleness versions behind the trainer (0: synchronous).
    max_staleness: int = 0
    stale_policy: str = "keep"  # tokens older than the bound: "drop" (masked out), "keep", "tis" (weighted)


@dataclass
class StepLog:
    step: int
    reward: float
    rollout_tok_s: float
    rollout_s: float
    train_s: float
    sync_s: float
    mismatch_mean: float  # |trainer - engine| logprob of the tokens, as the loss sees it (masked replay if masks)
    mismatch_max: float
    loss: float
    mismatch_unmasked_mean: float = 0.0  # the same without the masks (log_softmax(logits / T))
    mismatch_unmasked_max: float = 0.0
    ratio_mean: float = 1.0  # mean importance ratio exp(trainer - engine), as the loss sees it
    ratio_unmasked_mean: float = 1.0
    ratio_unmasked_out_of_band: float = 0.0  # fraction of tokens whose unmasked ratio is outside [0.9, 1.1]
    engine_released_bytes: int = 0
    rss_peak_mb: float = 0.0
    sync_phases: dict = field(default_factory=dict)
    push_verified: Optional[bool] = None
    max_sample_staleness: int = 0  # trainer version - the oldest token version in this step's samples
    num_mixed_version_samples: int = 0  # samples whose tokens span an update (partial rollouts)
    trainer_wait_s: float = 0.0  # the trainer waiting for rollouts (the long tail idles it)
    step_s: float = 0.0  # wall time of the whole step (the trainer's view)
    replica_events: list = field(default_factory=list)  # replica failures / rejoins during the step (named)
    num_serving_replicas: int = 1  # replicas holding the step's weights at its end


def _generate_share(engine, prompts, sp, rank: int, world: int, masks: bool = False):
    """TP engines span all ranks (every rank calls generate alike); with TP=1 every rank has an
    engine (or a router) of its own and generates its share of the prompts."""
    if engine.tp_size > 1 or world == 1:
        return engine.generate(input_ids=prompts, sampling_params=sp, return_sampling_mask=masks)
    return engine.generate(input_ids=prompts[rank::world], sampling_params=sp, return_sampling_mask=masks)


def _gather_shares(engine, mine, num_prompts: int, n: int, world: int):
    """Every rank's share back into one prompt-major list (a collective: main thread only)."""
    if engine.tp_size > 1 or world == 1:
        return mine
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    return [o for i in range(num_prompts) for o in parts[i % world][(i // world) * n: (i // world + 1) * n]]


def completion_logits(model, seqs: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
    """Per completion, ``model``'s raw logits [T, V] at the positions that produced its T tokens."""
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    return [logits[i, p - 1: len(s) - 1] for i, (s, p) in enumerate(zip(seqs, prompt_lens))]


def _token_logprobs(logits: torch.Tensor, tokens: list[int], temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def sequence_logprobs(model, seqs: list[list[int]], prompt_lens: list[int], temperature: float):
    """Per-token log-probabilities (logits / temperature) of each completion under ``model``."""
    return [_token_logprobs(lg, s[p:], temperature)
            for lg, s, p in zip(completion_logits(model, seqs, prompt_lens), seqs, prompt_lens)]


def verify_pushed(stats, rollout_engine) -> bool:
    """The engine now holds what was pushed: the first values of the first, middle and last
    parameters (recorded by ``push_weights`` while they were gathered, in the engine's dtype)
    read back from the engine (every serving replica, through a router) are exactly equal."""
    ok = bool(stats.samples)
    for name, want in stats.samples.items():
        got = torch.tensor(rollout_engine.get_weights_by_name(name, want.numel()))
        ok &= bool(torch.equal(got, want))
    return ok


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def run_grpo(cfg: GRPOConfig, ds_engine, rollout_engine, prompts: list[list[int]],
             reward_fn: Callable[[list[int], list[int]], float], ref_model=None,
             tie_word_embeddings: bool = False, log_fn: Optional[Callable[[StepLog], None]] = None,
             target: Optional[WeightTarget] = None) -> list[StepLog]:
    """``rollout_engine``: an in-process engine (colocated; the default target pushes into it) or a
    ``trainer_bridge.router.ReplicaRouter`` over rollout servers (pass their ``DistributedTarget``)."""
    from rollout import SamplingParams

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    target = target or ColocatedTarget(rollout_engine)
    logs: list[StepLog] = []
    g = torch.Generator().manual_seed(cfg.seed)
    masked = cfg.top_k > 0 or cfg.top_p < 1 or cfg.min_p > 0 or cfg.repetition_penalty != 1.0
    if cfg.max_staleness and (cfg.release_memory or isinstance(target, ColocatedTarget)):
        raise ValueError("asynchronous rollouts need their own devices: use a disaggregated target, no release")
    if cfg.stale_policy not in ("drop", "keep", "tis"):
        raise ValueError(f"stale_policy={cfg.stale_policy!r}: use drop, keep or tis")

    def rollout(step: int):
        """The batch of ``step`` (every rank calls generate with the same arguments: SPMD)."""
        pick = torch.randperm(len(prompts), generator=g)[: cfg.prompts_per_step].tolist()
        batch_prompts = [prompts[i] for i in pick]
        sp = SamplingParams(n=cfg.n, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                            seed=cfg.seed * 1_000_003 + step * 10_007, ignore_eos=True, top_k=cfg.top_k,
                            top_p=cfg.top_p, min_p=cfg.min_p, repetition_penalty=cfg.repetition_penalty)
        t0 = time.perf_counter()
        mine = _generate_share(rollout_engine, batch_prompts, sp, rank, world, masks=masked)
        return batch_prompts, sp, mine, time.perf_counter() - t0

    events: list[str] = []  # replica failures and rejoins of the current step

    def push(version: str):
        """One push; a replica failing mid-push is dropped (named), the group rebuilt, the push redone."""
        for attempt in range(8):
            try:
                return push_weights(ds_engine, target, version=version, bucket_bytes=cfg.bucket_bytes,
                                    per_parameter=cfg.push_per_parameter, tie_word_embeddings=tie_word_embeddings)
            except ReplicaError as err:
                events.append(f"push {version}: {err}")
                logger.warning("weight push %s failed: %s; the rest carry on", version, err)
                if attempt == 7 or not target.heal():  # nothing left to rebuild: give up
                    raise
        raise AssertionError("unreachable")

    # asynchronous: up to max_staleness batches are generated ahead, each with the weights served when it starts
    ahead = ThreadPoolExecutor(1) if cfg.max_staleness else None
    queued = deque(ahead.submit(rollout, k) for k in range(min(cfg.max_staleness, cfg.steps))) if ahead else deque()
    seen_failures = 0
    for step in range(cfg.steps):
        t_step = time.perf_counter()
        if cfg.push_weights and target.heal():  # e.g. a replica came back: it gets the current weights
            events.append(f"step {step + 1}: the weight group was rebuilt; pushing step-{step} again")
            push(f"step-{step}")
        t_wait = time.perf_counter()
        if ahead is not None:
            if step + cfg.max_staleness < cfg.steps:
                queued.append(ahead.submit(rollout, step + cfg.max_staleness))
            batch_prompts, sp, mine_outs, rollout_s = queued.popleft().result()
        else:
            batch_prompts, sp, mine_outs, rollout_s = rollout(step)
        outs = _gather_shares(rollout_engine, mine_outs, len(batch_prompts), sp.n, world)
        trainer_wait = time.perf_counter() - t_wait
        events.extend(str(e) for e in getattr(rollout_engine, "failures", [])[seen_failures:])
        seen_failures = len(getattr(rollout_engine, "failures", []))
        n_tok = sum(len(o.output_token_ids) for o in outs)
        # the trainer is at version `step` (pushes done); a token sampled under "step-k" is step - k behind
        ages = [[step - _version_step(v) for v in o.output_weight_versions] for o in outs]
        rewards = torch.tensor([reward_fn(o.prompt_token_ids, o.output_token_ids) for o in outs])
        grouped = rewards.view(len(batch_prompts), cfg.n)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
        # ---- train (data parallel: each rank takes its slice of the samples)
        released = 0
        if cfg.release_memory:
            released = rollout_engine.release_memory_occupation(["kv_cache", "weights"])["freed_bytes"]
        peak = rss_mb()
        t1 = time.perf_counter()
        mine = list(range(rank, len(outs), world))
        seqs = [outs[i].prompt_token_ids + outs[i].output_token_ids for i in mine]
        plens = [len(outs[i].prompt_token_ids) for i in mine]
        logits = completion_logits(ds_engine, seqs, plens)
        unmasked_lp = [_token_logprobs(lg, outs[i].output_token_ids, cfg.temperature) for lg, i in zip(logits, mine)]
        new_lp = [replay_logprobs(lg, outs[i].prompt_token_ids, outs[i].output_token_ids,
                                  outs[i].output_token_sampling_mask, sp) for lg, i in zip(logits, mine)] \
            if masked else unmasked_lp
        engine_lp = [torch.tensor(outs[i].output_logprobs) for i in mine]
        diffs = torch.cat([(a.detach() - b).abs() for a, b in zip(new_lp, engine_lp)])
        udiffs = torch.cat([(a.detach() - b) for a, b in zip(unmasked_lp, engine_lp)])
        ratios = torch.cat([torch.exp(a.detach() - b) for a, b in zip(new_lp, engine_lp)])
        # sum, count, sum |unmasked|, sum ratio, sum unmasked ratio, unmasked out of band | max, max unmasked
        stats = torch.tensor([float(diffs.sum()), float(diffs.numel()), float(udiffs.abs().sum()), float(ratios.sum()),
                              float(udiffs.exp().sum()), float(((udiffs.exp() - 1).abs() > 0.1).sum()),
                              float(diffs.max()), float(udiffs.abs().max())])
        losses = []
        for lp, old, i in zip(new_lp, engine_lp, mine):
            ratio = torch.exp(lp - old)
            a = adv[i]
            pg = -torch.min(ratio * a, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * a)
            if cfg.tis_cap is not None:
                pg = pg * torch.exp(lp.detach() - old).clamp(max=cfg.tis_cap)
            stale = torch.tensor([age > cfg.max_staleness for age in ages[i]])
            if stale.any() and cfg.stale_policy == "drop":
                pg = pg.masked_fill(stale, 0.0)
            elif stale.any() and cfg.stale_policy == "tis":
                pg = torch.where(stale, pg * torch.exp(lp.detach() - old).clamp(max=cfg.tis_cap or 2.0), pg)
            losses.append(pg.mean())
        loss = torch.stack(losses).mean()
        if cfg.kl_coef and ref_model is not None:
            with torch.no_grad():
                ref_lp = sequence_logprobs(ref_model, seqs, plens, cfg.temperature)
            kl = torch.stack([(torch.exp(r - lp) - (r - lp) - 1).mean() for r, lp in zip(ref_lp, new_lp)]).mean()
            loss = loss + cfg.kl_coef * kl
        ds_engine.backward(loss)
        ds_engine.step()
        peak = max(peak, rss_mb())
        train_s = time.perf_counter() - t1
        # ---- sync
        t2 = time.perf_counter()
        if cfg.release_memory:
            rollout_engine.resume_memory_occupation(["weights"])
        phases, verified = {}, None
        if cfg.push_weights:
            pushed = push(f"step-{step + 1}")
            if not pushed.result.success:
                raise RuntimeError(f"weight push failed at step {step + 1}: {pushed.result.message}")
            phases = pushed.phases
            if cfg.verify_push:
                verified = verify_pushed(pushed, rollout_engine)
        elif cfg.release_memory:
            raise ValueError("release_memory without push_weights would leave the engine without weights")
        if cfg.release_memory:
            rollout_engine.resume_memory_occupation(["kv_cache"])
        sync_s = time.perf_counter() - t2
        peak = max(peak, rss_mb())
        if dist.is_initialized():
            dist.all_reduce(stats[:6])
            dist.all_reduce(stats[6:], op=dist.ReduceOp.MAX)
        events.extend(target.take_events())
        count = float(stats[1])
        log = StepLog(step=step + 1, reward=float(rewards.mean()), rollout_tok_s=n_tok / rollout_s,
                      rollout_s=rollout_s, train_s=train_s, sync_s=sync_s,
                      mismatch_mean=float(stats[0]) / count, mismatch_max=float(stats[6]), loss=float(loss.detach()),
                      mismatch_unmasked_mean=float(stats[2]) / count, mismatch_unmasked_max=float(stats[7]),
                      ratio_mean=float(stats[3]) / count, ratio_unmasked_mean=float(stats[4]) / count,
                      ratio_unmasked_out_of_band=float(stats[5]) / count,
                      engine_released_bytes=released, rss_peak_mb=peak, sync_phases=phases, push_verified=verified,
                      max_sample_staleness=max((a for row in ages for a in row), default=0),
                      num_mixed_version_samples=sum(1 for row in ages if len(set(row)) > 1),
                      trainer_wait_s=trainer_wait, replica_events=list(events), step_s=time.perf_counter() - t_step,
                      num_serving_replicas=len(rollout_engine.replicas.serving()) if hasattr(
                          rollout_engine, "replicas") else 1)
        events.clear()
        logs.append(log)
        if log_fn is not None and rank == 0:
            log_fn(log)
    if ahead is not None:
        ahead.shutdown(wait=True)
    return logs


def _version_step(version: str) -> int:
    """The step of a weight version this loop published ("step-k"; the initial weights are step 0)."""
    return int(version.rsplit("-", 1)[1]) if version.startswith("step-") else 0


def write_logs(logs: list[StepLog], out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "steps.json"), "w") as f:
        json.dump([asdict(x) for x in logs], f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([x.step for x in logs], [x.reward for x in logs], marker="o")
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1)
    ax.set_title("GRPO reward (colocated rollout-worker)")
    fig.tight_layout()
    path = os.path.join(out_dir, "reward_curve.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
