"""``ModelRunner``: tensor work only — build and load the model, own the KV pool, run the
forward, sample, score prompt tokens.

Parameters live in one flat buffer per dtype (each parameter a view), and the KV cache in one
buffer for all layers; storage never moves after construction, so later in-place updates keep
every captured pointer valid and memory can be measured and released as whole buffers.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from rollout.batch import ModelWorkerBatch, SamplingInputs
from rollout.config import EngineConfig
from rollout.layers import cpu_build
from rollout.layers.attention import AttentionMetadata, build_attention_metadata
from rollout.layers.cpu_capability import cpu_capability
from rollout.layers.cpu_plan import GemmPlans, plan_gemms
from rollout.layers.layernorm import RMSNorm
from rollout.layers.linear import COPY_KERNELS, LOADER_HOOKS, PackedWeight, RowParallelLinear, pack_weight
from rollout.layers.rotary import RotaryEmbedding
from rollout.layers.sampler import (
    SampleOutput,
    SamplingBatchInfo,
    apply_logit_processors,
    drawn_logprob,
    processed_logits,
    sample,
    sampling_masks,
    token_logprob,
)
from rollout.loader import LoadReport, apply_load, plan_load, weight_name_map
from rollout.models import ModelConfig, build_model
from rollout.safetensors_io import iter_safetensors
from weight_sync.layout import wire_order

logger = logging.getLogger(__name__)


@dataclass
class ForwardBatch:
    """Device-side view of a ``ModelWorkerBatch``."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    logits_rows: torch.Tensor  # [R]

    @staticmethod
    def init_new(batch: ModelWorkerBatch, runner: ModelRunner,
                 future_token_ids: Optional[torch.Tensor] = None) -> ForwardBatch:
        device = runner.device
        positions, meta = build_attention_metadata(batch.block_tables, batch.ctx_lens, batch.q_lens,
                                                   runner.block_size, device, runner.model_config.sliding_window)
        return ForwardBatch(
            input_ids=_input_ids(batch, device, future_token_ids),
            positions=positions,
            attn=meta,
            logits_rows=torch.tensor(batch.logits_rows, dtype=torch.long, device=device),
        )


def _input_ids(batch: ModelWorkerBatch, device: torch.device, future_token_ids: Optional[torch.Tensor]) -> torch.Tensor:
    input_ids = torch.tensor(batch.input_ids, dtype=torch.long, device=device)
    if batch.has_placeholders:  # tokens sampled by the previous step, read on the device
        input_ids = torch.where(input_ids < 0, future_token_ids[(-input_ids - 1).clamp(min=0)], input_ids)
    return input_ids


def _sample_rows(logits: torch.Tensor, sampling: SamplingInputs,
                 to_info: Callable[[SamplingInputs], SamplingBatchInfo]) -> SampleOutput:
    """``sample`` one row at a time (batch-invariant mode), outputs stacked as one batch's."""
    outs = [sample(logits[i: i + 1], to_info(sampling.row(i))) for i in range(logits.shape[0])]

    def cat(name):
        parts = [getattr(o, name) for o in outs]
        return None if parts[0] is None else torch.cat(parts)

    masks = [m for o in outs for m in (o.masks or [])] if sampling.mask_rows is not None else None
    sampling_lp = None
    if sampling.mask_rows is not None:  # rows without a mask report their logprob (never read)
        sampling_lp = torch.cat([o.sampling_logprobs if o.sampling_logprobs is not None else o.logprobs for o in outs])
    return SampleOutput(cat("token_ids"), cat("logprobs"), cat("top_ids"), cat("top_logprobs"), masks, sampling_lp)


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _plan_gemms(config: EngineConfig, model: nn.Module, device: torch.device, dtype: torch.dtype) -> GemmPlans:
    """The CPU GEMM plans for this rank's weight shapes (``rollout.layers.cpu_plan``); plain
    ``F.linear`` off the CPU or with ``cpu_packed_weights=False``."""
    if device.type != "cpu" or not config.cpu_packed_weights:
        return GemmPlans(())
    layer = model.model.layers[0]
    shapes = [tuple(m.weight.shape) for m in layer.modules() if hasattr(m, "packed_weight")]
    return plan_gemms(dtype, shapes, len(model.model.layers), config.cpu_fp32_gemm_rows, config.cpu_small_gemm_rows,
                      head_shape=tuple(model.lm_head.weight.shape), kernel=config.cpu_gemm_kernel)


