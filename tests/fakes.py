"""Public fakes for tests that need no engine: a worker for the scheduler and the engine loop (``FakeWorker``), a
replica for the router and the trainer side (``FakeReplica``: answers like a server) and a weight
target for pushes (``FakeTarget``: keeps what it is pushed). Everything around them is the real code."""

from __future__ import annotations

import time
from typing import Optional

import torch

from rollout.batch import GenerationBatchResult, ModelWorkerBatch
from rollout.outputs import RolloutOutput, WeightResult
from trainer_bridge.targets import WeightTarget
from weight_sync.bucket import BucketPool


class FakeWorker:
    """Returns token ``next_token`` for every sample row; records every batch it was given. For the
    engine loop's tests, a step can take ``step_s`` (so requests are running while commands arrive)
    and the next ``fail_steps`` steps raise, as a forward that failed."""

    def __init__(self, num_blocks: int, next_token: int = 7, context_len: int = 1000, step_s: float = 0.0):
        self.num_kv_blocks = num_blocks
        self.context_len = self.max_req_len = context_len
        self.next_token = next_token
        self.step_s = step_s
        self.fail_steps = 0
        self.batches: list[ModelWorkerBatch] = []

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("the fake forward failed")
        if self.step_s:
            time.sleep(self.step_s)
        self.batches.append(batch)
        n = len(batch.sample_logits_idx)
        return GenerationBatchResult(next_token_ids=torch.full((n,), self.next_token),
                                     next_token_logprobs=torch.full((n,), -0.5))


class FakeReplica:
    """Answers generate with one token per sample (its own id), release/resume with freed bytes;
    ``broken`` makes every call raise, as a server that went away."""

    def __init__(self, name: str, freed: int, broken: bool = False):
        self.address, self.freed, self.broken = name, freed, broken
        self.dtype, self.tp_size, self.group_ranks = torch.bfloat16, 1, 1

    def _check(self):
        if self.broken:
            raise ConnectionError(f"{self.address} is gone")

    def generate(self, input_ids, sampling_params, **kw):
        self._check()
        return [RolloutOutput(rid=f"{self.address}-{i}-{j}", prompt_index=i, sample_index=j, prompt_token_ids=p,
                              output_token_ids=[len(self.address)], output_logprobs=[-0.1])
                for i, p in enumerate(input_ids) for j in range(sampling_params.n)]

    def release_memory_occupation(self, tags=None, backup_weights=False):
        self._check()
        return WeightResult.ok("released", freed_bytes=self.freed)

    def resume_memory_occupation(self, tags=None):
        self._check()
        return WeightResult.ok("resumed")

    def health(self):
        return not self.broken


class FakeTarget(WeightTarget):
    """A weight target that keeps what it is pushed: every transaction's buckets as handed over
    (``transactions``: version, [[(name, dtype, shape)] per bucket]), and on commit, all-or-nothing,
    the values into ``weights`` (name -> fp32 copy) under ``version``. ``refuse`` makes commit fail
    as an engine that rejects the update would, leaving ``weights`` and ``version`` as they were."""

    def __init__(self, dtype: torch.dtype = torch.float32, refuse: Optional[str] = None, pooled: bool = False):
        self.dtype, self.refuse = dtype, refuse
        self.buffers = BucketPool() if pooled else None
        self.weights: dict[str, torch.Tensor] = {}
        self.version = "default"
        self.transactions: list[tuple[str, list[list[tuple[str, torch.dtype, tuple]]]]] = []
        self._pending: dict[str, torch.Tensor] = {}
        self.adapters: dict[str, tuple] = {}

    def begin(self, version: str) -> None:
        self.transactions.append((version, []))
        self._pending = {}

    def add(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.transactions[-1][1].append([(n, t.dtype, tuple(t.shape)) for n, t in named_tensors])
        for name, t in named_tensors:  # copied now: a pooled buffer is reused by the next push
            self._pending[name] = t.detach().float().clone()

    def commit(self) -> WeightResult:
        pending, self._pending = self._pending, {}
        if self.refuse:
            return WeightResult.fail(self.refuse)
        self.weights.update(pending)
        self.version = self.transactions[-1][0]
        return WeightResult.ok(f"loaded {len(pending)} tensors").published(self.version, 0.0)

    def push_adapter(self, name, config, named_tensors, version) -> WeightResult:
        """Kept as ``adapters[name] = (version, config, {tensor name: fp32 copy})``."""
        if self.refuse:
            return WeightResult.fail(self.refuse)
        self.adapters[name] = (version, dict(config), {n: t.detach().float().clone() for n, t in named_tensors})
        return WeightResult.ok(f"adapter {name!r} loaded").published(version, 0.0)
