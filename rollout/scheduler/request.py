"""A request (one prompt, ``n`` samples) and its sequences (one per sample): scheduler state only."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from typing import Optional

import torch

from rollout.sampling_params import SamplingParams
from rollout.scheduler.lora_registry import AdapterVersion


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: int, req: Request, sample_index: int, seed: int):
        self.seq_id = seq_id
        self.req = req
        self.sample_index = sample_index
        self.seed = seed
        self.token_ids: list[int] = list(req.prompt_ids)  # prompt, then outputs
        self.num_prompt_tokens = len(req.prompt_ids)
        self.num_computed_tokens = 0  # positions whose KV is (or is being) written
        # Overlap scheduling: tokens sampled (or being sampled) but not yet appended, and the sample
        # row of the latest one in its batch (the next batch reads it from the device-side future map).
        self.num_pending = 0
        self.pending_row = -1
        self.block_table: list[int] = []
        self.status = SeqStatus.WAITING
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        self.output_versions: list[str] = []
        self.output_sampling_masks: list[list[int]] = []  # with return_sampling_mask
        self.output_sampling_logprobs: list[float] = []
        self.finish_reason: Optional[str] = None
        self.matched_stop = None
        self.stop_text_offset: Optional[int] = None
        self.text: Optional[str] = None
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.kv_key: Optional[str] = None  # the prefix-cache key this sequence's KV is computed under
        self.first_token_time: Optional[float] = None
        self.spec_guesses: list[int] = []  # guesses verified in the step now scheduled (rollout.speculative)
        self.spec_verify_ct = 0  # verify steps it ran, guesses in them, guesses accepted (SGLang's names)
        self.spec_draft_token_num = 0
        self.spec_accept_token_num = 0
        self.routed_experts: Optional[torch.Tensor] = None  # read when it finishes (return_routed_experts)
        self.routed_experts_start_len = 0  # the position its first row is (the request's, within its length)

    @property
    def params(self) -> SamplingParams:
        return self.req.params

    @property
    def total_len(self) -> int:
        """Tokens including those still being sampled."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED


class Request:
    def __init__(self, rid: str, prompt_index: int, prompt_ids: list[int], params: SamplingParams, seed: int,
                 seq_ids: list[int], return_logprob: bool, top_logprobs_num: int, logprob_start_len: int,
                 on_update: Optional[Callable[[Request, list[Sequence]], None]] = None,
                 return_sampling_mask: bool = False):
        self.rid = rid
        self.prompt_index = prompt_index
        self.prompt_ids = prompt_ids
        self.params = params
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num if return_logprob else 0
        self.return_sampling_mask = return_sampling_mask
        self.cache_salt: Optional[str] = None  # prefix-cache partition (vLLM's cache_salt)
        self.session_id: Optional[str] = None  # a session turn: the session's history is prepended
        self.lora_name: Optional[str] = None  # the LoRA adapter asked for (None: the base weights)
        self.lora: Optional[AdapterVersion] = None  # the adapter version it runs on, set when it is added
        # SGLang's return_routed_experts: each sample's experts at positions [routed_experts_start_len, len - 1)
        self.return_routed_experts = False
        self.routed_experts_start_len = 0
        # Replayed scoring: prompt_ids[score_from:] are given output tokens, scored under
        # ``score_params`` as generation would have (processed logprobs, masks); None otherwise.
        self.score_from: Optional[int] = None
        self.score_params: Optional[SamplingParams] = None
        self.score_masks: list[list[int]] = []
        self.score_sampling_logprobs: list[float] = []
        # Prompt logprobs cover positions >= logprob_start_len (-1: none). The logprob of token p
        # comes from the logits at position p - 1.
        wants_input = return_logprob and 0 <= logprob_start_len < len(prompt_ids)
        self.logprob_start_len = logprob_start_len if wants_input else len(prompt_ids)
        self.next_input_logprob_pos = max(self.logprob_start_len - 1, 0) if wants_input else len(prompt_ids)
        self.input_logprobs: list[Optional[float]] = [None] if wants_input and logprob_start_len == 0 else []
        self.input_top_logprobs: list[list[tuple[int, float]]] = [[]] if self.input_logprobs else []
        # each scored prompt token's rank (with top logprobs); None for the first
        self.input_ranks: list[Optional[int]] = [None] if self.input_logprobs else []
        self.seqs = [Sequence(sid, self, i, seed + i) for i, sid in enumerate(seq_ids)]
        self.pending_followers: list[Sequence] = self.seqs[1:]  # forked off seqs[0] after its prefill
        self.on_update = on_update
        self.arrival_time = time.perf_counter()
        self.finish_time: Optional[float] = None
        self.done = threading.Event()
        self.error: Optional[BaseException] = None

    @property
    def needs_input_logprobs(self) -> bool:
        return self.next_input_logprob_pos < len(self.prompt_ids) - 1

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