def _return_free_heap_to_os() -> None:
    """glibc keeps freed mid-sized blocks in its heap (its mmap threshold grows as large blocks are
    freed); ``malloc_trim`` hands the free pages back, so released memory leaves the process."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):  # not glibc: the allocator keeps what it keeps
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def _flatten_parameters(model: nn.Module, device: torch.device) -> dict[torch.dtype, torch.Tensor]:
    """Replace every (meta) parameter by a view into one flat buffer per dtype.

    Tied parameters stay tied (one view for both owners); loader attributes carry over.
    """
    named = list(dict(model.named_parameters()).items())
    # laid out in wire order (biases last within each layer): buckets from a trainer then match
    # this memory as they are (see weight_sync.bucket.wire_order)
    unique = [named[i][1] for i in wire_order([n for n, _ in named])]
    buffers: dict[torch.dtype, torch.Tensor] = {}
    replacement: dict[int, nn.Parameter] = {}
    for dtype in sorted({p.dtype for p in unique}, key=str):
        group = [p for p in unique if p.dtype == dtype]
        flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=device)
        offset = 0
        for p in group:
            new = nn.Parameter(flat[offset: offset + p.numel()].view(p.shape), requires_grad=False)
            for attr in LOADER_HOOKS:
                if hasattr(p, attr):
                    setattr(new, attr, getattr(p, attr))
            replacement[id(p)] = new
            offset += p.numel()
        buffers[dtype] = flat
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = replacement[id(p)]
    return buffers


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 max_model_len: int):
        self.config = config
        self.model_config = model_config
        self.device, self.dtype = device, dtype
        self.block_size = config.block_size
        with torch.device("meta"):
            self.model = build_model(model_config, dtype)
        self.param_buffers = _flatten_parameters(self.model, device)
        for module in self.model.modules():
            if isinstance(module, RotaryEmbedding):  # derived tables: rebuild them for real
                real = RotaryEmbedding(model_config.head_dim, max_model_len, model_config.rope_theta,
                                       model_config.rope_scaling)
                module.cos, module.signed_sin = real.cos.to(device), real.signed_sin.to(device)
        self.name_map = weight_name_map(self.model)  # HF name -> where it lands (parameters never move)
        t0 = time.perf_counter()
        self.load_report: LoadReport = apply_load(plan_load(self.name_map, iter_safetensors(config.model_path)))
        logger.info("loaded %d tensors (%.1f MB) in %.2fs", self.load_report.num_tensors,
                    self.load_report.num_bytes / 1e6, time.perf_counter() - t0)
        self.max_model_len = max_model_len
        self.num_blocks = self._num_kv_blocks(max_model_len)
        self.scratch_block = self.num_blocks  # one block past the pool: padding rows of CUDA graphs write here
        attn = self.model.model.layers[0].self_attn
        # One buffer for all layers: [layers, 2 (k, v), num_blocks + scratch, block_size, kv_heads, head_dim].
        self.kv_buffer = torch.zeros(model_config.num_hidden_layers, 2, self.num_blocks + 1, self.block_size,
                                     attn.num_kv_heads, model_config.head_dim, dtype=dtype, device=device)
        self.kv_caches = [(self.kv_buffer[i, 0], self.kv_buffer[i, 1]) for i in range(model_config.num_hidden_layers)]
        # CPU: the in-place kernel (fp32 softmax and sums, one rounding) for every cache dtype
        cpu_kernels = device.type == "cpu" and cpu_build.kernels() is not None  # the C++ kernels built here
        self.use_paged_kernel = (device.type == "cuda" and _has_triton()) or (cpu_kernels and config.cpu_paged_attention)
        for module in self.model.modules():
            if isinstance(module, RMSNorm):
                module.use_cpu_kernel = cpu_kernels and config.cpu_fused_norm
            if hasattr(module, "fused_rope"):  # decode steps read K/V through the kernel: written by it too
                module.fused_rope = cpu_kernels and config.cpu_fused_rope and self.use_paged_kernel
            if hasattr(module, "fused_act"):
                module.fused_act = cpu_kernels and config.cpu_fused_silu
        self.fused_sampler = cpu_kernels and config.cpu_fused_sampler
        # CPU GEMM kernels by rows, and the weight copies they read (rebuilt lazily after every change)
        self.gemm_plans = _plan_gemms(config, self.model, device, dtype)
        self.weights_generation = 0  # bumped whenever the live weights change
        self._copy_generation: dict[str, int] = {}  # copy kind -> the weights_generation it was built from
        self._refreshed_rows: set[int] = set()  # row counts whose copies exist for this generation
        self._packed_modules = [m for m in self.model.modules() if hasattr(m, "packed_weight")] \
            if self.gemm_plans.plans and not self.gemm_plans.is_plain else []
        self._drop_packed_weights()
        if device.type == "cpu":
            logger.info("CPU %s; %s GEMMs by weight shape: %s; decode attention: %s", cpu_capability().describe(),
                        dtype, self.gemm_plans.describe(), "paged kernel" if self.use_paged_kernel else "gather + SDPA")
        self.kv_released = self.weights_released = False
        self.weights_valid = True  # False after a release without backup, until a full update commits
        self.weights_backup: Optional[dict] = None
        self._shadow: Optional[dict[torch.dtype, torch.Tensor]] = None  # see _shadow_buffer
        self.graph_runner = None
        if device.type == "cuda" and config.enable_cuda_graph:
            from rollout.cuda_graph_runner import CudaGraphRunner

            self.graph_runner = CudaGraphRunner(self, min(config.cuda_graph_max_bs, config.max_num_seqs))
            self.graph_runner.capture()

    def refresh_packed_weights(self, *rows: int) -> None:
        """Build the weight copies that forwards of these row counts read, where the weights changed
        since they were built (the copies are read instead of the weights: never stale)."""
        if not self._packed_modules or self._refreshed_rows.issuperset(rows):
            return
        for m in self._packed_modules:
            packed = m.packed_weight
            kinds = {packed.plan.kernel_for(r) for r in rows if r > 0} & set(COPY_KERNELS)
            missing = {k for k in kinds if not packed.has_copy(k)}
            if missing:
                # a row-parallel bias is added after the reduction, outside the GEMM
                bias = None if isinstance(m, RowParallelLinear) else getattr(m, "bias", None)
                pack_weight(m.weight, bias, packed.plan, missing, into=packed)
                for k in missing:
                    self._copy_generation[k] = self.weights_generation
        self._refreshed_rows.update(rows)

    def copy_generation(self, kind: str) -> Optional[int]:
        """The ``weights_generation`` the ``kind`` copies were built from (None: not built)."""
        return self._copy_generation.get(kind)

    def _drop_packed_weights(self) -> None:
        for m in self._packed_modules:
            m.packed_weight = PackedWeight(self.gemm_plans.for_shape(m.weight.shape))
        self._copy_generation = {}
        self._refreshed_rows = set()

    def _weights_changed(self) -> None:
        """Every change of the live weights ends here: weight copies are dropped (rebuilt lazily)."""
        self.weights_generation += 1
        self._drop_packed_weights()

    def weight_copies_nbytes(self) -> int:
        """Bytes of the weight copies the CPU kernels read (oneDNN-packed, fp32), beside the weights."""
        return sum(m.packed_weight.nbytes() for m in self._packed_modules)

    @property
    def max_total_num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def _kv_bytes_per_token(self) -> int:
        attn = self.model.model.layers[0].self_attn
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.model_config.num_hidden_layers * attn.num_kv_heads * self.model_config.head_dim * elem

    def _num_kv_blocks(self, max_model_len: int) -> int:
        tokens = self.config.kv_cache_tokens
        if tokens is None:
            if self.device.type == "cuda":
                free = torch.cuda.mem_get_info(self.device)[0]
            else:
                import psutil

                free = psutil.virtual_memory().available
            tokens = int(free * self.config.kv_cache_memory_fraction) // self._kv_bytes_per_token()
            tokens = min(tokens, self.config.max_num_seqs * max_model_len)
        return max(2, -(-tokens // self.block_size))

    @torch.inference_mode()
    def forward(self, batch: ModelWorkerBatch, future_token_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run the model over the batch; logits [R, vocab] (fp32) of the requested rows."""
        if self.config.deterministic:
            self.refresh_packed_weights(1)
        else:
            self.refresh_packed_weights(len(batch.input_ids), len(batch.logits_rows))
        if self.config.deterministic:
            return self._forward_token_by_token(batch, future_token_ids)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch, _input_ids(batch, self.device, future_token_ids))
        fb = ForwardBatch.init_new(batch, self, future_token_ids)
        fb.attn.use_paged_kernel = self.use_paged_kernel
        hidden = self.model(fb.input_ids, fb.positions, self.kv_caches, fb.attn)
        return self.model.compute_logits(hidden.index_select(0, fb.logits_rows))

    def _forward_token_by_token(self, batch: ModelWorkerBatch, future_token_ids: Optional[torch.Tensor]):
        """Batch-invariant mode: every token of every sequence in a forward of its own (one row, its
        context exactly its position + 1), so each matmul and attention reduction has the same shape
        whatever the batch, the chunking, the prefix cache or overlap: a token's logits are a
        function of its sequence alone. Costs one forward per token."""
        input_ids = _input_ids(batch, self.device, future_token_ids)
        wanted = set(batch.logits_rows)
        logits: dict[int, torch.Tensor] = {}
        row = 0
        for table, ctx, q in zip(batch.block_tables, batch.ctx_lens, batch.q_lens):
            for j in range(q):
                positions, meta = build_attention_metadata([table], [ctx - q + j + 1], [1], self.block_size,
                                                           self.device, self.model_config.sliding_window)
                meta.use_paged_kernel = self.use_paged_kernel
                hidden = self.model(input_ids[row: row + 1], positions, self.kv_caches, meta)
                if row in wanted:
                    logits[row] = self.model.compute_logits(hidden)
                row += 1
        return torch.cat([logits[r] for r in batch.logits_rows]) if batch.logits_rows else \
            torch.empty(0, self.model_config.vocab_size, device=self.device)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, sampling: SamplingInputs) -> SampleOutput:
        if self.config.deterministic and logits.shape[0] > 1:  # row by row: no kernel sees another row
            return _sample_rows(logits, sampling, self._sampling_info)
        return sample(logits, self._sampling_info(sampling))

    def _sampling_info(self, sampling: SamplingInputs) -> SamplingBatchInfo:
        info = sampling.to_device(self.model_config.vocab_size, self.device)
        info.fused_draw = self.fused_sampler
        return info

    @torch.inference_mode()
    def score_processed(self, logits: torch.Tensor, batch: ModelWorkerBatch):
        """Replayed scoring: each given token's logprob as generation would have reported it (the
        processed distribution; raw for greedy rows or in raw mode), its logprob renormalised over
        the kept set, and the kept sets -> (reported [N], top ids, top lps, sampling lps [N], masks)."""
        idx = torch.tensor(batch.input_logprob_idx, dtype=torch.long, device=self.device)
        targets = torch.tensor(batch.input_logprob_targets, dtype=torch.long, device=self.device)
        rows = logits.index_select(0, idx)
        info = self._sampling_info(batch.input_logprob_sampling)
        x = apply_logit_processors(rows, info)
        dist = processed_logits(rows, info, x)
        greedy = info.temperatures <= 0
        raw_lp = token_logprob(rows, targets)  # the formulas ``sample`` reports with, for equal bits
        processed_lp = drawn_logprob(dist, targets, info)
        picked = raw_lp if self.config.logprob_mode == "raw" else torch.where(greedy, raw_lp, processed_lp)
        argmax = x.argmax(dim=-1)
        sampling_lp = torch.where(greedy, torch.where(targets == argmax, 0.0, float("-inf")), processed_lp)
        masks = None
        if info.mask_rows is not None:
            masks, _ = sampling_masks(x, dist, argmax, sampling_lp, info)
        top_ids = top_lp = None
        if batch.input_top_logprobs_num > 0:
            table = torch.log_softmax(rows, dim=-1)
            if self.config.logprob_mode != "raw":
                table = torch.where(greedy.unsqueeze(1), table, torch.log_softmax(dist, dim=-1))
            top_lp, top_ids = table.topk(min(batch.input_top_logprobs_num, table.shape[-1]), dim=-1)
        return picked, top_ids, top_lp, sampling_lp, masks

    @torch.inference_mode()
    def compute_input_logprobs(self, logits: torch.Tensor, batch: ModelWorkerBatch):
        """Logprob of each scored prompt token under logits / temperature -> ([N], top ids, top lps)."""
        idx = torch.tensor(batch.input_logprob_idx, dtype=torch.long, device=self.device)
        temps = torch.tensor(batch.input_logprob_temps, dtype=torch.float32, device=self.device)
        targets = torch.tensor(batch.input_logprob_targets, dtype=torch.long, device=self.device)
        lp = torch.log_softmax(logits.index_select(0, idx) / temps.unsqueeze(1), dim=-1)
        picked = lp.gather(1, targets.unsqueeze(1)).squeeze(1)
        if batch.input_top_logprobs_num > 0:
            top_lp, top_ids = lp.topk(min(batch.input_top_logprobs_num, lp.shape[-1]), dim=-1)
            return picked, top_ids, top_lp
        return picked, None, None

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=self.device)
        self.kv_buffer.index_copy_(2, dst, self.kv_buffer.index_select(2, src))

    # ------------------------------------------------------------------ shadow weights

    def _shadow_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """The shadow of the live buffer of ``dtype`` (all allocated on first use, kept until the
        weights are released). It has the live buffers' layout; an update that can fail midway (a
        process-group transfer) is written there and becomes live at ``commit_shadow``."""
        if self._shadow is None:
            self._shadow = {d: torch.empty_like(b) for d, b in self.param_buffers.items()}
        return self._shadow[dtype]

    def shadow_view(self, view: torch.Tensor) -> torch.Tensor:
        """The region of the shadow that ``view`` (a view of a live parameter buffer) covers."""
        return self._shadow_buffer(view.dtype).as_strided(view.shape, view.stride(), view.storage_offset())

    def shadow_bytes(self, view: torch.Tensor, nbytes: int) -> Optional[torch.Tensor]:
        """``nbytes`` of the shadow as a byte view, from where ``view`` starts (None past its end)."""
        buf = self._shadow_buffer(view.dtype).view(torch.uint8)
        start = view.storage_offset() * view.element_size()
        return buf[start: start + nbytes] if start + nbytes <= buf.numel() else None

    def prepare_shadow(self) -> None:
        """Make the shadow equal the live weights (before an update that covers only some)."""
        for d, live in self.param_buffers.items():
            self._shadow_buffer(d).copy_(live)

    def commit_shadow(self) -> None:
        """The shadow becomes the live weights. On CPU the two buffers trade their memory (no copy;
        every parameter view follows its storage; the old weights become the next shadow). On
        CUDA it is one device copy per buffer, so graph pointers never move."""
        for d, live in self.param_buffers.items():
            shadow = self._shadow_buffer(d)
            if live.device.type == "cpu" and hasattr(live.untyped_storage(), "_swap_data_ptr_"):
                live.untyped_storage()._swap_data_ptr_(shadow.untyped_storage())
            else:
                live.copy_(shadow)

    # ------------------------------------------------------------------ memory release / resume

    def release_memory(self, tags, backup_weights: bool = False) -> int:
        """Return the storage of whole buffers to the allocator (and, on CUDA, the driver).

        Parameters and KV views keep their tensor objects: resuming regrows the same storages, so
        nothing else needs rebinding (the storage address may change: the graph audit tells).
        Returns the bytes freed."""
        freed = 0
        if "cuda_graph" in tags and self.graph_runner is not None:
            self.graph_runner.free()
        if "kv_cache" in tags and not self.kv_released:
            freed += self.kv_nbytes()
            self.kv_buffer.untyped_storage().resize_(0)
            self.kv_released = True
        if "weights" in tags and not self.weights_released:
            self.weights_backup = {d: b.to("cpu", copy=True) for d, b in self.param_buffers.items()} \
                if backup_weights else None
            freed += self.weights_nbytes() + self.weight_copies_nbytes()  # the copies go with the weights
            self._shadow = None
            for buf in self.param_buffers.values():
                buf.untyped_storage().resize_(0)
            self._weights_changed()
            self.weights_released = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        elif freed:
            _return_free_heap_to_os()  # the weight copies are many mid-sized allocations on the heap
        return freed

    def resume_memory(self, tags) -> list[str]:
        """Regrow released buffers. Weights come back from their backup if one was kept; else they
        hold nothing valid (``weights_valid`` is False) until a full update commits. Returns what
        moved (graphs were then recaptured)."""
        if "weights" in tags and self.weights_released:
            for dtype, buf in self.param_buffers.items():
                buf.untyped_storage().resize_(buf.numel() * buf.element_size())
                if self.weights_backup is not None:
                    buf.copy_(self.weights_backup[dtype])
                else:
                    buf.zero_()
            self.weights_valid = self.weights_backup is not None
            self.weights_backup = None
            self._weights_changed()
            self.weights_released = False
        if "kv_cache" in tags and self.kv_released:
            self.kv_buffer.untyped_storage().resize_(self.kv_buffer.numel() * self.kv_buffer.element_size())
            self.kv_buffer.zero_()  # masked attention multiplies padding by 0: it must hold no NaN
            self.kv_released = False
        moved = []
        if self.graph_runner is not None and not self.kv_released and not self.weights_released:
            moved = self.graph_runner.needs_recapture()
            if moved or "cuda_graph" in tags or not self.graph_runner.graphs:
                self.graph_runner.capture()
        return moved

    # ------------------------------------------------------------------ after an update, readiness

    def after_weights_changed(self, complete: bool, force_recapture: bool = False) -> bool:
        """Called once a weight update committed on this rank: a complete one makes the weights
        valid again (after a release without backup); graphs are recaptured only if storage moved
        (or when asked). Returns whether graphs were recaptured."""
        if complete:
            self.weights_valid = True
        self._weights_changed()
        if self.graph_runner is not None and (force_recapture or self.graph_runner.needs_recapture()):
            self.graph_runner.recapture()
            return True
        return False

    def storage_moved(self) -> list[str]:
        """Parameters/KV whose storage moved since the graphs were captured (empty without graphs)."""
        return self.graph_runner.needs_recapture() if self.graph_runner is not None else []

    def memory_error(self) -> Optional[str]:
        """Why this runner cannot run a forward now (memory released, weights invalid), or None."""
        released = [t for t, r in (("weights", self.weights_released), ("kv_cache", self.kv_released)) if r]
        if released:
            return (f"engine memory is released ({', '.join(released)}): call resume_memory_occupation() "
                    f"before generating")
        if not self.weights_valid:
            return ("weights were released without a backup: push a full weight update "
                    "(update_weights_from_tensor/disk/distributed) before generating")
        return None

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.model.named_parameters())

    def weights_nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.param_buffers.values())

    def kv_nbytes(self) -> int:
        return self.kv_buffer.numel() * self.kv_buffer.element_size()

    def describe(self) -> Optional[str]:
        return (f"{self.model_config.architecture} {self.dtype} on {self.device}: "
                f"{self.weights_nbytes() / 1e6:.1f} MB weights, KV pool {self.max_total_num_tokens} tokens "
                f"({self.kv_nbytes() / 1e6:.1f} MB)")
