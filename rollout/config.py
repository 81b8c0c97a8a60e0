"""``EngineConfig``: every engine option, frozen and validated at construction (unknown keys are errors),
grouped as model, memory, scheduling, sampling, weights, parallelism and kernels; LoRA's and speculative
decoding's options are groups of their own (``LoraOptions``, ``SpeculativeOptions``) and the kernels one
``KernelChoice`` (``rollout.kernels.choice``). ``from_kwargs`` takes every option by its flat name (the
groups' fields under SGLang's names: ``max_loaded_loras``, ``speculative_num_draft_tokens`` ...; the old
``cpu_*`` kernel flags, mapped once onto ``kernels`` with a ``DeprecationWarning``). And ``InputError``,
the one exception type for bad input anywhere in the engine.

``InputError``: validation anywhere (a sampling field, a chat template's variables, an adapter's rank or
pattern, an announced tensor size, a session id) raises it with a message naming what to fix. The server
maps it to 400 in every route family, whatever it stands for (a ``re.error``, a template that refuses a
conversation...): one type, so no route's list of caught classes can miss one. It is a ``ValueError``, so
callers that caught ``ValueError`` for bad input still do."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

import torch

from rollout.kernels.choice import DEPRECATED_OPTIONS, KernelChoice


class InputError(ValueError):
    """Bad input, named in the message; nothing was changed by the call that raised it."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def auto_device() -> torch.device:
    """``device="auto"``: CUDA when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class LoraOptions:
    """LoRA (SGLang's names, flat: ``max_loaded_loras``, ``max_lora_rank``, ``max_lora_memory_mb``,
    ``lora_backend``, ``lora_versioned_names``)."""

    # adapter versions resident at most (one slot each; a version replaced by a newer one stays resident
    # while requests that started on it run), the largest rank accepted, and a budget for the adapters'
    # bytes on each rank (None: no budget beyond the slots)
    max_loaded: int = 8
    max_rank: int = 64
    max_memory_mb: Optional[float] = None
    # how adapter terms are computed: "triton" — one segmented kernel per linear for every adapter in the
    # batch (rollout.kernels.triton.lora; CUDA, or a CPU under TRITON_INTERPRET=1), "torch" — two GEMMs per
    # adapter over its rows; "auto": triton on CUDA, torch on CPU
    backend: str = "auto"
    # AReaL's adapter names: loading "<name>-v<N>" replaces "<name>-v<M>" (M < N) — retired like a
    # replaced version, its name routed to the newest (rollout.scheduler.lora_registry)
    versioned_names: bool = True

    def __post_init__(self) -> None:
        for name in ("max_loaded", "max_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"engine option {_flat_name('lora', name)}={value!r}: must be an integer >= 1")
        if self.max_memory_mb is not None and not (isinstance(self.max_memory_mb, (int, float)) and self.max_memory_mb > 0):
            raise ValueError(f"engine option max_lora_memory_mb={self.max_memory_mb!r}: must be None (no budget) or "
                             f"a number of MB > 0")
        if self.backend not in ("auto", "torch", "triton"):
            raise ValueError(f"engine option lora_backend={self.backend!r}: must be auto, torch or triton")


@dataclass(frozen=True)
class SpeculativeOptions:
    """Exact speculative decoding from past rollouts (``rollout.speculative``; flat:
    ``speculative_num_draft_tokens``, ``speculative_max_batch``, ``speculative_policy``): up to
    ``num_draft_tokens`` guessed tokens verified per step and sequence (0: off), never while more than
    ``max_batch`` sequences decode; ``policy`` "cost": only as far as the measured cost of a step's rows and
    each sequence's acceptance say it pays, "always": every proposal within ``max_batch`` (studies, tests)."""

    num_draft_tokens: int = 0
    max_batch: int = 64
    policy: str = "cost"

    def __post_init__(self) -> None:
        for name in ("num_draft_tokens", "max_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"engine option speculative_{name}={value!r}: must be an integer >= 0")
        if self.policy not in ("cost", "always"):
            raise ValueError(f"engine option speculative_policy={self.policy!r}: must be cost or always")


@dataclass(frozen=True)
class OutputOptions:
    """What every request's output carries beyond its tokens (flat, by their own names: ``logprob_mode``,
    ``return_sampling_mask``, ``max_sampling_mask_size``, and SGLang's ``enable_return_routed_experts``)."""

    logprob_mode: str = "processed"  # "processed" | "raw"
    return_sampling_mask: bool = False  # every request returns sampling masks (per-request switch in generate)
    max_sampling_mask_size: int = 4096  # a sampled token whose kept set is larger fails its request
    # MoE models: keep each token's routed experts per layer beside its KV, for requests that ask
    # (return_routed_experts; R3's routing replay reads them)
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if self.logprob_mode not in ("processed", "raw"):
            raise ValueError(f"engine option logprob_mode={self.logprob_mode!r}: must be 'processed' or 'raw'")
        size = self.max_sampling_mask_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"engine option max_sampling_mask_size={size!r}: must be an integer >= 1")


