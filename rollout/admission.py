"""Admission: a caller's prompts and sampling parameters become ``Request``s, or a ``ValueError``
that says what to fix — in the caller's thread, before anything reaches the batch — and finished
sequences become ``RolloutOutput``s.
"""

from __future__ import annotations

import itertools
import time
from typing import Optional

from rollout.config import EngineConfig
from rollout.models import ModelConfig
from rollout.outputs import RolloutOutput
from rollout.random import derive_seed
from rollout.request import Request, Sequence
from rollout.sampling_params import SamplingParams

PromptIds = list[int]


class Admission:
    """Turns API arguments into requests against this engine's limits and vocabulary."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, limits, tokenizer, detokenize, defaults: dict):
        self.config = config
        self.vocab_size = model_config.vocab_size
        self.limits = limits  # the TP worker: max_req_input_len, max_req_len, context_len, max_total_num_tokens
        self.tokenizer = tokenizer
        self.detokenize = detokenize
        self.defaults = defaults  # generation_config.json values for unset sampling fields
        self._counter = itertools.count()

    def prompt_ids(self, prompts, input_ids) -> list[PromptIds]:
        if (prompts is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompts (strings) or input_ids (token id lists)")
        if prompts is not None:
            if isinstance(prompts, str):
                prompts = [prompts]
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: pass input_ids instead of prompts")
            if not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompts must be a string or a list of strings")
            return [list(self.tokenizer(p)["input_ids"]) for p in prompts]
        if input_ids and all(isinstance(t, int) for t in input_ids):
            input_ids = [input_ids]
        if not isinstance(input_ids, (list, tuple)) or not all(isinstance(p, (list, tuple)) for p in input_ids):
            raise ValueError("input_ids must be a list of token ids or a list of such lists")
        return [list(p) for p in input_ids]

    def make_requests(self, prompts, input_ids, sampling_params, return_logprob: bool, top_logprobs_num: int,
                      logprob_start_len: int, rid, on_update=None) -> list[Request]:
        ids_list = self.prompt_ids(prompts, input_ids)
        if not ids_list:
            raise ValueError("no prompts given")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(ids_list)
        if len(params) != len(ids_list):
            raise ValueError(f"got {len(params)} sampling_params for {len(ids_list)} prompts")
        params = [SamplingParams.from_dict(p) if isinstance(p, dict) else p for p in params]
        if not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
            raise ValueError("top_logprobs_num must be an integer >= 0")
        if not isinstance(logprob_start_len, int) or logprob_start_len < -1:
            raise ValueError("logprob_start_len must be -1 (no prompt logprobs) or a position >= 0")
        rids = [rid] if isinstance(rid, str) else rid
        if rids is not None and len(rids) != len(ids_list):
            raise ValueError(f"got {len(rids)} rids for {len(ids_list)} prompts")
        vocab, w = self.vocab_size, self.limits
        reqs = []
        for i, (ids, sp) in enumerate(zip(ids_list, params)):
            if not isinstance(sp, SamplingParams):
                raise ValueError("sampling_params must be SamplingParams, a dict, or a list of them")
            sp.check_vocab(vocab)
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
            if len(ids) > w.max_req_input_len:
                raise ValueError(f"prompt {i} has {len(ids)} tokens; the limit is {w.max_req_input_len} "
                                 f"(context {w.context_len}, KV pool {w.max_total_num_tokens} tokens): shorten it "
                                 f"or raise max_model_len / kv_cache_tokens")
            if len(ids) + sp.max_new_tokens > w.max_req_len:
                raise ValueError(f"prompt {i}: {len(ids)} prompt tokens + max_new_tokens={sp.max_new_tokens} "
                                 f"exceeds the limit of {w.max_req_len} tokens per sequence; lower max_new_tokens")
            counter = next(self._counter)
            seed = sp.seed if sp.seed is not None else derive_seed(self.config.seed, counter)
            seq_ids = [next(self._counter) for _ in range(sp.n)]
            reqs.append(Request(rids[i] if rids else f"req-{counter}", i, ids, sp.resolved(self.defaults), seed,
                                seq_ids, return_logprob, top_logprobs_num, logprob_start_len, on_update))
        return reqs

    def to_output(self, req: Request, seq: Sequence, current_version: str) -> RolloutOutput:
        text = seq.text
        if text is None and self.detokenize is not None:
            text = self.detokenize(seq.output_ids, req.params.skip_special_tokens)
        end = req.finish_time if seq.is_finished and req.finish_time else time.perf_counter()
        return RolloutOutput(
            rid=req.rid, prompt_index=req.prompt_index, sample_index=seq.sample_index,
            prompt_token_ids=list(req.prompt_ids), output_token_ids=list(seq.output_ids),
            output_logprobs=list(seq.output_logprobs), text=text,
            output_top_logprobs=list(seq.output_top_logprobs),
            input_logprobs=list(req.input_logprobs), input_top_logprobs=list(req.input_top_logprobs),
            finish_reason=seq.finish_reason, matched_stop=seq.matched_stop, stop_text_offset=seq.stop_text_offset,
            logprob_mode=self.config.logprob_mode,
            weight_version=seq.output_versions[-1] if seq.output_versions else current_version,
            output_weight_versions=list(seq.output_versions), num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            time_to_first_token_s=(seq.first_token_time - req.arrival_time) if seq.first_token_time else None,
            latency_s=end - req.arrival_time,
        )

    def outputs(self, reqs: list[Request], current_version: str) -> list[RolloutOutput]:
        """Every sample of every request, prompt-major; a failed request raises its error."""
        errors: list[Optional[BaseException]] = [r.error for r in reqs if r.error is not None]
        if errors:
            raise RuntimeError(f"generation failed: {errors[0]!r}") from errors[0]
        return [self.to_output(r, s, current_version) for r in reqs for s in r.seqs]
