"""Public fakes for tests that need no engine: a worker for the scheduler (``FakeWorker``) and a
replica for the router and the trainer side (``FakeReplica``: answers like a server). Everything
around them is the real code."""

from __future__ import annotations

import torch

from rollout.outputs import RolloutOutput
from rollout.scheduler.batch import GenerationBatchResult, ModelWorkerBatch
from rollout.worker.messages import WeightResult


class FakeWorker:
    """Returns token ``next_token`` for every sample row; records every batch it was given."""

    def __init__(self, num_blocks: int, next_token: int = 7, context_len: int = 1000):
        self.num_kv_blocks = num_blocks
        self.context_len = context_len
        self.next_token = next_token
        self.batches: list[ModelWorkerBatch] = []

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
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
