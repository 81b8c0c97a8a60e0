"""GRPO over whole multi-turn trajectories (``trainer_bridge.multiturn``).

The loop is ``run_grpo``'s (colocated or against servers, pushes, staleness, replicas); what
changes is the sample: a group is ``n`` episodes of one task, each played turn by turn with an
environment; its reward is the episode's; the loss is over the tokens the model sampled (the
trajectory's loss mask), never the environment's; the trainer recomputes those tokens' logprobs in
one forward over the whole trajectory (and replays each turn's sampling masks when sampling was
truncated, with the history before that turn as the penalties' context).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from rollout.sampling_params import SamplingParams
from trainer_bridge.grpo import GRPOConfig, StepLog, _GRPORun, _Rollout, _token_logprobs, resolve_target
from trainer_bridge.multiturn import Environment, MultiTurnRunner, Trajectory
from trainer_bridge.replay import replay_logprobs
from trainer_bridge.serving import RolloutService
from trainer_bridge.targets import WeightTarget


def trajectory_logprobs(logits: torch.Tensor, traj: Trajectory, sampling: SamplingParams, temperature: float,
                        masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(as the loss sees them, unmasked) logprobs of a trajectory's sampled tokens, from ``logits`` [T, V]
    — the rows that produced each of its T output tokens."""
    pos = traj.sampled_positions
    tokens = [traj.output_token_ids[p] for p in pos]
    unmasked = _token_logprobs(logits[pos], tokens, temperature)
    if not masked:
        return unmasked, unmasked
    full = traj.prompt_token_ids + traj.output_token_ids
    plen = len(traj.prompt_token_ids)
    parts = [replay_logprobs(logits[a:b], full[:plen + a], traj.output_token_ids[a:b],
                             [list(m or []) for m in traj.output_token_sampling_mask[a:b]], sampling)
             for a, b in traj.turns]
    return (torch.cat(parts) if parts else unmasked), unmasked


class _MultiTurnRun(_GRPORun):
    def __init__(self, cfg: GRPOConfig, ds_engine, service: RolloutService, tasks: Sequence[Any],
                 make_env: Callable[[Any], Environment], runner: MultiTurnRunner, ref_model,
                 tie_word_embeddings: bool, target: WeightTarget):
        super().__init__(cfg, ds_engine, service, list(tasks), lambda p, c: 0.0, ref_model, tie_word_embeddings,
                         target)
        self.tasks, self.make_env, self.runner = list(tasks), make_env, runner

    def rollout(self, step: int) -> _Rollout:
        cfg = self.cfg
        pick = torch.randperm(len(self.tasks), generator=self.generator)[: cfg.prompts_per_step].tolist()
        spmd = self.engine.tp_size > 1 or self.world == 1  # every rank plays every episode alike
        share = list(range(len(pick))) if spmd else list(range(len(pick)))[self.rank::self.world]
        base = SamplingParams(n=1, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, top_k=cfg.top_k,
                              top_p=cfg.top_p, min_p=cfg.min_p, repetition_penalty=cfg.repetition_penalty)
        envs, params = [], []
        for j in share:
            for k in range(cfg.n):
                envs.append(self.make_env(self.tasks[pick[j]]))
                seed = cfg.seed * 1_000_003 + step * 10_007 + j * cfg.n + k
                params.append(dataclasses.replace(base, seed=seed))
        t0 = time.perf_counter()
        trajs = self.runner.run(envs, params, return_sampling_mask=cfg.masked,
                                session_prefix=f"grpo-{cfg.seed}-{step}-{0 if spmd else self.rank}",
                                return_routed_experts=cfg.routing_replay)
        # the rollout's sampling as the loop reads it: n episodes per task (each episode samples n=1 a turn)
        return _Rollout([self.tasks[i] for i in pick], dataclasses.replace(base, n=cfg.n), trajs,
                        time.perf_counter() - t0)

    def logprobs(self, model, ro: _Rollout, outs: list, replay: bool = True, probes: tuple = (),
                 probe_logits: Optional[list] = None):
        assert not probes, "episodes are not probed (_GRPORun.probe)"
        seqs = [o.prompt_token_ids + o.output_token_ids for o in outs]
        logits = self.forward(model, seqs, [len(o.prompt_token_ids) for o in outs], outs, replay)
        new, unmasked = [], []
        for lg, o in zip(logits, outs):
            a, b = trajectory_logprobs(lg, o, ro.sampling, self.cfg.temperature, self.cfg.masked and replay)
            new.append(a)
            unmasked.append(b)
        engine = [torch.tensor([o.output_logprobs[p] for p in o.sampled_positions]) for o in outs]
        return new, unmasked, engine

    def rewards(self, outs: list) -> torch.Tensor:
        return torch.tensor([o.reward for o in outs], dtype=torch.float32)

    def token_versions(self, out) -> list[str]:
        return out.sampled_weight_versions

    def extra_log(self, outs: list) -> dict:
        return {"turns_mean": sum(len(o.turns) for o in outs) / max(len(outs), 1),
                "finish_reasons": dict(Counter(o.finish_reason for o in outs))}


def run_grpo_multiturn(cfg: GRPOConfig, ds_engine, rollout_engine: RolloutService, tasks: Sequence[Any],
                       make_env: Callable[[Any], Environment], runner: MultiTurnRunner, ref_model=None,
                       tie_word_embeddings: bool = False, log_fn: Optional[Callable[[StepLog], None]] = None,
                       target: Optional[WeightTarget] = None) -> list[StepLog]:
    """GRPO where each step plays ``cfg.n`` episodes of ``cfg.prompts_per_step`` tasks (``make_env(task)``
    builds one episode's environment) through ``runner``; ``cfg.max_new_tokens`` bounds each turn.
    Otherwise as ``run_grpo``: ``rollout_engine`` is what pushes are verified against and memory is
    released on — usually the runner's own service; the runner may instead play through the field's
    router in front of the same replicas (``MultiTurnRunner(..., sessions=False, routing_keys=True)``)."""
    if runner.service is None:
        raise ValueError("run_grpo_multiturn: the runner needs a rollout service to play through")
    if cfg.true_on_policy:
        raise ValueError("run_grpo_multiturn: true_on_policy is not supported for multi-turn episodes yet (their "
                         "logprobs are recomputed with transformers' forward); run without it")
    return _MultiTurnRun(cfg, ds_engine, rollout_engine, tasks, make_env, runner, ref_model, tie_word_embeddings,
                         resolve_target(cfg, rollout_engine, target, "run_grpo_multiturn")).run(log_fn)
