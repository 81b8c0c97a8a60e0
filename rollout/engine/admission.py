"""Admission: a caller's prompts and sampling parameters become ``Request``s, or a ``ValueError``
that says what to fix — in the caller's thread, before anything reaches the batch — and finished
sequences become ``RolloutOutput``s.

Each request's sampling inputs are turned into the step's own tensors here (``SamplingInputs`` →
``SamplingBatchInfo``), so a value the step could not take fails its request alone, naming the
field, instead of failing the whole batch later. ``input_ids`` may be lists, tuples, numpy arrays
or tensors (1-D: one prompt, 2-D: a batch).
"""

from __future__ import annotations

import itertools
import operator
import time
import uuid
from dataclasses import replace
from typing import Optional, Union

import torch

from rollout.batch import SamplingInputs
from rollout.config import EngineConfig
from rollout.models import ModelConfig
from rollout.outputs import RolloutOutput
from rollout.random import derive_seed
from rollout.sampling_params import SamplingParams
from rollout.scheduler.request import Request, Sequence

PromptIds = list[int]
MAX_N = 4096  # samples per prompt


def _token_list(p, i: int) -> list[int]:
    """One prompt's ids as Python ints (numpy / torch integers accepted, bools and floats not)."""
    if hasattr(p, "tolist") and not isinstance(p, (list, tuple)):
        p = p.tolist()
    if not isinstance(p, (list, tuple)):
        raise ValueError(f"input_ids[{i}] must be a list of token ids, got {type(p).__name__}")
    try:
        return [operator.index(t) if not isinstance(t, bool) else _no_bool() for t in p]
    except TypeError:
        bad = next(t for t in p if isinstance(t, bool) or not hasattr(t, "__index__"))
        raise ValueError(f"input_ids[{i}] holds {type(bad).__name__} {bad!r}: token ids must be integers") from None


def _no_bool():
    raise TypeError("bool")


MAX_RID_CHARS = 1024  # a request id is held while the request runs: bounded like every id a client names

