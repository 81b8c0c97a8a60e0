"""``EngineConfig``: every engine option, validated at construction (unknown keys are errors); and
``InputError``, the one exception type for bad input anywhere in the engine.

``InputError``: validation anywhere (a sampling field, a chat template's variables, an adapter's rank or
pattern, an announced tensor size, a session id) raises it with a message naming what to fix. The server
maps it to 400 in every route family, whatever it stands for (a ``re.error``, a template that refuses a
conversation...): one type, so no route's list of caught classes can miss one. It is a ``ValueError``, so
callers that caught ``ValueError`` for bad input still do."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from rollout.kernels.cpu.plan import KERNELS as _GEMM_KERNELS


class InputError(ValueError):
    """Bad input, named in the message; nothing was changed by the call that raised it."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def auto_device() -> torch.device:
    """``device="auto"``: CUDA when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class EngineConfig:
    model_path: str
    tp_size: int = 1
    dtype: str = "auto"  # auto: the checkpoint's (float16 becomes bfloat16 on CPU)
    device: str = "auto"  # auto: cuda when available, else cpu
    seed: int = 0
    max_num_seqs: int = 256  # sequences in one batch
    # requests waiting to start at most (SGLang's name); past it a request fails at once with
    # QueueFullError (the server: 503) instead of queueing without bound. None: no bound
    max_queued_requests: Optional[int] = None
    max_num_batched_tokens: int = 4096  # tokens in one forward; longer prompts are chunked
    kv_cache_tokens: Optional[int] = None  # KV pool size in tokens; None: from kv_cache_memory_fraction
    kv_cache_memory_fraction: float = 0.15  # of free device memory (CPU: available RAM)
    block_size: int = 16
    max_model_len: Optional[int] = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    logprob_mode: str = "processed"  # "processed" | "raw"
    weight_version: str = "default"
    use_generation_config: bool = True  # unset sampling fields take generation_config.json values
    tokenizer_path: Optional[str] = None  # None: model_path; no tokenizer there -> token ids only
    enable_overlap: bool = False
    enable_cuda_graph: bool = True  # CUDA only: capture decode graphs (eager on CPU)
    cuda_graph_max_bs: int = 256
    # CUDA: wait for the device before reading a step's forward and sampling times, so that the
    # stats split a step by what the GPU spent (a replayed graph returns at once, and its time
    # otherwise lands in the sampler's first read); loses the host's run-ahead — for benchmarks
    sync_step_timing: bool = False
    request_timeout_s: Optional[float] = None  # generate() waits at most this long (None: forever)
    # An update call (tensors or distributed) that arrives while generation is paused stages into a
    # transaction published at continue_generation, so the bucket calls of one update (slime, AReaL:
    # pause -> buckets -> continue) are never half-visible; staging holds a second copy of what it
    # stages (the shadow weights). False: each call is applied as it arrives, as SGLang does.
    stage_paused_updates: bool = True
    launch: str = "auto"  # TP>1: "spawn" worker processes, or "external" (ranks of the caller's job); auto picks
    # CPU: each linear layer runs the GEMM kernel measured fastest on this machine for the forward's
    # number of rows (rollout.kernels.cpu.plan): oneDNN over a packed copy in the weight dtype, oneDNN
    # over an fp32 copy of bf16 weights (the fast path from a few rows up where the CPU has no native
    # bf16; +2x the weight bytes), the project's C++ kernel that reads bf16 weights in place (small
    # batches) or its register-tiled C++ GEMM over fp32 panels of the weights (a copy, as fp32's).
    # Copies are rebuilt lazily after every weight change. cpu_packed_weights=False: plain
    # F.linear everywhere. cpu_fp32_gemm_rows: fp32 copies only from this many rows (None: measured;
    # 0: never); cpu_small_gemm_rows: the C++ kernel (bf16 or fp32 weights) only up to this many rows
    # (None: measured; 0: never). cpu_gemm_kernel: one kernel at every row count, nothing measured
    # (linear, onednn, fp32, own, tiled; None: measured) — to pin or test a path.
    cpu_packed_weights: bool = True
    cpu_fp32_gemm_rows: Optional[int] = None
    cpu_small_gemm_rows: Optional[int] = None
    cpu_gemm_kernel: Optional[str] = None
    # CPU: decode attention reads KV blocks in place (C++ built on first use with the machine's
    # compiler, then cached) instead of gathering them for SDPA; machines without a compiler keep
    # the gather path
    cpu_paged_attention: bool = True
    # CPU: RMSNorm in one C++ call per norm (rollout.kernels.cpu.ops) instead of five torch operators
    cpu_fused_norm: bool = True
    # CPU decode steps: rotary and the K/V cache write in one C++ call per layer (rollout.kernels.cpu.ops)
    # instead of four rotary operators and two index_copy_ (the same bits)
    cpu_fused_rope: bool = True
    # CPU: the sampler's inverse-CDF draw and its logprob in one C++ call (rollout.kernels.cpu.ops)
    # instead of max / subtract / exp / cumsum / search over the vocabulary
    cpu_fused_sampler: bool = True
    # CPU: the MLP's silu(gate) * up in one C++ call (rollout.kernels.cpu.ops) instead of two operators
    cpu_fused_silu: bool = True
    # CPU decode steps: each decoder layer in one C++ call (rollout.kernels.cpu.fused) where the fused norm,
    # rotary/cache write, SiLU and paged attention are all on (the same kernels, the same bits)
    cpu_fused_layer: bool = True
    # CPU decode steps of the few rows where every linear takes the C++ small-batch kernel (1-3 rows on
    # most CPUs, up to 8 with AVX512-BF16): all decoder layers in one C++ call with one team of threads
    # for the whole stack, which meet at spin barriers between kernels instead of starting a parallel
    # region per kernel (the same bits)
    cpu_fused_stack: bool = True
    # CPU: forwards drop to one thread while another process computes on this process's cores (the
    # kernel's run delay says so) and return to all of them when it stops (rollout.executor.cpu_threads):
    # beside a computing process (a trainer, a client) its team's barriers wait on threads off their
    # cores. None: on for bf16 engines, whose tokens and logprobs are the same bits on one thread as on
    # two (measured: SmolLM2 generations with prompt logprobs, prompts of 5-700 tokens, decode at 1-72
    # rows), off for fp32 ones, whose logprobs move in their last bits with the thread count (the fp32
    # exactness checks compare them across processes), and off in the batch-invariant mode (`deterministic`,
    # whose bits must not move with the machine's load; at TP=2 they did)
    cpu_adapt_threads: Optional[bool] = None
    deterministic: bool = False  # batch-invariant: every token in a forward of its own (bitwise, much slower)
    return_sampling_mask: bool = False  # every request returns sampling masks (per-request switch in generate)
    max_sampling_mask_size: int = 4096  # a sampled token whose kept set is larger fails its request
    tp_timeout_s: float = 30.0  # rendezvous and every TP collective: a dead or hung rank fails within this
    # a session (multi-turn history and its KV) idle this long is closed; None: never
    session_timeout_s: Optional[float] = 600.0
    max_sessions: int = 4096  # open sessions at most (each holds a history); one more is refused
    # LoRA (SGLang's names): adapter versions resident at most (one slot each; a version replaced by a
    # newer one stays resident while requests that started on it run), the largest rank accepted, and
    # a budget for the adapters' bytes on each rank (None: no budget beyond the slots)
    max_loaded_loras: int = 8
    max_lora_rank: int = 64
    max_lora_memory_mb: Optional[float] = None
    # how adapter terms are computed (SGLang's name): "triton" — one segmented kernel per linear for
    # every adapter in the batch (rollout.kernels.triton.lora; CUDA, or a CPU under TRITON_INTERPRET=1),
    # "torch" — two GEMMs per adapter over its rows; "auto": triton on CUDA, torch on CPU
    lora_backend: str = "auto"
    # AReaL's adapter names: loading "<name>-v<N>" replaces "<name>-v<M>" (M < N) — retired like a
    # replaced version, its name routed to the newest (rollout.scheduler.lora_registry)
    lora_versioned_names: bool = True
    # exact speculative decoding from past rollouts (rollout.speculative): up to this many guessed tokens
    # verified per step and sequence (SGLang's speculative_num_draft_tokens; 0: off), never while more than
    # ``speculative_max_batch`` sequences decode, and below that only as far as the measured cost of a
    # step's rows and each sequence's acceptance say it pays
    speculative_num_draft_tokens: int = 0
    speculative_max_batch: int = 64
    # "cost": guesses only where the measured costs and acceptance say they pay; "always": every proposal
    # within speculative_max_batch is verified (for studies and tests of the verify step)
    speculative_policy: str = "cost"

    def __post_init__(self) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"engine option {name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            bad("tp_size", "must be an integer >= 1")
        if self.dtype not in ("auto", *_DTYPES):
            bad("dtype", f"must be one of auto, {', '.join(_DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            bad("device", "must be auto, cpu, cuda or cuda:N")
        for name in ("cpu_fp32_gemm_rows", "cpu_small_gemm_rows"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                bad(name, "must be None (measured) or an integer >= 0 (0: never)")
        if self.cpu_gemm_kernel is not None and self.cpu_gemm_kernel not in _GEMM_KERNELS:
            bad("cpu_gemm_kernel", f"must be None (measured) or one of {', '.join(_GEMM_KERNELS)}")
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
        if self.logprob_mode not in ("processed", "raw"):
            bad("logprob_mode", "must be 'processed' or 'raw'")
        if self.launch not in ("auto", "spawn", "external"):
            bad("launch", "must be auto, spawn or external")
        if not self.tp_timeout_s > 0:
            bad("tp_timeout_s", "must be > 0 seconds")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad("max_model_len", "must be >= 2")
        for name in ("speculative_num_draft_tokens", "speculative_max_batch"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool) or \
                    getattr(self, name) < 0:
                bad(name, "must be an integer >= 0")
        if self.speculative_policy not in ("cost", "always"):
            bad("speculative_policy", "must be cost or always")
        if self.lora_backend not in ("auto", "torch", "triton"):
            bad("lora_backend", "must be auto, torch or triton")
        for name in ("max_loaded_loras", "max_lora_rank", "max_sessions"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool) or \
                    getattr(self, name) < 1:
                bad(name, "must be an integer >= 1")
        if self.max_lora_memory_mb is not None and not (isinstance(self.max_lora_memory_mb, (int, float))
                                                        and self.max_lora_memory_mb > 0):
            bad("max_lora_memory_mb", "must be None (no budget) or a number of MB > 0")

    @classmethod
    def from_kwargs(cls, model_path: str, **kwargs) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known - {'model_path'})}")
        return cls(model_path=model_path, **kwargs)

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
