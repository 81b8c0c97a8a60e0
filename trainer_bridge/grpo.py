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
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

import psutil
import torch
import torch.distributed as dist

from rollout.engine.engine import RolloutEngine
from rollout.outputs import RolloutOutput
from rollout.sampling_params import SamplingParams
from rollout.server.client import RolloutServerError
from trainer_bridge.lora import push_adapter
from trainer_bridge.on_policy import engine_logprobs
from trainer_bridge.push import DEFAULT_PUSH_BUCKET_BYTES, PushStats, push_delta, push_weights, unwrapped
from trainer_bridge.replay import replay_logprobs
from trainer_bridge.replicas import ReplicaError
from trainer_bridge.routing_replay import replay_rows, replaying
from trainer_bridge.serving import RolloutService
from trainer_bridge.targets import ColocatedTarget, WeightTarget
from weight_sync.delta import DeltaTracker

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
    # a control arm inside the run: the rollouts of the first control_steps steps run on the initial weights
    # (nothing is pushed until then: their rewards stay flat, their samples one version older each step)
    control_steps: int = 0
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
    # LoRA: the trainer's model is a peft model; rollouts run on this adapter and each push moves only its
    # tensors (a new version of it); the base weights never move (and are never released)
    lora_name: Optional[str] = None
    # true on-policy: the trainer's logprobs computed as the engine computes them in its batch-invariant mode
    # (trainer_bridge.on_policy), so they equal the engine's bit for bit; the engines must run deterministic=True
    # at TP=1
    true_on_policy: bool = False
    # the full-distribution check: per step and rank, the engine's whole next-token distribution at the first
    # DIST_CHECK_POSITIONS positions of this many of its samples against the trainer's (0: off; synchronous only)
    dist_check_samples: int = 1
    # rollout routing replay (R3; mixture-of-experts models): the rollouts return each token's experts
    # (return_routed_experts) and the trainer's forward routes every token to them (trainer_bridge.routing_replay)
    routing_replay: bool = False
    # delta weight sync (weight_sync.delta): after the first full push each push sends only the changed
    # elements against the last published version (a full push where the engine refuses the base); the
    # colocated engine keeps its weights resident while the trainer trains (they are the next delta's base)
    delta_sync: bool = False
    # with delta_sync: a full push (an anchor, the next deltas' base) after this many deltas (0: only where one
    # is refused)
    delta_anchor_every: int = 0

    def __post_init__(self) -> None:
        """Every option checked when the config is built, before any engine or trainer step runs."""
        counts = {"steps": self.steps, "prompts_per_step": self.prompts_per_step, "n": self.n,
                  "max_new_tokens": self.max_new_tokens, "bucket_bytes": self.bucket_bytes}
        for name, value in counts.items():
            if value < 1:
                raise ValueError(f"GRPOConfig.{name}={value}: must be >= 1")
        if self.temperature <= 0:
            raise ValueError(f"GRPOConfig.temperature={self.temperature}: must be > 0 (the loss divides by it)")
        if not 0 <= self.clip_eps < 1:
            raise ValueError(f"GRPOConfig.clip_eps={self.clip_eps}: use 0 <= clip_eps < 1")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"GRPOConfig.tis_cap={self.tis_cap}: must be > 0 (or None: off)")
        if self.control_steps < 0 or self.control_steps >= self.steps:
            raise ValueError(f"GRPOConfig.control_steps={self.control_steps}: use 0 <= control_steps < steps")
        if self.max_staleness < 0:
            raise ValueError(f"GRPOConfig.max_staleness={self.max_staleness}: must be >= 0")
        if self.stale_policy not in ("drop", "keep", "tis"):
            raise ValueError(f"GRPOConfig.stale_policy={self.stale_policy!r}: use drop, keep or tis")
        if self.release_memory and not self.push_weights and self.lora_name is None:
            raise ValueError("GRPOConfig: release_memory without push_weights would leave the engine without weights")
        if self.dist_check_samples < 0:
            raise ValueError(f"GRPOConfig.dist_check_samples={self.dist_check_samples}: must be >= 0 (0: off)")
        if self.true_on_policy and self.masked:
            raise ValueError("GRPOConfig: true_on_policy replays temperature sampling only; top-k / top-p / min-p / "
                             "repetition penalty masks are replayed in torch (drop them or the flag)")
        if self.true_on_policy and self.lora_name is not None:
            raise ValueError("GRPOConfig: true_on_policy trains the full weights; it does not take a LoRA adapter")
        if self.routing_replay and self.true_on_policy:
            raise ValueError("GRPOConfig: true_on_policy runs dense models; routing_replay is for mixtures of experts")
        if self.delta_sync and (self.lora_name is not None or not self.push_weights):
            raise ValueError("GRPOConfig: delta_sync sends the full weights' changes; a LoRA run pushes its adapter "
                             "alone, a run without pushes nothing (drop one of them)")
        if self.delta_anchor_every < 0 or (self.delta_anchor_every and not self.delta_sync):
            raise ValueError("GRPOConfig: delta_anchor_every is a count of deltas (>= 0) and needs delta_sync")
        if self.max_staleness and self.release_memory:
            raise ValueError("GRPOConfig: asynchronous rollouts (max_staleness > 0) need engines on their own "
                             "devices: set release_memory=False")

    @property
    def masked(self) -> bool:
        """Sampling truncated or penalised: the engine returns masks and the trainer replays them."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0 or self.repetition_penalty != 1.0


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
    # the full-distribution check (GRPOConfig.dist_check_samples): over the probed positions and the whole
    # vocabulary, the largest |engine - trainer| log-probability of logits / T and the mean KL(engine || trainer)
    dist_max_abs_diff: float = 0.0
    dist_kl_mean: float = 0.0
    dist_positions: int = 0
    turns_mean: float = 0.0  # multi-turn: assistant turns per episode
    finish_reasons: dict = field(default_factory=dict)  # multi-turn: episodes per finish reason
    # routing replay: positions (this rank's samples) whose experts the trainer's forward was forced to
    replayed_tokens: int = 0


def _generate_share(engine: RolloutService, prompts: list[list[int]], sp: SamplingParams, rank: int, world: int,
                    masks: bool = False, lora_path: Optional[str] = None, routed: bool = False) -> list[RolloutOutput]:
    """TP engines span all ranks (every rank calls generate alike); with TP=1 every rank has an
    engine (or a router) of its own and generates its share of the prompts."""
    mine = prompts if engine.tp_size > 1 or world == 1 else prompts[rank::world]
    return engine.generate(input_ids=mine, sampling_params=sp, return_sampling_mask=masks, lora_path=lora_path,
                           return_routed_experts=routed)


def _gather_shares(engine: RolloutService, mine: list[RolloutOutput], num_prompts: int, n: int,
                   world: int) -> list[RolloutOutput]:
    """Every rank's share back into one prompt-major list (a collective: main thread only)."""
    if engine.tp_size > 1 or world == 1:
        return mine
    parts: list[Any] = [None] * world
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


