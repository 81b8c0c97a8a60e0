"""``RolloutOutput``: one finished (or partial, when streamed or aborted) sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


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

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)
