"""TP workers after SGLang's design: the ``TpModelWorker`` (one per device/rank) turns the
scheduler's ``ModelWorkerBatch`` into a device ``ForwardBatch``, runs the ``ModelRunner`` and
decides *when* to sample: now, or later through ``delay_sample_func`` (overlap scheduling).
Prefill-only batches skip sampling and return prompt logprobs only. Weight operations go to the
rank's ``RankWeights`` (``run_weight_op``), which the worker owns.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import torch

from rollout.batch import GenerationBatchResult, ModelWorkerBatch, SamplingInputs
from rollout.config import EngineConfig
from rollout.executor.model_runner import ModelRunner
from rollout.layers.parallel_state import TpState, tp_state_context
from rollout.models import ModelConfig
from rollout.outputs import WeightResult
from rollout.worker.rank_weights import INPUT_ERRORS, RankWeights


class BaseTpWorker(ABC):
    @abstractmethod
    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        ...

    @abstractmethod
    def run_weight_op(self, msg) -> WeightResult:
        """Run a weight message (``rollout.worker.messages``) on every rank of this engine; one result."""

    @property
    @abstractmethod
    def model_runner(self) -> ModelRunner:
        ...

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in this engine's KV pool (what the scheduler's block accounting hands out)."""
        return self.model_runner.kv.num_blocks


class TpModelWorker(BaseTpWorker):
    def __init__(self, config: EngineConfig, tp_state: TpState | None = None):
        self.config = config
        self.tp_state = tp_state or TpState()
        self.tp_rank = self.tp_state.tp_rank
        # 1. model config
        self.model_config = ModelConfig.from_pretrained(config.model_path)
        self.tp_size = config.tp_size
        self.model_config.check_tp_size(self.tp_size)
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.model_config.checkpoint_dtype, self.device)
        context_len = config.max_model_len or self.model_config.max_position_embeddings
        self.context_len = context_len
        # 2. the runner: weights, KV pool
        with tp_state_context(self.tp_state):
            self._model_runner = ModelRunner(config, self.model_config, self.device, self.dtype, context_len)
        # 3. limits
        self.max_total_num_tokens = self._model_runner.max_total_num_tokens
        self.max_req_len = min(context_len - 1, self.max_total_num_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5
        # 4. one seed for every rank (draws are functions of it, so every rank samples the same token)
        self.random_seed = self._broadcast_seed(config.seed)
        self._future_token_ids: torch.Tensor | None = None
        # 5. this rank's weight operations
        self.weights = RankWeights(self._model_runner, self.tp_state, self.device)

    def _broadcast_seed(self, seed: int) -> int:
        if self.tp_state.tp_size == 1:
            return seed
        t = torch.tensor([seed], dtype=torch.int64, device=self.device)
        self.tp_state.comm.broadcast(t, 0)
        return int(t.item())

    @property
    def model_runner(self) -> ModelRunner:
        return self._model_runner

    def run_weight_op(self, msg) -> WeightResult:
        """This rank's part of a weight operation. Bad input is answered, never raised: the rank
        keeps serving (only a broken transport or collective is fatal)."""
        try:
            return self.weights.handle(msg)
        except INPUT_ERRORS as exc:
            return WeightResult.fail(f"{type(exc).__name__}: {exc}")

    def _sync_for_timing(self) -> None:
        if self.config.sync_step_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        runner = self._model_runner
        t0 = time.perf_counter()
        logits = runner.forward(batch, self._future_token_ids)
        runner.kv.copy_blocks(batch.block_copies)
        result = GenerationBatchResult()
        if batch.input_logprob_sampling is not None:  # replayed scoring in this batch
            (result.input_logprobs, result.input_top_ids, result.input_top_logprobs, result.input_sampling_logprobs,
             result.input_sampling_masks) = runner.score_processed(logits, batch)
        elif batch.input_logprob_idx:
            result.input_logprobs, result.input_top_ids, result.input_top_logprobs, result.input_ranks = \
                runner.compute_input_logprobs(logits, batch)
        self._sync_for_timing()
        result.forward_time_s = time.perf_counter() - t0
        if batch.is_prefill_only:
            return result
        idx = batch.sample_logits_idx
        if idx == list(range(logits.shape[0])):  # one sample per logits row (decode): no copy of [S, vocab]
            sample_logits = logits
        else:
            sample_logits = logits.index_select(0, torch.tensor(idx, device=logits.device))

        def sample_batch_func(sampling: SamplingInputs) -> GenerationBatchResult:
            t1 = time.perf_counter()
            out = runner.sample(sample_logits, sampling)
            result.next_token_ids, result.next_token_logprobs = out.token_ids, out.logprobs
            self._future_token_ids = out.token_ids  # the next batch's placeholders read these
            result.top_ids, result.top_logprobs = out.top_ids, out.top_logprobs
            result.sampling_masks, result.sampling_logprobs = out.masks, out.sampling_logprobs
            result.delay_sample_func = None
            self._sync_for_timing()
            result.sample_time_s = time.perf_counter() - t1
            return result

        if self.config.enable_overlap or batch.sampling is None:
            result.delay_sample_func = sample_batch_func
            return result
        return sample_batch_func(batch.sampling)