def verify_pushed(stats: PushStats, rollout_engine: RolloutService) -> bool:
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


@dataclass(frozen=True)
class Mismatch:
    """Trainer against engine logprobs of one step's tokens, as sums and maxima over the tokens (one
    rank's, or every rank's after ``reduced()``): ``abs`` as the loss sees them (masked replay when
    masks are on), ``unmasked`` as ``log_softmax(logits / T)`` gives them."""

    abs_sum: float
    count: int
    unmasked_abs_sum: float
    ratio_sum: float  # exp(trainer - engine), as the loss sees it
    unmasked_ratio_sum: float
    unmasked_out_of_band: int  # tokens whose unmasked ratio lies outside [0.9, 1.1]
    abs_max: float
    unmasked_abs_max: float

    @classmethod
    def of(cls, new_lp: list[torch.Tensor], unmasked_lp: list[torch.Tensor], engine_lp: list[torch.Tensor]) -> Mismatch:
        diffs = torch.cat([(a.detach() - b).abs() for a, b in zip(new_lp, engine_lp)])
        udiffs = torch.cat([a.detach() - b for a, b in zip(unmasked_lp, engine_lp)])
        ratios = torch.cat([torch.exp(a.detach() - b) for a, b in zip(new_lp, engine_lp)])
        return cls(abs_sum=float(diffs.sum()), count=diffs.numel(), unmasked_abs_sum=float(udiffs.abs().sum()),
                   ratio_sum=float(ratios.sum()), unmasked_ratio_sum=float(udiffs.exp().sum()),
                   unmasked_out_of_band=int(((udiffs.exp() - 1).abs() > 0.1).sum()),
                   abs_max=float(diffs.max()), unmasked_abs_max=float(udiffs.abs().max()))

    def reduced(self) -> Mismatch:
        """Sums summed and maxima taken over every trainer rank (a collective; itself without a group)."""
        if not dist.is_initialized():
            return self
        sums = torch.tensor([self.abs_sum, self.count, self.unmasked_abs_sum, self.ratio_sum, self.unmasked_ratio_sum,
                             self.unmasked_out_of_band], dtype=torch.float64)
        maxima = torch.tensor([self.abs_max, self.unmasked_abs_max], dtype=torch.float64)
        dist.all_reduce(sums)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        return Mismatch(float(sums[0]), int(sums[1]), float(sums[2]), float(sums[3]), float(sums[4]), int(sums[5]),
                        float(maxima[0]), float(maxima[1]))

    @property
    def mean(self) -> float:
        return self.abs_sum / self.count

    @property
    def unmasked_mean(self) -> float:
        return self.unmasked_abs_sum / self.count

    @property
    def ratio_mean(self) -> float:
        return self.ratio_sum / self.count

    @property
    def unmasked_ratio_mean(self) -> float:
        return self.unmasked_ratio_sum / self.count

    @property
    def unmasked_out_of_band_fraction(self) -> float:
        return self.unmasked_out_of_band / self.count


