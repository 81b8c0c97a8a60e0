"""The scheduler: continuous batching on the CPU.

Each step it builds one ``ModelWorkerBatch`` — running sequences first (one decode token each, or
the next chunk of a chunked prefill), then waiting ones while the token budget
(``max_num_batched_tokens``) and ``max_num_seqs`` allow — hands it to the TP worker and folds the
result back into the sequences (stop checks, logprobs, finished outputs).

The ``n`` samples of a prompt share its prefill: only the first sample (the leader) is
prefilled; when its last prompt chunk is scheduled the others fork off it, sharing its full
blocks, copying its partial last block, and drawing their first token from the same logits row.
When blocks run out, the most recently admitted running sequence is preempted: its blocks are
freed and it is recomputed later from its prompt and outputs (tokens are unchanged, since draws
depend only on seed and position).

With ``speculative_num_draft_tokens``, a decoding sequence may run its last token and guessed ones as
decode rows of its own instead (``rollout.speculative.verify``, ``Speculator.add_verify_rows``): every position is
sampled as plain decoding samples it, and the tokens kept are plain decoding's, one or more per step
(under overlap, such a step runs alone).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch

from rollout.batch import (
    GenerationBatchResult,
    ModelWorkerBatch,
    PenaltySlots,
    SamplingInputs,
    ScoredPosition,
    penalty_capacity,
)
from rollout.config import EngineConfig
from rollout.sampling_params import SamplingParams
from rollout.scheduler.block_manager import BlockManager
from rollout.scheduler.lora_registry import LoraRegistry
from rollout.scheduler.request import Request, SeqStatus, Sequence
from rollout.scheduler.results import ResultFolder
from rollout.scheduler.sessions import SessionError, SessionKv, SessionTable
from rollout.speculative.verify import Speculator
from rollout.worker.tp_worker import BaseTpWorker

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """A request refused because ``max_queued_requests`` are already waiting (the server answers 503)."""


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_prefill_tokens: int = 0  # prompt (or recomputed) tokens actually run through the model
    num_decode_tokens: int = 0
    num_shared_prefill_tokens: int = 0  # prompt tokens a forked sample did not recompute
    num_forked_samples: int = 0
    num_preemptions: int = 0
    num_finished_requests: int = 0
    forward_time_s: float = 0.0
    sample_time_s: float = 0.0
    num_sample_steps: int = 0
    # Steps whose batch was decode only (one new token per sequence), and their wall time: the whole
    # step, scheduling, input preparation, forward, sampling and folding results back (under overlap,
    # the time between step starts). ``decode_step_batch`` sums their batch sizes.
    num_decode_steps: int = 0
    decode_step_time_s: float = 0.0
    decode_step_batch: int = 0
    decode_forward_time_s: float = 0.0
    decode_sample_time_s: float = 0.0


_NO_MASK = SimpleNamespace(top_logprobs_num=0, return_sampling_mask=False)


def _neutral(temperature: float) -> SamplingParams:
    return SamplingParams(temperature=temperature).resolved({})


@dataclass
class ScheduledBatch:
    """A batch plus the scheduler-side bookkeeping needed to fold its result back."""

    batch: ModelWorkerBatch
    scheduled: list[tuple[Sequence, int]]  # (sequence, new tokens) in batch order
    samplers: list  # one per sample row: a Sequence, or a verified position's view (ScoredPosition)
    input_owners: list[Request]  # one per scored prompt token
    verifies: list = field(default_factory=list)  # (sequence, its first sample row, its guesses) per verify chunk


class Scheduler:
    def __init__(self, config: EngineConfig, worker: BaseTpWorker, eos_ids: tuple[int, ...], detokenizer=None):
        self.config = config
        self.worker = worker
        self.block_size = config.block_size
        self.block_manager = BlockManager(worker.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.eos_ids = tuple(eos_ids)
        self.detokenizer = detokenizer
        self.weight_version = config.weight_version
        self.weights_epoch = 0  # bumped by every committed update: part of every prefix-cache key
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        # Overlap scheduling: the launched batch whose result is not processed yet, and the one
        # thread that runs forwards and delayed samplings in launch order.
        self._inflight: Optional[tuple[ScheduledBatch, Future]] = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rollout-forward") if config.enable_overlap else None
        self.sessions = SessionKv(SessionTable(config.session_timeout_s, config.max_sessions), self.block_manager,
                                  lambda: self.worker.max_req_len, self._cache_key)
        self.loras = LoraRegistry(config.lora.max_loaded, config.lora.versioned_names)
        self.results = ResultFolder(self)
        self.speculator = Speculator(config.speculative.num_draft_tokens, config.speculative.max_batch,
                                     always=config.speculative.policy == "always") \
            if config.speculative.num_draft_tokens else None
        # where the runner samples on the device (its graph runner: CUDA, or the CUDA path on a CPU), penalties
        # come from per-sequence counts kept there; elsewhere from the sparse sets built each step
        self.penalty_slots = PenaltySlots(penalty_capacity(config.max_num_seqs)) \
            if getattr(getattr(worker, "model_runner", None), "graph_runner", None) is not None else None

    @property
    def cache_key(self) -> str:
        """What prefix-cache hashes are keyed by: KV is only reused under the very same weights."""
        return f"{self.weight_version}#{self.weights_epoch}"

    def _cache_key(self, req) -> str:
        """A request's prefix-cache key: the weights', its LoRA adapter version's and its ``cache_salt``
        partition, if any."""
        key = self.cache_key if req.lora is None else f"{self.cache_key}\x00lora:{req.lora.uid}"
        return key if req.cache_salt is None else f"{key}\x00salt:{req.cache_salt}"

    # ------------------------------------------------------------------ weights and cache

    def publish_weights(self, weight_version: Optional[str] = None, flush_cache: bool = True) -> None:
        """New weights are live on every rank: later tokens carry ``weight_version`` (if given), and
        the prefix cache never matches KV computed under the old weights (its keys change; with
        ``flush_cache`` the old entries are dropped at once)."""
        self.weights_epoch += 1
        if weight_version is not None:
            self.weight_version = str(weight_version)
        if flush_cache:
            self.block_manager.flush()

    def set_weight_version(self, weight_version: str) -> None:
        """Rename the live weights' version (no weight changes; prefix-cache keys include the
        version, so cached prefixes are recomputed once under the new name)."""
        self.weight_version = str(weight_version)

    def flush_cache(self) -> None:
        self.block_manager.flush()

    def get_stats(self) -> dict:
        bm = self.block_manager
        return {**vars(self.stats), "num_running": len(self.running), "num_waiting": len(self.waiting),
                "prefix_cache_queries": bm.stats.num_queries,
                "prefix_cache_hit_tokens": bm.stats.num_hit_tokens, "num_free_blocks": bm.num_free_blocks,
                "num_blocks": bm.num_blocks, **self.worker.model_runner.counts,
                **({} if self.worker.model_runner.threads is None else self.worker.model_runner.threads.stats()),
                **({} if self.speculator is None else {
                    "spec_verify_ct": self.speculator.num_verify_steps,
                    "spec_draft_token_num": self.speculator.num_draft_tokens,
                    "spec_accept_token_num": self.speculator.num_accepted_tokens,
                    "spec_declined_token_num": self.speculator.num_declined})}

    # ------------------------------------------------------------------ queue management

    def retract_all(self) -> None:
        """Send every running sequence back to the queue, dropping its KV (recomputed later)."""
        self.drain()
        for seq in reversed(list(self.running)):
            self._preempt(seq)

    def add_request(self, req: Request) -> None:
        if req.rid in self.requests:  # an abort or a result would reach the wrong caller
            self._reject(req, ValueError(f"request id {req.rid!r} is already in flight; give each request a unique rid"))
            return
        limit = self.config.max_queued_requests
        if limit is not None and len(self.waiting) >= limit:
            self._reject(req, QueueFullError(f"the waiting queue is full ({len(self.waiting)} requests, "
                                             f"max_queued_requests={limit}); retry later"))
            return
        if req.lora_name is not None:
            try:
                req.lora = self.loras.resolve(req.lora_name)  # the version it runs on to its end
            except ValueError as exc:
                self._reject(req, exc)
                return
        if req.session_id is not None:
            try:
                self.sessions.begin_turn(req)
            except SessionError as exc:
                self._reject(req, exc)
                return
        self.requests[req.rid] = req
        self.waiting.append(req.seqs[0])

    def _reject(self, req: Request, error: BaseException) -> None:
        """Finish a request that never ran, with ``error`` for its caller."""
        req.error = error
        req.pending_followers = []
        for seq in req.seqs:
            seq.status, seq.finish_reason = SeqStatus.FINISHED, "abort"
        req.finish_time = time.perf_counter()
        req.done.set()
        if req.on_update is not None:
            req.on_update(req, list(req.seqs))

    def abort(self, rid: Optional[str] = None, prefix: bool = False) -> int:
        """Finish the request (every request: rid=None; every request whose id starts with rid:
        ``prefix``) with reason "abort"; returns how many."""
        if rid is None:
            reqs = list(self.requests.values())
        elif prefix:
            reqs = [r for k, r in self.requests.items() if k.startswith(rid)]
        else:
            reqs = [self.requests[rid]] if rid in self.requests else []
        for req in reqs:
            req.pending_followers.clear()
            for seq in req.seqs:
                if not seq.is_finished:
                    self.finish(seq, "abort")
        return len(reqs)

    def fail_all(self, error: BaseException) -> None:
        self._inflight = None
        for req in list(self.requests.values()):
            req.error = error
            self.abort(req.rid)

    # ------------------------------------------------------------------ sessions (rollout.scheduler.sessions)

    # ------------------------------------------------------------------ scheduling

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight is not None)

    def step(self) -> bool:
        t0 = time.perf_counter()
        if self.config.enable_overlap:
            sb, ran = self._step_overlap()
        else:
            sb = self._step()
            ran = sb is not None
        if sb is not None and sb.batch.is_decode_only:
            self.stats.num_decode_steps += 1
            self.stats.decode_step_time_s += time.perf_counter() - t0
            self.stats.decode_step_batch += len(sb.batch.q_lens)
        return ran

    def _step(self) -> Optional[ScheduledBatch]:
        sb = self.schedule()
        if sb is None:
            return None
        self.process_batch_result(sb, self._run_now(sb))
        return sb

    def _step_overlap(self) -> tuple[Optional[ScheduledBatch], bool]:
        """Launch forward N+1, process result N on the CPU, then queue N+1's delayed sampling
        (which thus sees N's tokens: penalties, min-new-tokens, stop and abort state). Forward N+1
        reads N's sampled ids from the worker's future map, so no host sync sits between steps."""
        if self.speculator is not None and self._inflight is not None and \
                self.speculator.may_pay(len(self.running)):
            self.drain()  # the tail: every result first, so that guesses follow each sequence's latest token
        sb = self.schedule()
        if sb is not None and sb.verifies:  # a verify step runs alone: what it keeps decides the next positions
            self.process_batch_result(sb, self._executor.submit(self._run_now, sb).result())
            return sb, True
        forward = self._executor.submit(self.worker.forward_batch_generation, sb.batch) if sb is not None else None
        inflight, self._inflight = self._inflight, None
        try:
            if inflight is not None:
                self.process_batch_result(inflight[0], inflight[1].result())
        finally:
            if forward is not None:
                sampling = self._sampling_inputs(sb.samplers) if sb.samplers else None

                def sample(fwd=forward, sampling=sampling):
                    result = fwd.result()
                    return result.delay_sample_func(sampling) if result.delay_sample_func is not None else result

                self._inflight = (sb, self._executor.submit(sample))
        return sb, sb is not None or inflight is not None

    def _run_now(self, sb: ScheduledBatch) -> GenerationBatchResult:
        """Forward and sample one batch, nothing in flight (on the forward thread under overlap)."""
        result = self.worker.forward_batch_generation(sb.batch)
        if result.delay_sample_func is not None:
            result = result.delay_sample_func(sb.batch.sampling or self._sampling_inputs(sb.samplers))
        return result

    def _sampling_inputs(self, samplers: list[Sequence]) -> SamplingInputs:
        """Built from sequence state when sampling happens (late, under overlap)."""
        return SamplingInputs.from_seqs(samplers, self.eos_ids, self.config.outputs.logprob_mode == "raw",
                                        self.config.outputs.max_sampling_mask_size, self.penalty_slots)

    def drain(self) -> None:
        """Finish the launched batch (overlap mode) so the model is quiet: for flushes, updates, stops."""
        while self._inflight is not None:
            sb, fut = self._inflight
            self._inflight = None
            self.process_batch_result(sb, fut.result())

    def close(self) -> None:
        try:
            self.drain()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    def _slots_needed(self, seq: Sequence, upto: int) -> int:
        return max(0, self.block_manager.blocks_for(upto) - len(seq.block_table))

    def _decode_reserve(self, seq: Sequence, upto: Optional[int] = None) -> int:
        """Blocks ``seq`` is expected to take beyond ``upto`` tokens (default: what it holds) to grow by
        ``decode_reserve_ratio`` of its remaining new tokens (within the context)."""
        ratio = self.config.decode_reserve_ratio
        if ratio <= 0:
            return 0
        left = max(0, seq.params.max_new_tokens - seq.num_output_tokens)
        end = min(seq.total_len + math.ceil(ratio * left), self.worker.context_len)
        have = len(seq.block_table) if upto is None else max(len(seq.block_table), self.block_manager.blocks_for(upto))
        return max(0, self.block_manager.blocks_for(end) - have)

    def _grow(self, seq: Sequence, upto: int) -> bool:
        need = self._slots_needed(seq, upto)
        if need == 0:
            return True
        blocks = self.block_manager.allocate(need)
        while blocks is None and self.sessions.release_one():  # sessions' held KV goes before any preemption
            blocks = self.block_manager.allocate(need)
        if blocks is None:
            return False
        seq.block_table.extend(blocks)
        return True

    def _preempt(self, seq: Sequence) -> None:
        seq.spec_guesses = []
        self.block_manager.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _admit_prefix(self, seq: Sequence) -> None:
        req = seq.req
        seq.kv_key = self._cache_key(req)
        limit = len(seq.token_ids) - 1  # at least one token must run to produce logits
        if seq.num_output_tokens == 0 and req.needs_input_logprobs:
            limit = min(limit, req.next_input_logprob_pos)
        if req.session_id is not None and self.sessions.adopt(seq, limit):
            return
        blocks = self.block_manager.match_prefix(seq.token_ids, limit, seq.kv_key)
        seq.block_table = blocks
        seq.num_computed_tokens = len(blocks) * self.block_size
        if seq.num_output_tokens == 0:
            seq.num_cached_tokens = seq.num_computed_tokens

    def schedule(self) -> Optional[ScheduledBatch]:
        if self.sessions:
            self.sessions.expire()
        budget = self.config.max_num_batched_tokens
        if self.speculator is not None:
            self.speculator.new_step(len(self.running))
        scheduled: list[tuple[Sequence, int]] = []
        in_batch: set[int] = set()
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            remaining = seq.total_len - seq.num_computed_tokens
            q = min(remaining, budget)
            seq.spec_guesses = []
            if self.speculator is not None and remaining == 1 and not seq.num_pending:
                room = min(budget, self.worker.context_len - len(seq.token_ids)) - 1
                guesses = self.speculator.guesses(seq, len(self.running), room)
                if guesses and self._grow(seq, seq.num_computed_tokens + 1 + len(guesses)):
                    seq.spec_guesses, q = guesses, 1 + len(guesses)
            while not self._grow(seq, seq.num_computed_tokens + q):
                victims = [s for s in self.running if s.seq_id not in in_batch and s is not seq]
                if not victims:
                    break
                self._preempt(victims[-1])
            if self._slots_needed(seq, seq.num_computed_tokens + q):
                self._preempt(seq)
                continue
            scheduled.append((seq, q))
            in_batch.add(seq.seq_id)
            budget -= q
        reserve = sum(self._decode_reserve(s) for s in self.running) if self.waiting else 0
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_computed_tokens == 0 and not seq.block_table:
                self._admit_prefix(seq)
            q = min(seq.total_len - seq.num_computed_tokens, budget)
            own = self._decode_reserve(seq, seq.num_computed_tokens + q)
            # the running sequences' growth (and this one's) stays free: admitting past it would only preempt
            if (self.running and self.block_manager.num_free_blocks < self._slots_needed(seq, seq.num_computed_tokens + q)
                    + reserve + own) or not self._grow(seq, seq.num_computed_tokens + q):
                self.block_manager.free(seq.block_table)
                seq.block_table, seq.num_computed_tokens = [], 0
                break
            reserve += own
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, q))
            budget -= q
        if not scheduled:
            return None
        return self._build_batch(scheduled)

    def _build_batch(self, scheduled: list[tuple[Sequence, int]]) -> ScheduledBatch:
        if any(seq.req.lora is not None for seq, _ in scheduled):  # each adapter's rows side by side
            scheduled = sorted(scheduled, key=lambda sq: -1 if sq[0].req.lora is None else sq[0].req.lora.slot)
        input_ids: list[int] = []
        tables, ctx_lens, q_lens, logits_rows, sample_idx = [], [], [], [], []
        lora_slots: list[int] = []
        samplers: list[Sequence] = []
        in_idx, in_targets, in_temps, in_owners = [], [], [], []
        in_scored: list[Optional[ScoredPosition]] = []  # replayed scoring: the sampler's view of each row
        copies: list[tuple[int, int]] = []
        verifies: list[tuple[Sequence, int, list[int]]] = []  # (sequence, its first sample row, its guesses)
        in_top = 0
        has_placeholders = False
        raw = self.config.outputs.logprob_mode == "raw"
        row = 0
        for seq, q in scheduled:
            start = seq.num_computed_tokens
            end = start + q
            req = seq.req
            if seq.spec_guesses:
                row = self.speculator.add_verify_rows(seq, start, q, (input_ids, tables, lora_slots, ctx_lens, q_lens),
                                                      logits_rows, sample_idx, samplers, verifies, row)
                self.stats.num_decode_tokens += q
                continue
            input_ids.extend(seq.token_ids[start:end])
            if end > len(seq.token_ids):  # the pending token: resolved on the device from the future map
                input_ids.append(-(seq.pending_row + 1))
                has_placeholders = True
            tables.append(list(seq.block_table))  # a snapshot: the table grows while this batch runs
            lora_slots.append(-1 if req.lora is None else req.lora.slot)
            ctx_lens.append(end)
            q_lens.append(q)
            if end <= seq.num_prompt_tokens:
                self.stats.num_prefill_tokens += q
            else:
                self.stats.num_decode_tokens += q
            # prompt logprobs: position p scores token p + 1
            if seq.num_output_tokens == 0 and req.needs_input_logprobs:
                first = max(start, req.next_input_logprob_pos)
                last = min(end, seq.num_prompt_tokens - 1)
                temp = 1.0 if raw or req.params.temperature <= 0 else req.params.temperature
                for p in range(first, last):
                    in_idx.append(len(logits_rows))
                    logits_rows.append(row + p - start)
                    in_targets.append(seq.token_ids[p + 1])
                    in_temps.append(temp)
                    in_owners.append(req)
                    in_scored.append(None if req.score_from is None else ScoredPosition(
                        req.score_params, seq.token_ids[: p + 1], req.score_from, req))
                req.next_input_logprob_pos = max(req.next_input_logprob_pos, last)
                in_top = max(in_top, req.top_logprobs_num)
            seq.num_computed_tokens = end
            self._register_full_blocks(seq, start, end)
            if end == seq.total_len and req.params.max_new_tokens > 0:
                logits_rows.append(row + q - 1)
                forks = self._fork_followers(seq, copies) if req.pending_followers else []
                for s in [seq, *forks]:
                    s.pending_row = len(samplers)
                    s.num_pending += 1
                    sample_idx.append(len(logits_rows) - 1)
                    samplers.append(s)
            row += q
        batch = ModelWorkerBatch(
            input_ids=input_ids, block_tables=tables, ctx_lens=ctx_lens, q_lens=q_lens,
            logits_rows=logits_rows, sample_logits_idx=sample_idx,
            sampling=None if self.config.enable_overlap or not samplers else self._sampling_inputs(samplers),
            input_logprob_idx=in_idx, input_logprob_targets=in_targets, input_logprob_temps=in_temps,
            input_logprob_sampling=self._scoring_inputs(in_scored, in_temps, in_owners),
            input_top_logprobs_num=in_top, block_copies=copies, weight_version=self.weight_version,
            has_placeholders=has_placeholders, lora_slots=lora_slots if any(s >= 0 for s in lora_slots) else None,
        )
        return ScheduledBatch(batch, scheduled, samplers, in_owners, verifies)

    def _scoring_inputs(self, scored: list, temps: list[float], owners: list[Request]) -> Optional[SamplingInputs]:
        """Processed rows for a batch that scores given output tokens; plain prompt-logprob rows of
        the same batch get a neutral row (their temperature only), which computes what they always did."""
        if not any(s is not None for s in scored):
            return None
        rows = [s if s is not None else ScoredPosition(_neutral(t), [], 0, _NO_MASK) for s, t in zip(scored, temps)]
        return SamplingInputs.from_seqs(rows, self.eos_ids, False, self.config.outputs.max_sampling_mask_size)

    def _register_full_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Make prompt blocks completed by this step matchable by later requests."""
        if not self.block_manager.enable_prefix_caching or seq.num_output_tokens > 0:
            return
        first, last = start // self.block_size, min(end, seq.num_prompt_tokens) // self.block_size
        if last <= first:
            return
        # under the key the sequence's KV was computed with since admission (a weight update meanwhile
        # must not make its blocks matchable under the new weights)
        hashes = self.block_manager.block_hashes(seq.token_ids, last, seq.kv_key or self._cache_key(seq.req))
        for i in range(first, last):
            self.block_manager.register(seq.block_table[i], hashes[i])

    def _fork_followers(self, leader: Sequence, copies: list[tuple[int, int]]) -> list[Sequence]:
        """Followers share the leader's full prompt blocks and copy its partial last block — as many as
        ``max_num_seqs`` leaves room for (every sample counts against it); the rest wait at the front of the
        queue, ahead of later requests, and prefill on their own as room frees (their prompt's full blocks
        from the prefix cache)."""
        req = leader.req
        n_full = leader.num_prompt_tokens // self.block_size
        partial = leader.num_prompt_tokens % self.block_size != 0
        forked = []
        for seq in list(req.pending_followers):
            if len(self.running) >= self.config.max_num_seqs:
                break
            dst = None
            if partial:
                dst = self.block_manager.allocate(1)
                if dst is None:
                    break  # out of blocks: the rest prefill on their own (prefix cache helps)
            self.block_manager.share(leader.block_table[:n_full])
            seq.block_table = leader.block_table[:n_full] + (dst or [])
            if dst:
                copies.append((leader.block_table[n_full], dst[0]))
            seq.num_computed_tokens = leader.num_prompt_tokens
            seq.num_cached_tokens = leader.num_prompt_tokens
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            req.pending_followers.remove(seq)
            forked.append(seq)
        self.stats.num_forked_samples += len(forked)
        self.stats.num_shared_prefill_tokens += len(forked) * leader.num_prompt_tokens
        # no room or no block for them now: queued as ordinary sequences, first in line
        self.waiting.extendleft(reversed(req.pending_followers))
        req.pending_followers = []
        return forked

    # ------------------------------------------------------------------ results

    def process_batch_result(self, sb: ScheduledBatch, result: GenerationBatchResult) -> None:
        self.results.fold(sb, result)

    def fail_request(self, req: Request, error: BaseException) -> None:
        req.error = error
        self.abort(req.rid)

    def _routed_experts(self, seq: Sequence) -> tuple[int, torch.Tensor]:
        """The experts recorded at the sequence's positions [routed_experts_start_len, len - 1) (the last token
        is never a forward's input), read from its KV slots before they are freed; a sequence aborted before
        some were computed reports those it has."""
        end = min(seq.num_computed_tokens, len(seq.token_ids) - 1, len(seq.block_table) * self.block_size)
        start = min(seq.req.routed_experts_start_len, max(end, 0))
        positions = torch.arange(start, max(end, start))
        table = torch.tensor(seq.block_table, dtype=torch.long)
        slots = table[positions // self.block_size] * self.block_size + positions % self.block_size
        return start, self.worker.model_runner.routing.read(slots)

    def finish(self, seq: Sequence, reason: str, matched=None) -> None:
        seq.finish_reason = reason
        seq.matched_stop = matched
        if self.speculator is not None:
            self.speculator.finished(seq, self.weight_version)
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        if seq.req.return_routed_experts:
            seq.routed_experts_start_len, seq.routed_experts = self._routed_experts(seq)
        if seq.req.session_id is not None:
            self.sessions.end_turn(seq)
        self.block_manager.free(seq.block_table)
        seq.block_table = []
        req = seq.req
        if req.is_finished and not req.pending_followers:
            req.finish_time = time.perf_counter()
            self.requests.pop(req.rid, None)
            self.stats.num_finished_requests += 1
            req.done.set()
            if req.on_update is not None:
                req.on_update(req, [s for s in req.seqs])
