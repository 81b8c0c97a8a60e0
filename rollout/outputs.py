"""The engine's public results: ``RolloutOutput``, one finished (or partial, when streamed or aborted)
sample, and ``WeightResult``, the result of every weight operation (on a rank and at the public API)."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

import torch


@dataclass
class RolloutOutput:
    rid: str
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_logprobs: list[float]  # one per output token (empty when return_logprob=False)
    text: Optional[str] = None  # None when the engine has no tokenizer
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: list[Optional[float]] = field(default_factory=list)  # from logprob_start_len; first may be None
    input_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_ranks: list[Optional[int]] = field(default_factory=list)  # with top logprobs: 1 + tokens more likely
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"; None while running
    matched_stop: Optional[Union[int, str]] = None  # the EOS/stop token id or stop string that ended it
    stop_text_offset: Optional[int] = None  # where the stop string began in the untrimmed text
    logprob_mode: str = "processed"  # "processed" | "raw"
    weight_version: str = "default"
    output_weight_versions: list[str] = field(default_factory=list)  # one per output token
    # with return_sampling_mask: per output token, the sorted ids that survived the processors, and
    # the token's logprob renormalised over them (greedy tokens: the token alone, logprob 0)
    output_token_sampling_mask: list[list[int]] = field(default_factory=list)
    output_token_sampling_logprobs: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache or a shared prefix
    lora_name: Optional[str] = None  # the LoRA adapter it ran on (None: the base weights)
    lora_version: Optional[int] = None  # that adapter's version (1, 2, ... per name), every token's
    num_preemptions: int = 0
    # under speculative decoding (SGLang's meta_info names; None when the engine does not speculate):
    # verify steps run, guessed tokens in them, guesses accepted
    spec_verify_ct: Optional[int] = None
    spec_draft_token_num: Optional[int] = None
    spec_accept_token_num: Optional[int] = None
    time_to_first_token_s: Optional[float] = None
    latency_s: Optional[float] = None
    # with return_routed_experts (MoE models; SGLang's meta_info.routed_experts): the experts each layer routed
    # positions [routed_experts_start_len, prompt + outputs - 1) to, [positions, num_hidden_layers, top_k] int32
    routed_experts: Optional[torch.Tensor] = field(default=None, compare=False)
    routed_experts_start_len: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


# What a rank reports when another rank's vote rejected the update.
REJECTED_ELSEWHERE = "another TP rank rejected the update; nothing was loaded"


@dataclass(frozen=True)
class WeightResult:
    """The result of every weight operation, on a rank and at the public API.

    ``detail`` holds per-phase figures (``receive_s``, ``commit_s``, ``received_in_place_bytes``,
    ``freed_bytes``, ``recaptured``...); ``value`` what a read returns (values, a checksum,
    seconds of a probe). Indexing a result like a dict (``result["success"]``: the fields, then
    ``detail``'s keys) still works, with a ``DeprecationWarning``."""

    success: bool
    message: str
    weight_version: Optional[str] = None  # the version published after the call (unchanged on failure)
    seconds: float = 0.0
    num_bytes: int = 0
    detail: dict = field(default_factory=dict)
    value: Any = None
    # what failed, where a caller must tell it apart: GROUP (the weight-update group broke: rebuild
    # it), BASE (a delta against weights the engine does not hold: push in full); None for a refusal of the
    # input (fix the request) or success
    error_kind: Optional[str] = None

    GROUP: ClassVar[str] = "group"
    BASE: ClassVar[str] = "base"  # a delta's base is not what the engine holds: push in full

    @staticmethod
    def ok(message: str, num_bytes: int = 0, value: Any = None, **detail) -> WeightResult:
        return WeightResult(True, message, num_bytes=num_bytes, detail=detail, value=value)

    @staticmethod
    def fail(message: str, kind: Optional[str] = None, **detail) -> WeightResult:
        return WeightResult(False, message, detail=detail, error_kind=kind)

    def published(self, weight_version: str, seconds: float) -> WeightResult:
        """This result as the engine reports it: with the version now published and the wall time."""
        return dataclasses.replace(self, weight_version=weight_version, seconds=seconds)

    @staticmethod
    def merge(results: list[WeightResult]) -> WeightResult:
        """One result for the TP group: rank 0's, or the first rank's failure (naming the rank), or a
        rank's that says its part is still pending (``detail["pending"]``)."""
        failed = [(rank, r) for rank, r in enumerate(results) if not r.success]
        if failed:  # the rank that rejected the update, not one that only learnt another did
            rank, r = next(((k, f) for k, f in failed if f.message != REJECTED_ELSEWHERE), failed[0])
            return r if rank == 0 else dataclasses.replace(r, message=f"TP rank {rank}: {r.message}")
        return next((r for r in results if r.detail.get("pending")), results[0])

    def __getitem__(self, key: str) -> Any:
        warnings.warn(f"WeightResult[{key!r}] is deprecated: read the result's fields (.success, .message, "
                      f".detail[...])", DeprecationWarning, stacklevel=2)
        if key in _FIELDS:
            return getattr(self, key)
        return self.detail[key]

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: str) -> bool:
        return key in _FIELDS or key in self.detail


_FIELDS = frozenset(f.name for f in dataclasses.fields(WeightResult))