def grpo_loss(cfg: GRPOConfig, new_lp: list[torch.Tensor], engine_lp: list[torch.Tensor], advantages: torch.Tensor,
              ages: Optional[list[list[int]]] = None, unmasked_lp: Optional[list[torch.Tensor]] = None,
              ref_lp: Optional[list[torch.Tensor]] = None) -> tuple[torch.Tensor, Mismatch]:
    """The clipped policy-gradient loss over this rank's completions and their ``Mismatch``; no
    engine, no trainer, no collective.

    ``new_lp[i]`` the trainer's logprobs of completion i's tokens (with grad), ``engine_lp[i]`` the
    engine's (the behaviour policy), ``advantages[i]`` its group-normalised advantage, ``ages[i]``
    per token how many versions behind the trainer its weights were (``stale_policy`` acts past
    ``max_staleness``), ``unmasked_lp`` the unmasked logprobs for the record (default ``new_lp``),
    ``ref_lp`` a frozen reference's for the KL term (``kl_coef``)."""
    losses = []
    for i, (lp, old) in enumerate(zip(new_lp, engine_lp)):
        ratio = torch.exp(lp - old)
        a = advantages[i]
        pg = -torch.min(ratio * a, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * a)
        if cfg.tis_cap is not None:
            pg = pg * torch.exp(lp.detach() - old).clamp(max=cfg.tis_cap)
        if ages is not None:
            stale = torch.tensor([age > cfg.max_staleness for age in ages[i]], dtype=torch.bool)
            if stale.any() and cfg.stale_policy == "drop":
                pg = pg.masked_fill(stale, 0.0)
            elif stale.any() and cfg.stale_policy == "tis":
                pg = torch.where(stale, pg * torch.exp(lp.detach() - old).clamp(max=cfg.tis_cap or 2.0), pg)
        losses.append(pg.mean())
    loss = torch.stack(losses).mean()
    if cfg.kl_coef and ref_lp is not None:
        kl = torch.stack([(torch.exp(r - lp) - (r - lp) - 1).mean() for r, lp in zip(ref_lp, new_lp)]).mean()
        loss = loss + cfg.kl_coef * kl
    return loss, Mismatch.of(new_lp, unmasked_lp if unmasked_lp is not None else new_lp, engine_lp)