# the groups' fields by their flat option names (SGLang's where it has one)
GROUPS = {"lora": LoraOptions, "speculative": SpeculativeOptions, "kernels": KernelChoice, "outputs": OutputOptions}
_LORA_NAMES = {"max_loaded": "max_loaded_loras", "max_rank": "max_lora_rank", "max_memory_mb": "max_lora_memory_mb",
               "backend": "lora_backend", "versioned_names": "lora_versioned_names"}
_FLAT = {**{flat: ("lora", name) for name, flat in _LORA_NAMES.items()},
         **{f"speculative_{n}": ("speculative", n) for n in SpeculativeOptions.__dataclass_fields__},
         **{f"kernel_{n}": ("kernels", n) for n in KernelChoice.__dataclass_fields__},
         **{n: ("outputs", n) for n in ("logprob_mode", "return_sampling_mask", "max_sampling_mask_size")},
         "enable_return_routed_experts": ("outputs", "return_routed_experts")}


def _flat_name(group: str, field_name: str) -> str:
    return next(flat for flat, where in _FLAT.items() if where == (group, field_name))


@dataclass(frozen=True)
class EngineConfig:
    # model
    model_path: str
    tokenizer_path: Optional[str] = None  # None: model_path; no tokenizer there -> token ids only
    dtype: str = "auto"  # auto: the checkpoint's (float16 becomes bfloat16 on CPU)
    device: str = "auto"  # auto: cuda when available, else cpu
    seed: int = 0
    max_model_len: Optional[int] = None  # None: the model's max_position_embeddings
    use_generation_config: bool = True  # unset sampling fields take generation_config.json values
    # memory
    kv_cache_tokens: Optional[int] = None  # KV pool size in tokens; None: from kv_cache_memory_fraction
    kv_cache_memory_fraction: float = 0.15  # of free device memory (CPU: available RAM)
    # CUDA, vLLM's meaning (SGLang's mem_fraction_static is taken as this): the fraction of the device's
    # memory this engine may hold; the KV pool gets what is left of it after the weights and a reserve for
    # the graphs' and forwards' activations. None: kv_cache_memory_fraction of free memory
    gpu_memory_utilization: Optional[float] = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    # scheduling
    max_num_seqs: int = 256  # sequences in one batch
    # requests waiting to start at most (SGLang's name); past it a request fails at once with
    # QueueFullError (the server: 503) instead of queueing without bound. None: no bound
    max_queued_requests: Optional[int] = None
    max_num_batched_tokens: int = 4096  # tokens in one forward; longer prompts are chunked
    # admission keeps KV free for the running sequences to grow: this share of each one's remaining new
    # tokens (SGLang's new_token_ratio, fixed), so preemption is the exception; 0: admit while the chunk fits
    decode_reserve_ratio: float = 0.3
    enable_overlap: bool = False
    deterministic: bool = False  # batch-invariant: every token in a forward of its own (bitwise, much slower)
    request_timeout_s: Optional[float] = None  # generate() waits at most this long (None: forever)
    # a session (multi-turn history and its KV) idle this long is closed; None: never
    session_timeout_s: Optional[float] = 600.0
    max_sessions: int = 4096  # open sessions at most (each holds a history); one more is refused
    speculative: SpeculativeOptions = SpeculativeOptions()
    # what outputs carry: the logprob mode, sampling masks, routed experts (flat: by their own names)
    outputs: OutputOptions = OutputOptions()
    # weights
    weight_version: str = "default"
    # An update call (tensors or distributed) that arrives while generation is paused stages into a
    # transaction published at continue_generation, so the bucket calls of one update (slime, AReaL:
    # pause -> buckets -> continue) are never half-visible; staging holds a second copy of what it
    # stages (the shadow weights). False: each call is applied as it arrives, as SGLang does.
    stage_paused_updates: bool = True
    # a transaction (begin/start ... publish) with no call for this long was left by its client: aborted at
    # the next lifecycle call, its opener told so (rollout.engine.lifecycle); None: never
    weight_update_timeout_s: Optional[float] = 300.0
    lora: LoraOptions = LoraOptions()
    # parallelism
    tp_size: int = 1
    launch: str = "auto"  # TP>1: "spawn" worker processes, or "external" (ranks of the caller's job); auto picks
    tp_timeout_s: float = 30.0  # rendezvous and every TP collective: a dead or hung rank fails within this
    # kernels
    kernels: KernelChoice = KernelChoice()  # CPU: the fusion ladder, the GEMM plan's bounds (rollout.kernels.choice)
    enable_cuda_graph: bool = True  # CUDA only: capture decode graphs (eager on CPU)
    cuda_graph_max_bs: int = 512  # graphs are captured up to min(this, max_num_seqs) rows
    # CUDA: wait for the device before reading a step's forward and sampling times, so that the
    # stats split a step by what the GPU spent (a replayed graph returns at once, and its time
    # otherwise lands in the sampler's first read); loses the host's run-ahead — for benchmarks
    sync_step_timing: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"engine option {name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            bad("tp_size", "must be an integer >= 1")
        if self.dtype not in ("auto", *_DTYPES):
            bad("dtype", f"must be one of auto, {', '.join(_DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            bad("device", "must be auto, cpu, cuda or cuda:N")
        if self.max_queued_requests is not None and (
                not isinstance(self.max_queued_requests, int) or self.max_queued_requests < 0):
            bad("max_queued_requests", "must be None (no bound) or an integer >= 0")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                bad(name, "must be an integer >= 1")
        if self.kv_cache_tokens is not None and (not isinstance(self.kv_cache_tokens, int) or self.kv_cache_tokens < 1):
            bad("kv_cache_tokens", "must be a positive integer or None")
        if not 0 < self.kv_cache_memory_fraction <= 0.95:
            bad("kv_cache_memory_fraction", "must be in (0, 0.95]")
        if not 0 <= self.decode_reserve_ratio <= 1:
            bad("decode_reserve_ratio", "must be in [0, 1]")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 0.98:
            bad("gpu_memory_utilization", "must be in (0, 0.98] (None: kv_cache_memory_fraction of free memory)")
        if self.launch not in ("auto", "spawn", "external"):
            bad("launch", "must be auto, spawn or external")
        if self.weight_update_timeout_s is not None and not (
                isinstance(self.weight_update_timeout_s, (int, float)) and self.weight_update_timeout_s > 0):
            bad("weight_update_timeout_s", "must be None (never) or a number of seconds > 0")
        if not self.tp_timeout_s > 0:
            bad("tp_timeout_s", "must be > 0 seconds")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad("max_model_len", "must be >= 2")
        if not isinstance(self.max_sessions, int) or isinstance(self.max_sessions, bool) or self.max_sessions < 1:
            bad("max_sessions", "must be an integer >= 1")
        for name, group in GROUPS.items():
            if not isinstance(getattr(self, name), group):
                bad(name, f"must be a {group.__name__} (EngineConfig.from_kwargs takes a dict or the flat options)")

    @classmethod
    def from_kwargs(cls, model_path: str, **kwargs) -> EngineConfig:
        """Options by name: the config's own fields, the groups' fields by their flat names
        (``flat_options()``), a group whole (an instance or a dict of its fields), and the deprecated
        ``cpu_*`` kernel flags (mapped onto ``kernels``, with a warning)."""
        known = {f.name for f in fields(cls)}
        if "mem_fraction_static" in kwargs:  # SGLang's name for the share of the GPU the engine holds
            if kwargs.get("gpu_memory_utilization") is not None:
                raise ValueError("engine options mem_fraction_static and gpu_memory_utilization are one option: "
                                 "give one")
            kwargs = {**kwargs, "gpu_memory_utilization": kwargs["mem_fraction_static"]}
            del kwargs["mem_fraction_static"]
        unknown = sorted(set(kwargs) - known - set(_FLAT) - set(DEPRECATED_OPTIONS))
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known - {'model_path'} | set(_FLAT))}")
        groups: dict[str, dict[str, Any]] = {}
        for name, value in kwargs.items():
            if name in _FLAT:
                group, field_name = _FLAT[name]
                groups.setdefault(group, {})[field_name] = value
        given = {k: v for k, v in kwargs.items() if k in known}
        for name, group in GROUPS.items():
            base = given.get(name)
            if isinstance(base, group):
                base = {f: getattr(base, f) for f in group.__dataclass_fields__}
            elif not isinstance(base, (dict, type(None))):
                raise ValueError(f"engine option {name}={base!r}: a {group.__name__} or a dict of its fields")
            fields_given = {**(base or {}), **groups.get(name, {})}
            unknown_fields = sorted(set(fields_given) - set(group.__dataclass_fields__))
            if unknown_fields:
                raise ValueError(f"engine option {name}: unknown field(s) {unknown_fields}; known: "
                                 f"{sorted(group.__dataclass_fields__)}")
            given[name] = group(**fields_given)
        deprecated = {k: v for k, v in kwargs.items() if k in DEPRECATED_OPTIONS}
        given["kernels"] = given["kernels"].with_deprecated(deprecated)
        return cls(model_path=model_path, **given)

    @staticmethod
    def flat_options() -> dict[str, tuple[str, str]]:
        """The groups' options by flat name -> (group, field): what the CLI and ``from_kwargs`` take."""
        return dict(_FLAT)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return auto_device()
        if str(self.device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but CUDA is not available; use device='cpu'")
        return torch.device(self.device)

    def resolve_dtype(self, checkpoint_dtype: Optional[str], device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        dtype = _DTYPES.get(str(checkpoint_dtype).replace("torch.", ""), torch.float32)
        if dtype == torch.float16 and device.type == "cpu":
            return torch.bfloat16
        return dtype