class Admission:
    """Turns API arguments into requests against this engine's limits and vocabulary."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, limits, tokenizer, detokenize, defaults: dict,
                 eos_ids: tuple[int, ...] = ()):
        self.config = config
        self.vocab_size = model_config.vocab_size
        self.has_experts = bool(model_config.num_experts)
        self.eos_ids = tuple(eos_ids)
        self.limits = limits  # the TP worker: max_req_input_len, max_req_len, context_len, max_total_num_tokens
        self.tokenizer = tokenizer
        self.detokenize = detokenize
        self.defaults = defaults  # generation_config.json values for unset sampling fields
        self._counter = itertools.count()
        self._rid_prefix = f"req-{uuid.uuid4().hex[:8]}-"  # generated ids never collide with a caller's

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
        if isinstance(input_ids, torch.Tensor) or type(input_ids).__module__ == "numpy":
            if input_ids.ndim not in (1, 2):
                raise ValueError(f"input_ids as an array must be 1-D (one prompt) or 2-D (a batch), "
                                 f"got shape {tuple(input_ids.shape)}")
            input_ids = input_ids.tolist()
            if input_ids and not isinstance(input_ids[0], list):
                input_ids = [input_ids]
        if not isinstance(input_ids, (list, tuple)):
            raise ValueError(f"input_ids must be a list of token ids or a list of such lists, "
                             f"got {type(input_ids).__name__}")
        if input_ids and not any(isinstance(p, (list, tuple)) or hasattr(p, "tolist") for p in input_ids):
            input_ids = [input_ids]  # one prompt given as a flat list
        return [_token_list(p, i) for i, p in enumerate(input_ids)]

    def make_requests(self, prompts, input_ids, sampling_params, return_logprob: bool, top_logprobs_num: int,
                      logprob_start_len: int, rid, on_update=None,
                      return_sampling_mask: Optional[bool] = None, cache_salt: Optional[str] = None,
                      session_id: Union[str, list[Optional[str]], None] = None,
                      lora_path: Union[str, list[Optional[str]], None] = None, *,
                      return_routed_experts: bool = False, routed_experts_start_len: int = 0) -> list[Request]:
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt must be a string")
        self._check_routed_experts(return_routed_experts, routed_experts_start_len)
        if return_sampling_mask is None:
            return_sampling_mask = self.config.outputs.return_sampling_mask
        ids_list = self.prompt_ids(prompts, input_ids)
        if not ids_list:
            raise ValueError("no prompts given")
        sessions = self._session_ids(session_id, len(ids_list), logprob_start_len)
        loras = self._lora_names(lora_path, len(ids_list))
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
        if rids is not None:
            if not isinstance(rids, (list, tuple)) or not all(isinstance(r, str) and 0 < len(r) <= MAX_RID_CHARS
                                                              for r in rids):
                raise ValueError(f"rid must be a string of 1-{MAX_RID_CHARS} characters or a list of them (one per "
                                 "prompt)")
            if len(rids) != len(ids_list):
                raise ValueError(f"got {len(rids)} rids for {len(ids_list)} prompts")
            if len(set(rids)) != len(rids):
                raise ValueError("rids must be unique within a call")
        vocab, w = self.vocab_size, self.limits
        reqs = []
        for i, (ids, sp) in enumerate(zip(ids_list, params)):
            if not isinstance(sp, SamplingParams):
                raise ValueError("sampling_params must be SamplingParams, a dict, or a list of them")
            if sp.n > MAX_N:
                raise ValueError(f"SamplingParams.n={sp.n}: at most {MAX_N} samples per prompt")
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
            params = sp.resolved(self.defaults).for_vocab(vocab, self.eos_ids)
            req = Request(rids[i] if rids else f"{self._rid_prefix}{counter}", i, ids, params, seed, seq_ids,
                          return_logprob, top_logprobs_num, logprob_start_len, on_update, bool(return_sampling_mask))
            req.cache_salt = cache_salt or None
            req.lora_name = loras[i]
            req.return_routed_experts = bool(return_routed_experts)
            if req.return_routed_experts and sessions[i] is None and routed_experts_start_len > len(ids):
                raise ValueError(f"prompt {i}: routed_experts_start_len={routed_experts_start_len} is past its "
                                 f"{len(ids)} prompt tokens (it must be in [0, prompt length])")
            req.routed_experts_start_len = routed_experts_start_len
            if sessions[i] is not None:
                if sp.n != 1:
                    raise ValueError(f"prompt {i} is a turn of session {sessions[i]!r}: a session turn samples "
                                     f"once (n=1), got n={sp.n}")
                req.session_id = sessions[i]
            self._check_step_form(req, i)
            reqs.append(req)
        return reqs

    def _check_routed_experts(self, wanted, start_len) -> None:
        if not isinstance(wanted, bool):
            raise ValueError("return_routed_experts must be true or false")
        if not isinstance(start_len, int) or isinstance(start_len, bool) or start_len < 0:
            raise ValueError("routed_experts_start_len must be an integer >= 0 (a position of the prompt)")
        if wanted and not self.has_experts:
            raise ValueError("return_routed_experts: this model has no mixture-of-experts layers (no routed "
                             "experts to return)")
        if wanted and not self.config.outputs.return_routed_experts:
            raise ValueError("return_routed_experts needs an engine started with enable_return_routed_experts=True "
                             "(server: --enable-return-routed-experts)")

    @staticmethod
    def _lora_names(lora_path, num_prompts: int) -> list[Optional[str]]:
        """Per prompt, the LoRA adapter it runs on (None: the base weights)."""
        if lora_path is None:
            return [None] * num_prompts
        names = [lora_path] * num_prompts if isinstance(lora_path, str) else lora_path
        if not isinstance(names, (list, tuple)) or not all(n is None or (isinstance(n, str) and n) for n in names):
            raise ValueError("lora_path must be a loaded adapter's name, or a list with one per prompt (None: the "
                             "base weights)")
        if len(names) != num_prompts:
            raise ValueError(f"got {len(names)} lora_path entries for {num_prompts} prompts; give one per prompt")
        return list(names)

    @staticmethod
    def _session_ids(session_id, num_prompts: int, logprob_start_len: int) -> list[Optional[str]]:
        """Per prompt, the session it is a turn of (None: an ordinary request). One id: a single prompt
        (the tokens it appends); a list: one entry per prompt, each a different session."""
        if session_id is None:
            return [None] * num_prompts
        ids = [session_id] if isinstance(session_id, str) else session_id
        if not isinstance(ids, (list, tuple)) or not all(s is None or (isinstance(s, str) and s) for s in ids):
            raise ValueError("session_id must be a non-empty string, or a list of them (None: no session) "
                             "with one entry per prompt")
        if len(ids) != num_prompts:
            raise ValueError(f"{len(ids)} session ids for {num_prompts} prompts: a session turn is one prompt (the "
                             f"tokens it appends); pass one id per prompt")
        named = [s for s in ids if s is not None]
        if len(set(named)) != len(named):
            raise ValueError("a session takes one turn at a time: a session id appears twice in this call")
        if named and logprob_start_len != -1:
            raise ValueError("a session turn returns no prompt logprobs (logprob_start_len must be -1): its "
                             "prompt is the session's history")
        return list(ids)

    def make_score_requests(self, prompt_ids, output_ids, sampling_params, return_sampling_mask: bool,
                            top_logprobs_num: int, rid) -> list[Request]:
        """Replayed scoring: score given output tokens after given prompts under ``sampling_params``,
        as generation would have (a prefill-only request over prompt + outputs)."""
        prompts = self.prompt_ids(None, prompt_ids)
        outputs = self.prompt_ids(None, output_ids) if output_ids and not isinstance(output_ids[0], int) \
            else [list(output_ids or [])]
        if len(outputs) != len(prompts):
            raise ValueError(f"got {len(outputs)} output_ids lists for {len(prompts)} prompts")
        if any(not o for o in outputs):
            raise ValueError("every output_ids list needs at least one token to score")
        empty = next((i for i, p in enumerate(prompts) if not p), None)
        if empty is not None:
            raise ValueError(f"prompt {empty} is empty: a scored token needs the context before it")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        params = [SamplingParams.from_dict(p) if isinstance(p, dict) else p for p in params]
        if any(p.n != 1 for p in params if isinstance(p, SamplingParams)):
            raise ValueError("scoring takes one output per prompt: n must be 1")
        full = [p + o for p, o in zip(prompts, outputs)]
        scoring = [replace(p, max_new_tokens=0, min_new_tokens=0) if isinstance(p, SamplingParams) else p
                   for p in params]
        reqs = self.make_requests(None, full, scoring, True, top_logprobs_num, 0, rid,
                                  return_sampling_mask=return_sampling_mask)
        for req, prompt, sp in zip(reqs, prompts, params):
            req.score_from = len(prompt)
            req.score_params = sp.resolved(self.defaults).for_vocab(self.vocab_size, self.eos_ids)
            req.logprob_start_len = len(prompt)
            req.next_input_logprob_pos = len(prompt) - 1
            req.input_logprobs, req.input_top_logprobs, req.input_ranks = [], [], []
        return reqs

    def _check_step_form(self, req: Request, i: int) -> None:
        """Build this request's sampling row exactly as a step will (on the CPU): what cannot be
        turned into the step's tensors, or turns into non-finite values, fails here."""
        try:
            info = SamplingInputs.from_seqs(req.seqs[:1], self.eos_ids, self.config.outputs.logprob_mode == "raw")
            dev = info.to_device(self.vocab_size, torch.device("cpu"))
        except (RuntimeError, OverflowError, ValueError, TypeError, IndexError) as exc:
            raise ValueError(f"prompt {i}: its sampling parameters cannot be run ({exc})") from None
        for name in ("temperatures", "top_ps", "min_ps"):
            t = getattr(dev, name)
            if t is not None and not bool(torch.isfinite(t).all()):
                raise ValueError(f"prompt {i}: SamplingParams.{name[:-1]} is not finite in float32")

    def to_output(self, req: Request, seq: Sequence, current_version: str) -> RolloutOutput:
        if req.score_from is not None:
            return self._score_output(req, seq, current_version)
        text = seq.text
        if text is None and self.detokenize is not None:
            ids = seq.output_ids
            if seq.finish_reason == "stop" and isinstance(seq.matched_stop, int) and not req.params.no_stop_trim:
                ids = ids[:-1]  # SGLang trims the stop token's text unless no_stop_trim
            text = self.detokenize(ids, req.params.skip_special_tokens)
        end = req.finish_time if seq.is_finished and req.finish_time else time.perf_counter()
        return RolloutOutput(
            rid=req.rid, prompt_index=req.prompt_index, sample_index=seq.sample_index,
            prompt_token_ids=list(req.prompt_ids), output_token_ids=list(seq.output_ids),
            output_logprobs=list(seq.output_logprobs), text=text,
            output_top_logprobs=list(seq.output_top_logprobs),
            input_logprobs=list(req.input_logprobs), input_top_logprobs=list(req.input_top_logprobs),
            input_ranks=list(req.input_ranks) if len(req.input_ranks) == len(req.input_logprobs) else [],
            finish_reason=seq.finish_reason, matched_stop=seq.matched_stop, stop_text_offset=seq.stop_text_offset,
            logprob_mode=self.config.outputs.logprob_mode,
            weight_version=seq.output_versions[-1] if seq.output_versions else current_version,
            output_weight_versions=list(seq.output_versions), num_cached_tokens=seq.num_cached_tokens,
            output_token_sampling_mask=list(seq.output_sampling_masks),
            output_token_sampling_logprobs=list(seq.output_sampling_logprobs),
            num_preemptions=seq.num_preemptions,
            **({} if not self.config.speculative.num_draft_tokens else {
                "spec_verify_ct": seq.spec_verify_ct, "spec_draft_token_num": seq.spec_draft_token_num,
                "spec_accept_token_num": seq.spec_accept_token_num}),
            time_to_first_token_s=(seq.first_token_time - req.arrival_time) if seq.first_token_time else None,
            latency_s=end - req.arrival_time, lora_name=req.lora_name,
            lora_version=req.lora.version if req.lora is not None else None,
            routed_experts=seq.routed_experts,
            routed_experts_start_len=seq.routed_experts_start_len,
        )

    def _score_output(self, req: Request, seq: Sequence, current_version: str) -> RolloutOutput:
        outputs = req.prompt_ids[req.score_from:]
        text = self.detokenize(outputs, req.score_params.skip_special_tokens) if self.detokenize else None
        return RolloutOutput(
            rid=req.rid, prompt_index=req.prompt_index, sample_index=0, prompt_token_ids=req.prompt_ids[:req.score_from],
            output_token_ids=list(outputs), output_logprobs=list(req.input_logprobs), text=text,
            output_top_logprobs=list(req.input_top_logprobs), finish_reason=seq.finish_reason,
            logprob_mode=self.config.outputs.logprob_mode, weight_version=current_version,
            output_weight_versions=[current_version] * len(outputs), num_cached_tokens=seq.num_cached_tokens,
            output_token_sampling_mask=list(req.score_masks),
            output_token_sampling_logprobs=list(req.score_sampling_logprobs),
            latency_s=(req.finish_time or time.perf_counter()) - req.arrival_time)

    def outputs(self, reqs: list[Request], current_version: str) -> list[RolloutOutput]:
        """Every sample of every request, prompt-major; a failed request raises its error."""
        errors: list[Optional[BaseException]] = [r.error for r in reqs if r.error is not None]
        if errors:
            if isinstance(errors[0], ValueError):  # the request itself was refused: say so as it is
                raise errors[0]
            raise RuntimeError(f"generation failed: {errors[0]!r}") from errors[0]
        return [self.to_output(r, s, current_version) for r in reqs for s in r.seqs]