def group_advantages(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """Rewards normalised within each prompt's ``n`` samples (prompt-major), flattened."""
    grouped = rewards.view(-1, n)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()


@dataclass
class _Rollout:
    prompts: list[list[int]]
    sampling: SamplingParams
    outputs: list[Any]  # this rank's share: RolloutOutput (one completion) or Trajectory (an episode)
    seconds: float


DIST_CHECK_POSITIONS = 8  # positions of a probed completion whose whole next-token distribution is compared


@dataclass
class DistProbe:
    """The engine's whole next-token distribution at a completion's first positions: ``engine_lp`` [m, V],
    log softmax(logits / T) as the engine reports it (``input_top_logprobs`` over the whole vocabulary) for
    the m positions that produced ``seq[prompt_len:]``."""

    seq: list[int]
    prompt_len: int
    engine_lp: torch.Tensor


@dataclass(frozen=True)
class DistCheck:
    """One rank's (or every rank's, ``reduced()``) full-distribution check of a step."""

    max_abs: float = 0.0
    kl_sum: float = 0.0
    positions: int = 0

    @classmethod
    def of(cls, probes: list[DistProbe], trainer_logits: list[torch.Tensor], temperature: float) -> DistCheck:
        max_abs, kl, n = 0.0, 0.0, 0
        for probe, logits in zip(probes, trainer_logits):
            e = probe.engine_lp
            t = torch.log_softmax(logits.detach().float() / torch.full((e.shape[0], 1), temperature), dim=-1)
            seen = torch.isfinite(e)  # every id the engine reported (all of them: top_logprobs_num = vocab)
            max_abs = max(max_abs, float((e - t).abs()[seen].max()))
            kl += float(torch.where(seen, e.exp() * (e - t), torch.zeros(())).sum())
            n += e.shape[0]
        return cls(max_abs, kl, n)

    def reduced(self) -> DistCheck:
        if not dist.is_initialized():
            return self
        sums = torch.tensor([self.kl_sum, self.positions], dtype=torch.float64)
        top = torch.tensor([self.max_abs], dtype=torch.float64)
        dist.all_reduce(sums)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        return DistCheck(float(top[0]), float(sums[0]), int(sums[1]))

    @property
    def kl_mean(self) -> float:
        return self.kl_sum / self.positions if self.positions else 0.0


class _GRPORun:
    """One ``run_grpo`` call: its state, and a method per part of a step."""

    def __init__(self, cfg: GRPOConfig, ds_engine, rollout_engine: RolloutService, prompts: list[list[int]],
                 reward_fn: Callable[[list[int], list[int]], float], ref_model, tie_word_embeddings: bool,
                 target: WeightTarget):
        self.cfg, self.ds_engine, self.engine, self.prompts = cfg, ds_engine, rollout_engine, prompts
        self.reward_fn, self.ref_model, self.tie = reward_fn, ref_model, tie_word_embeddings
        self.target = target
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.events: list[str] = []  # replica failures and rejoins of the current step
        self.dist_check = DistCheck()  # the last step's full-distribution check (this rank's)
        policy: Any = unwrapped(ds_engine)
        self.vocab = int(policy.config.vocab_size)  # the full-distribution check's width
        self.replayed_tokens = 0  # the step's routing-replay count (forward)
        # the last published weights (delta sync)
        self.tracker = DeltaTracker(anchor_every=cfg.delta_anchor_every) if cfg.delta_sync else None
        if cfg.delta_sync and type(target).push_delta is WeightTarget.push_delta:
            raise ValueError(f"GRPOConfig.delta_sync: {type(target).__name__} takes no delta pushes (colocated "
                             "engines and the weight group do); run without --delta-sync")

    def rollout(self, step: int) -> _Rollout:
        """The batch of ``step`` (every rank calls generate with the same arguments: SPMD)."""
        cfg = self.cfg
        pick = torch.randperm(len(self.prompts), generator=self.generator)[: cfg.prompts_per_step].tolist()
        batch_prompts = [self.prompts[i] for i in pick]
        sp = SamplingParams(n=cfg.n, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                            seed=cfg.seed * 1_000_003 + step * 10_007, ignore_eos=True, top_k=cfg.top_k,
                            top_p=cfg.top_p, min_p=cfg.min_p, repetition_penalty=cfg.repetition_penalty)
        t0 = time.perf_counter()
        mine = _generate_share(self.engine, batch_prompts, sp, self.rank, self.world, masks=cfg.masked,
                               lora_path=cfg.lora_name, routed=cfg.routing_replay)
        return _Rollout(batch_prompts, sp, mine, time.perf_counter() - t0)

    def push(self, version: str):
        """One push; a replica failing mid-push is dropped (named), the group rebuilt, the push redone."""
        for attempt in range(8):
            try:
                if self.tracker is not None:
                    stats = push_delta(self.ds_engine, self.target, version, self.tracker, self.cfg.bucket_bytes,
                                       tie_word_embeddings=self.tie)
                    if stats.phases.get("fell_back"):  # an engine held another base (one that missed pushes)
                        self.events.append(f"push {version}: a delta was refused ({stats.phases['refused']}); "
                                           "pushed in full")
                    elif stats.phases.get("caught_up"):  # others took it: the one behind got it in full, alone
                        self.events.append(f"push {version}: a delta was refused ({stats.phases['caught_up']}); "
                                           "pushed in full to that replica alone")
                    return stats
                return push_weights(self.ds_engine, self.target, version=version, bucket_bytes=self.cfg.bucket_bytes,
                                    per_parameter=self.cfg.push_per_parameter, tie_word_embeddings=self.tie)
            except ReplicaError as err:
                self.events.append(f"push {version}: {err}")
                logger.warning("weight push %s failed: %s; the rest carry on", version, err)
                if attempt == 7 or not self.target.heal():  # nothing left to rebuild: give up
                    raise
        raise AssertionError("unreachable")

    def pushes_after(self, step: int) -> bool:
        """Whether the weights trained at 0-based ``step`` are pushed: never in a control run; in a run with a
        control arm of K steps, from step K - 1 on (the rollouts of steps 0 .. K - 1 ran on the initial weights)."""
        return self.cfg.push_weights and step >= self.cfg.control_steps - 1

    def release_engine_memory(self, pushing: bool) -> int:
        """Colocated: the engine's KV cache and weights (LoRA, or a step whose weights are not pushed: the
        KV cache only) freed while the trainer trains; bytes freed."""
        if not self.cfg.release_memory:
            return 0
        return int(self.engine.release_memory_occupation(self._released(pushing)).detail["freed_bytes"])

    def _released(self, pushing: bool) -> list[str]:
        keep = self.cfg.lora_name is not None or not pushing or self.cfg.delta_sync  # (delta sync: the base)
        return ["kv_cache"] if keep else ["kv_cache", "weights"]

    def push_adapter(self, version: str) -> dict:
        """LoRA: the adapter's tensors as a new version of ``cfg.lora_name`` (to a colocated engine, or
        to servers over the weight-update group); the push's phases. A replica failing mid-push is
        dropped (named), the group rebuilt, the push redone."""
        assert self.cfg.lora_name is not None
        for attempt in range(8):
            try:
                pushed = push_adapter(self.ds_engine, self.target, self.cfg.lora_name, version)
                break
            except ReplicaError as err:
                self.events.append(f"adapter push {version}: {err}")
                logger.warning("adapter push %s failed: %s; the rest carry on", version, err)
                if attempt == 7 or not self.target.heal():
                    raise
        if not pushed.result.success:
            raise RuntimeError(f"adapter push {version} failed: {pushed.result.message}")
        return {"gather_s": pushed.gather_s, "load_s": pushed.load_s, "adapter_bytes": pushed.num_bytes}

    def push_current(self, version: str) -> None:
        """The current policy again (to a rebuilt weight group): the adapter, or the full weights."""
        if self.cfg.lora_name is not None:
            self.push_adapter(version)
        else:
            self.push(version)

    def sync_weights(self, step: int, pushing: bool) -> tuple[dict, Optional[bool]]:
        """After a training step: the engine's weights storage back (if released) -> push the new
        weights as version ``step-{step}`` (``pushing``) -> read samples back (``verify_push``) -> the KV
        cache back. Returns the push's phases and whether the samples matched (None: not checked)."""
        cfg = self.cfg
        if "weights" in self._released(pushing) and cfg.release_memory:
            self.engine.resume_memory_occupation(["weights"])
        phases, verified = {}, None
        if pushing and cfg.lora_name is not None:
            phases = self.push_adapter(f"step-{step}")
        elif pushing:
            pushed = self.push(f"step-{step}")
            if not pushed.result.success:
                raise RuntimeError(f"weight push failed at step {step}: {pushed.result.message}")
            phases = pushed.phases
            if cfg.verify_push:
                verified = verify_pushed(pushed, self.engine)
        if cfg.release_memory:
            self.engine.resume_memory_occupation(["kv_cache"])
        return phases, verified

    def probe(self, outs: list) -> list[DistProbe]:
        """The engine's whole next-token distribution at the first positions of ``dist_check_samples`` of this
        rank's training samples (one prefill each: the prompt and those positions' tokens, their
        ``input_top_logprobs`` over the whole vocabulary at the rollout's temperature); empty where the check
        is off, asynchronous (the weights may have moved since) or the samples are episodes."""
        cfg = self.cfg
        if not cfg.dist_check_samples or cfg.max_staleness or not outs \
                or not isinstance(outs[0], RolloutOutput):
            return []

        def picks(rank: int) -> list:
            return [outs[i] for i in range(rank, len(outs), self.world)][: cfg.dist_check_samples]

        spmd = self.engine.tp_size > 1 and self.world > 1  # one engine across the ranks: every rank asks alike
        asked = [o for r in range(self.world) for o in picks(r)] if spmd else picks(self.rank)
        mine = {id(o) for o in picks(self.rank)}
        probes = []
        for o in asked:
            m = min(len(o.output_token_ids), DIST_CHECK_POSITIONS)
            if m == 0:
                continue
            seq, p = o.prompt_token_ids + o.output_token_ids[:m], len(o.prompt_token_ids)
            try:
                got = self.engine.generate(input_ids=[seq], sampling_params=SamplingParams(
                    max_new_tokens=1, temperature=cfg.temperature, seed=0, ignore_eos=True),
                    top_logprobs_num=self.vocab, logprob_start_len=p, lora_path=cfg.lora_name)[0]
            except RolloutServerError as exc:  # a server capping top_logprobs_num: the check off, said once
                logger.warning("the full-distribution check is off for this run: %s (start the servers with "
                               "--max-top-logprobs-num -1)", exc)
                self.cfg = cfg = replace(cfg, dist_check_samples=0)
                return []
            if id(o) not in mine:
                continue
            lp = torch.full((m, self.vocab), float("-inf"))
            for i, row in enumerate(got.input_top_logprobs[-m:]):
                ids, lps = zip(*row)
                lp[i, list(ids)] = torch.tensor(lps, dtype=torch.float32)
            probes.append(DistProbe(seq, p, lp))
        return probes

    def train(self, ro: _Rollout, outs: list, advantages: torch.Tensor,
              ages: list[list[int]], probes: Optional[list[DistProbe]] = None) -> tuple[torch.Tensor, Mismatch]:
        """One DeepSpeed step on this rank's slice of the samples (data parallel); ``ages[i]`` per
        token of sample i, how many versions behind the trainer its weights were. ``probes``: their
        sequences join the forward (no loss), and ``self.dist_check`` is this rank's check of them."""
        cfg = self.cfg
        mine = list(range(self.rank, len(outs), self.world))
        probe_logits: list[torch.Tensor] = []
        new_lp, unmasked_lp, engine_lp = self.logprobs(self.ds_engine, ro, [outs[i] for i in mine],
                                                       probes=tuple(probes or ()), probe_logits=probe_logits)
        self.dist_check = DistCheck.of(probes or [], probe_logits, cfg.temperature)
        ref_lp = None
        if cfg.kl_coef and self.ref_model is not None:
            with torch.no_grad():
                ref_lp = self.logprobs(self.ref_model, ro, [outs[i] for i in mine], replay=False)[1]
        loss, mismatch = grpo_loss(cfg, new_lp, engine_lp, advantages[mine], [ages[i] for i in mine], unmasked_lp,
                                   ref_lp)
        self.ds_engine.backward(loss)
        self.ds_engine.step()
        return loss, mismatch

    def logprobs(self, model, ro: _Rollout, outs: list, replay: bool = True, probes: tuple = (),
                 probe_logits: Optional[list] = None) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Per sample, the trained tokens' logprobs under ``model``: (as the loss sees them — the masks
        replayed when sampling was truncated —, unmasked ``log_softmax(logits / T)``, the engine's).
        ``probes``' sequences ride in the same forward; their raw logits are appended to ``probe_logits``."""
        T = self.cfg.temperature
        seqs = [o.prompt_token_ids + o.output_token_ids for o in outs] + [p.seq for p in probes]
        lens = [len(o.prompt_token_ids) for o in outs] + [p.prompt_len for p in probes]
        engine_lp = [torch.tensor(o.output_logprobs) for o in outs]
        if self.cfg.true_on_policy:  # the engine's own computation: the loss sees the engine's bits
            all_logits: list[torch.Tensor] = []
            new = engine_logprobs(model, seqs, lens, T, logits_out=all_logits if probes else None)
            if probe_logits is not None:
                probe_logits.extend(all_logits[len(outs):])
            return new[: len(outs)], new[: len(outs)], engine_lp
        logits = self.forward(model, seqs, lens, outs, replay)
        if probe_logits is not None:
            probe_logits.extend(logits[len(outs):])
        logits, seqs = logits[: len(outs)], seqs[: len(outs)]
        unmasked = [_token_logprobs(lg, o.output_token_ids, T) for lg, o in zip(logits, outs)]
        new = [replay_logprobs(lg, o.prompt_token_ids, o.output_token_ids, o.output_token_sampling_mask, ro.sampling)
               for lg, o in zip(logits, outs)] if self.cfg.masked and replay else unmasked
        return new, unmasked, engine_lp

    def forward(self, model, seqs: list[list[int]], lens: list[int], outs: list, replay: bool) -> list[torch.Tensor]:
        """``completion_logits`` of ``seqs`` (``outs``' first, probes after them); with routing replay every
        position ``outs`` carry experts for routed to them (counted in the step's ``replayed_tokens``)."""
        if not (self.cfg.routing_replay and replay):
            return completion_logits(model, seqs, lens)
        routed = [o.routed_experts for o in outs] + [None] * (len(seqs) - len(outs))
        rows = replay_rows(routed, [len(s) for s in seqs], max(map(len, seqs)))
        self.replayed_tokens += int((rows[:, :, 0, 0] >= 0).sum())
        with replaying(model, rows):
            return completion_logits(model, seqs, lens)

    def rewards(self, outs: list) -> torch.Tensor:
        return torch.tensor([self.reward_fn(o.prompt_token_ids, o.output_token_ids) for o in outs])

    def token_versions(self, out) -> list[str]:
        """The weight version of every trained token of a sample."""
        return list(out.output_weight_versions)

    def extra_log(self, outs: list) -> dict:
        """Fields of the step's log a kind of rollout adds (multi-turn: turns per episode)."""
        return {}

    def step(self, step: int, ro: _Rollout, trainer_wait: float, t_step: float) -> StepLog:
        """Rewards -> train -> sync of one step whose rollout ``ro`` is in; its log."""
        outs = _gather_shares(self.engine, ro.outputs, len(ro.prompts), ro.sampling.n, self.world)
        self.events.extend(self.engine.take_replica_failures())
        rewards = self.rewards(outs)
        # the trainer is at version `step` (pushes done); a token sampled under "step-k" is step - k behind
        ages = [[step - _version_step(v) for v in self.token_versions(o)] for o in outs]
        pushing = self.pushes_after(step)
        probes = self.probe(outs)  # before the engine's memory is released
        released = self.release_engine_memory(pushing)
        peak = rss_mb()
        t1 = time.perf_counter()
        self.replayed_tokens = 0
        loss, mismatch = self.train(ro, outs, group_advantages(rewards, self.cfg.n), ages, probes)
        peak = max(peak, rss_mb())
        train_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        phases, verified = self.sync_weights(step + 1, pushing)
        sync_s = time.perf_counter() - t2
        peak = max(peak, rss_mb())
        mm = mismatch.reduced()
        dc = self.dist_check.reduced()
        self.events.extend(self.target.take_events())
        log = StepLog(step=step + 1, reward=float(rewards.mean()),
                      rollout_tok_s=sum(len(v) for v in ages) / ro.seconds,
                      rollout_s=ro.seconds, train_s=train_s, sync_s=sync_s, mismatch_mean=mm.mean,
                      mismatch_max=mm.abs_max, loss=float(loss.detach()), mismatch_unmasked_mean=mm.unmasked_mean,
                      mismatch_unmasked_max=mm.unmasked_abs_max, ratio_mean=mm.ratio_mean,
                      ratio_unmasked_mean=mm.unmasked_ratio_mean,
                      ratio_unmasked_out_of_band=mm.unmasked_out_of_band_fraction, engine_released_bytes=released,
                      rss_peak_mb=peak, sync_phases=phases, push_verified=verified,
                      max_sample_staleness=max((a for row in ages for a in row), default=0),
                      num_mixed_version_samples=sum(1 for row in ages if len(set(row)) > 1),
                      trainer_wait_s=trainer_wait, replica_events=list(self.events),
                      step_s=time.perf_counter() - t_step,
                      num_serving_replicas=self.engine.serving_replicas(), dist_max_abs_diff=dc.max_abs,
                      dist_kl_mean=dc.kl_mean, dist_positions=dc.positions, replayed_tokens=self.replayed_tokens,
                      **self.extra_log(outs))
        self.events.clear()
        return log

    def run(self, log_fn: Optional[Callable[[StepLog], None]]) -> list[StepLog]:
        cfg = self.cfg
        logs: list[StepLog] = []
        # asynchronous: up to max_staleness batches are generated ahead, each with the weights served when it starts
        ahead = ThreadPoolExecutor(1) if cfg.max_staleness else None
        queued = deque(ahead.submit(self.rollout, k) for k in range(min(cfg.max_staleness, cfg.steps))) \
            if ahead else deque()
        if cfg.lora_name is not None:  # the adapter the rollouts run on (B = 0 at first: the base model)
            self.push_adapter("step-0")
        try:
            for step in range(cfg.steps):
                t_step = time.perf_counter()
                if self.pushes_after(step) and self.target.heal():  # e.g. a replica came back: it gets the current weights
                    self.events.append(f"step {step + 1}: the weight group was rebuilt; pushing step-{step} again")
                    self.push_current(f"step-{step}")
                t_wait = time.perf_counter()
                if ahead is not None:
                    if step + cfg.max_staleness < cfg.steps:
                        queued.append(ahead.submit(self.rollout, step + cfg.max_staleness))
                    ro = queued.popleft().result()
                else:
                    ro = self.rollout(step)
                log = self.step(step, ro, time.perf_counter() - t_wait, t_step)
                logs.append(log)
                if log_fn is not None and self.rank == 0:
                    log_fn(log)
        finally:
            if ahead is not None:
                ahead.shutdown(wait=True)
        return logs


def run_grpo(cfg: GRPOConfig, ds_engine, rollout_engine: RolloutService, prompts: list[list[int]],
             reward_fn: Callable[[list[int], list[int]], float], ref_model=None,
             tie_word_embeddings: bool = False, log_fn: Optional[Callable[[StepLog], None]] = None,
             target: Optional[WeightTarget] = None) -> list[StepLog]:
    """``rollout_engine``: an in-process engine (colocated; the default target pushes into it) or a
    ``trainer_bridge.router.ReplicaRouter`` over rollout servers (pass their ``DistributedTarget``)."""
    return _GRPORun(cfg, ds_engine, rollout_engine, prompts, reward_fn, ref_model, tie_word_embeddings,
                    resolve_target(cfg, rollout_engine, target, "run_grpo")).run(log_fn)


def resolve_target(cfg: GRPOConfig, rollout_engine: RolloutService, target: Optional[WeightTarget],
                   caller: str) -> WeightTarget:
    """The loop's weight target: the one given, or the in-process engine itself (colocated)."""
    if target is None:
        if not isinstance(rollout_engine, RolloutEngine):
            raise ValueError(f"{caller}: a rollout service other than an in-process engine needs its target "
                             "(a DistributedTarget over its replicas)")
        target = ColocatedTarget(rollout_engine)
    if cfg.max_staleness and isinstance(target, ColocatedTarget):
        raise ValueError("asynchronous rollouts need their own devices: use a disaggregated target")
    return target


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
