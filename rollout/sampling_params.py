"""``SamplingParams``: what a request asks of the sampler and the stop logic.

Unset fields (None) take the model's ``generation_config.json`` defaults when the engine allows
it, else neutral values. Every invalid value raises ``ValueError`` naming the field.

Every number must survive the step's float32 / int64 form: non-finite values and values past
float32's range are refused (a Python int such as ``10**400`` is not a float at all). Defined
rather than refused: a temperature below ``GREEDY_BELOW`` (1e-5, vLLM's rule) is greedy, since it
would be 0 or subnormal in float32; a ``top_k`` of the vocabulary size or more keeps every token;
top-p always keeps the most likely token (so ``top_p=1e-300``, 0 in float32, is greedy-like, not
empty).

The fields are SGLang's (``sglang.srt.sampling.sampling_params``), and ``from_dict`` reads a dict as
SGLang does: ``null`` means the default; ``sampling_seed`` is SGLang's name for ``seed``. Fields for
features this engine does not have (constrained decoding, stop regexes) are accepted at their
neutral value and refused with a clear error when set; ``custom_params`` feeds only a custom logit
processor (refused), and ``stream_interval`` is accepted (streams send every step); unknown names
are refused, as SGLang refuses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Optional, Union

NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (float32 would make them 0 or subnormal)
MAX_LOGIT_BIAS = 1e30  # |bias| above this could overflow float32 logits to inf
FLOAT32_MAX = 3.4028234663852886e38
UNSUPPORTED = {  # SGLang sampling fields whose feature this engine does not have
    "json_schema": "constrained decoding (json_schema, regex, ebnf, structural_tag) is not supported",
    "regex": "constrained decoding (json_schema, regex, ebnf, structural_tag) is not supported",
    "ebnf": "constrained decoding (json_schema, regex, ebnf, structural_tag) is not supported",
    "structural_tag": "constrained decoding (json_schema, regex, ebnf, structural_tag) is not supported",
    "stop_regex": "stop regexes are not supported: pass stop strings (stop) or stop_token_ids",
}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    n: int = 1
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    # SGLang's: keep the matched stop string (or stop token's text) at the end of the text
    no_stop_trim: bool = False
    # SGLang's; only slow (Python) tokenizers use it, and every tokenizer loaded here is a fast one
    spaces_between_special_tokens: bool = True
    stream_interval: Optional[int] = None
    custom_params: Optional[dict] = None
    # ours: False keeps this request out of speculation (an engine started with
    # speculative_num_draft_tokens > 0 verifies guesses only for requests that leave it True); the tokens
    # are the same either way
    speculative: bool = True
    # SGLang fields of features this engine does not have: accepted unset, refused when set
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None
    stop_regex: Optional[Union[str, list[str]]] = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        for name in UNSUPPORTED:
            if getattr(self, name) is not None:
                bad(name, UNSUPPORTED[name])
        for name in ("no_stop_trim", "spaces_between_special_tokens", "skip_special_tokens", "ignore_eos",
                     "speculative"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")
        if self.stream_interval is not None and not (_is_int(self.stream_interval) and self.stream_interval >= 1):
            bad("stream_interval", "must be an integer >= 1")
        if self.custom_params is not None and not isinstance(self.custom_params, dict):
            bad("custom_params", "must be an object")

        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            bad("max_new_tokens", "must be an integer >= 0")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            bad("min_new_tokens", "must be an integer in [0, max_new_tokens]")
        if self.temperature is not None and not (_is_num(self.temperature) and 0 <= self.temperature <= FLOAT32_MAX):
            bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if self.top_p is not None and not (_is_num(self.top_p) and 0 < self.top_p <= 1):
            bad("top_p", "must be in (0, 1]")
        if self.top_k is not None and not (_is_int(self.top_k) and (self.top_k >= 1 or self.top_k in (0, -1))):
            bad("top_k", "must be >= 1, or -1/0 to disable")
        if self.min_p is not None and not (_is_num(self.min_p) and 0 <= self.min_p <= 1):
            bad("min_p", "must be in [0, 1]")
        if not _is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.n > 1 and self.max_new_tokens == 0:
            bad("n", "must be 1 for a prefill-only request (max_new_tokens=0)")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "must be an integer")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not (isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop)):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if self.stop_token_ids is not None and not (isinstance(self.stop_token_ids, (list, tuple))
                                                    and all(_is_int(t) and t >= 0 for t in self.stop_token_ids)):
            bad("stop_token_ids", "must be a list of token ids >= 0")
        for name in ("frequency_penalty", "presence_penalty"):
            if not (_is_num(getattr(self, name)) and -2 <= getattr(self, name) <= 2):
                bad(name, "must be in [-2, 2]")
        if self.repetition_penalty is not None and not (_is_num(self.repetition_penalty)
                                                        and 0 < self.repetition_penalty <= FLOAT32_MAX):
            bad("repetition_penalty", "must be a finite number > 0 (1 disables it)")
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError, OverflowError):
                bad("logit_bias", "must map token ids to numbers")
            if any(k < 0 for k in self.logit_bias):
                bad("logit_bias", "token ids must be >= 0")
            if not all(abs(v) <= MAX_LOGIT_BIAS for v in self.logit_bias.values()):  # NaN fails this too
                bad("logit_bias", f"values must be finite numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] "
                                  "(use allowed_token_ids to restrict the vocabulary)")
        if self.allowed_token_ids is not None and not (isinstance(self.allowed_token_ids, (list, tuple))
                                                       and self.allowed_token_ids
                                                       and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of token ids >= 0")

    def resolved(self, defaults: Optional[dict] = None) -> SamplingParams:
        """A copy with every optional sampler field concrete: user > ``defaults`` > neutral."""
        defaults = defaults or {}
        values = {k: getattr(self, k) if getattr(self, k) is not None else defaults.get(k, v)
                  for k, v in NEUTRAL.items()}
        if values["top_k"] == 0:
            values["top_k"] = -1
        if values["temperature"] < GREEDY_BELOW:
            values["temperature"] = 0.0
        return replace(self, **values)

    def check_vocab(self, vocab_size: int) -> None:
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name) or []
            if any(t >= vocab_size for t in ids):
                raise ValueError(f"SamplingParams.{name}: token ids must be < vocab size {vocab_size}")
        if self.logit_bias and max(self.logit_bias) >= vocab_size:
            raise ValueError(f"SamplingParams.logit_bias: token ids must be < vocab size {vocab_size}")

    def for_vocab(self, vocab_size: int, eos_ids: tuple[int, ...]) -> SamplingParams:
        """This (resolved) request as the step will run it over ``vocab_size`` tokens: a ``top_k``
        of the vocabulary or more keeps every token; a min_new_tokens mask that would ban every
        allowed token is refused."""
        out = self if self.top_k < vocab_size else replace(self, top_k=-1)
        if self.min_new_tokens > 0 and self.allowed_token_ids:
            banned = set(self.stop_token_ids or ()) | (set() if self.ignore_eos else set(eos_ids))
            if set(self.allowed_token_ids) <= banned:
                raise ValueError("SamplingParams.allowed_token_ids: with min_new_tokens > 0 every allowed token is a "
                                 "stop token, so nothing could be sampled; allow another token or drop min_new_tokens")
        return out

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        """A dict as SGLang reads one: ``null`` is the default, ``sampling_seed`` is ``seed``,
        ``stop_token_ids`` may hold ``null`` entries (dropped); unknown names are refused."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if v is not None}
        if "sampling_seed" in d:
            if "seed" in d and d["seed"] != d["sampling_seed"]:
                raise ValueError("sampling_seed and seed are the same parameter (SGLang's and ours): pass one")
            d["seed"] = d.pop("sampling_seed")
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known | {'sampling_seed'})}")
        if isinstance(d.get("stop_token_ids"), list):
            d["stop_token_ids"] = [t for t in d["stop_token_ids"] if t is not None] or None
        return cls(**d)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    """A real number that is finite as a float (an int beyond float range is not)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False
