"""``ModelRunner``: build and load the model on one rank, run the forward, sample, score.

The memory it works on is held by objects of their own: the parameters by ``ParameterStorage``
(one flat buffer per dtype, the shadow for all-or-nothing updates, release/resume), the KV cache
by ``KvPool`` (one buffer for all layers); the sampler's math lives in ``rollout.layers.sampler``.
The runner keeps what ties them to the forward: the CPU kernels' weight copies (rebuilt lazily
after every weight change), decode CUDA graphs, and the order of a release or resume.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn

from rollout.batch import ModelWorkerBatch, SamplingInputs, penalty_capacity
from rollout.config import EngineConfig
from rollout.executor.cpu_threads import ThreadGovernor
from rollout.executor.kv_pool import KvPool, kv_bytes_per_token, kv_tokens_for_utilization, num_kv_blocks
from rollout.executor.param_storage import ParameterStorage, return_free_heap_to_os
from rollout.kernels.cpu import build as cpu_build
from rollout.kernels.cpu.capability import cpu_capability
from rollout.kernels.cpu.invariant import gemm_kernel as invariant_gemm_kernel
from rollout.kernels.cpu.packing import COPY_KERNELS, GemmPlan, PackedWeight, pack_weight
from rollout.kernels.cpu.plan import GemmPlans, plan_gemms
from rollout.layers.attention import AttentionMetadata, build_attention_metadata
from rollout.layers.linear import ColumnParallelLinear, RowParallelLinear
from rollout.layers.lora import LoraBatch, LoraContext
from rollout.layers.moe import attach_routing_record
from rollout.layers.rotary import RotaryEmbedding
from rollout.layers.sampler import (
    PenaltyState,
    SampleOutput,
    SamplingBatchInfo,
    sample,
    sample_one_by_one,
    score_processed,
    temperature_logprobs,
)
from rollout.layers.vocab_embedding import ParallelLMHead
from rollout.models import ModelConfig, build_model
from rollout.weights.loader import LoadReport, apply_load, coverage, covers_all, plan_load, weight_name_map
from rollout.weights.lora import lora_layers
from rollout.weights.safetensors_io import PinnedFolder, SafetensorsFolder

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
        # the batch-invariant mode: every row attended as a decode token over its own context (per_row)
        positions, meta = build_attention_metadata(batch.block_tables, batch.ctx_lens, batch.q_lens,
                                                   runner.block_size, device, runner.model_config.sliding_window,
                                                   ragged=runner.kernels.triton and not runner.row_invariant,
                                                   per_row=runner.row_invariant)
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


def _lora_backend(choice: str, device: torch.device) -> str:
    """``lora_backend`` resolved: auto is the batched Triton kernel on CUDA (when Triton is there), torch elsewhere."""
    if choice == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("engine option lora_backend='triton' needs CUDA (or, on a CPU, TRITON_INTERPRET=1 set "
                             "before Triton is imported); use 'auto' or 'torch'")
        if not _has_triton():
            raise ValueError("engine option lora_backend='triton' needs Triton (pip install triton)")
        return "triton"
    return "triton" if choice == "auto" and device.type == "cuda" and _has_triton() else "torch"


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


# the modules whose GEMMs the CPU plan serves (each holds a packed_weight the runner sets and clears)
_GEMM_MODULES = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


def _plan_gemms(config: EngineConfig, model: nn.Module, device: torch.device, dtype: torch.dtype,
                row_invariant: bool = False, triton: bool = False) -> GemmPlans:
    """The CPU GEMM plans for this rank's weight shapes (``rollout.kernels.cpu.plan``); none off the CPU.
    ``row_invariant`` (the batch-invariant mode): one kernel at every row count whose rows do not depend on
    each other (``rollout.kernels.cpu.invariant``: oneDNN in fixed chunks of rows, or the tiled kernel; on the
    CUDA kernel plan, ``triton``, the Triton GEMM of fixed tiles)."""
    layer = model.model.layers[0]
    shapes = [tuple(m.weight.shape) for m in layer.modules() if isinstance(m, _GEMM_MODULES)]
    head = tuple(model.lm_head.weight.shape)
    if row_invariant and triton:  # the CUDA plan's: one Triton GEMM of fixed tiles (rollout.kernels.triton.matmul)
        every = GemmPlan(((1 << 62, "triton"),), "fixed")
        return GemmPlans(tuple((s, every) for s in dict.fromkeys([*shapes, head])))
    if device.type != "cpu":
        return GemmPlans(())
    choice = config.kernels
    if row_invariant:
        kernel = invariant_gemm_kernel(dtype, [*shapes, head])
        if choice.gemm not in (None, kernel):
            raise ValueError(f"engine option kernels.gemm={choice.gemm!r} conflicts with deterministic=True, whose "
                             f"GEMMs are the batch-invariant kernel {kernel!r} at every row count here; leave "
                             "kernels.gemm unset")
        choice = replace(choice, gemm=kernel)
    return plan_gemms(dtype, shapes, len(model.model.layers), choice.fp32_gemm_rows, choice.small_gemm_rows,
                      head_shape=head, kernel=choice.gemm)


def _activation_reserve(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes kept out of the KV pool under ``gpu_memory_utilization``: the sampler's fp32 rows over the
    vocabulary (logits, sorts, cumsums and their indices: ~40 bytes an entry) for the most rows a step holds,
    a prefill chunk's activations (the MLP's widest, a few copies), the penalty counts (made when a request
    first asks for a penalty), and 512 MiB for the graphs and the allocator's slack."""
    item = torch.empty((), dtype=dtype).element_size()
    sampler = config.max_num_seqs * model_config.vocab_size * 40
    chunk = config.max_num_batched_tokens * (4 * model_config.intermediate_size + 8 * model_config.hidden_size) * item
    penalties = (penalty_capacity(config.max_num_seqs) + 1) * model_config.vocab_size * 5  # PenaltyState, if used
    return sampler + chunk + penalties + (512 << 20)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 max_model_len: int):
        self.config = config
        self.model_config = model_config
        self.device, self.dtype = device, dtype
        self.block_size = config.block_size
        # the kernels that serve, decided once: the C++ build exists on this CPU (built here, once per machine)
        built = device.type == "cpu" and cpu_build.kernels() is not None
        self.kernels = config.kernels.resolve(device=device, built=built, tp_size=config.tp_size,
                                              qk_norm=model_config.qk_norm, dtype=dtype,
                                              deterministic=config.deterministic,
                                              moe=bool(model_config.num_experts))
        with torch.device("meta"):
            self.model = build_model(model_config, dtype, self.kernels)
        self.params = ParameterStorage(self.model, device)
        for module in self.model.modules():
            if isinstance(module, RotaryEmbedding):  # derived tables: rebuild them for real
                real = RotaryEmbedding(model_config.head_dim, max_model_len, model_config.rope_theta,
                                       model_config.rope_scaling)
                module.cos, module.signed_sin = real.cos.to(device), real.signed_sin.to(device)
        self.name_map = weight_name_map(self.model)  # HF name -> where it lands (parameters never move)
        t0 = time.perf_counter()
        # the operator's model: links are followed (a Hugging Face cache snapshot links to its blobs)
        with PinnedFolder.open(config.model_path) as folder, SafetensorsFolder(folder, follow_links=True) as files:
            self.load_report: LoadReport = apply_load(plan_load(self.name_map, files.tensors()))
        logger.info("loaded %d tensors (%.1f MB) in %.2fs", self.load_report.num_tensors,
                    self.load_report.num_bytes / 1e6, time.perf_counter() - t0)
        self.max_model_len = max_model_len
        self.kv = self._kv_pool()
        self.routing = attach_routing_record(self.model, self.kv.experts) if self.kv.experts is not None else None
        # decode attention from the block cache: Triton's on CUDA; on CPU the C++ kernel (fp32 softmax and
        # sums, one rounding) for every cache dtype, where the kernel plan has it
        self.use_paged_kernel = (device.type == "cuda" and _has_triton()) or self.kernels.paged_attention
        # the batch-invariant mode in one forward a step: every kernel computes a row in an order that does not
        # depend on the batch (one GEMM kernel at every row count, the C++ norms, rotary and paged attention over
        # each row's own context; on the CUDA plan their Triton kernels, decode attention unsplit); where those
        # kernels are not here (no compiler; a sliding window on the CUDA plan), a forward per token instead
        cpu_kernels = built and self.kernels.paged_attention and self.kernels.norm and not self.kernels.triton
        cuda_kernels = self.kernels.triton and model_config.sliding_window is None
        # (a mixture of experts: its per-expert GEMMs take however many rows were routed there: token by token)
        self.row_invariant = config.deterministic and (cpu_kernels or cuda_kernels) and not model_config.num_experts
        self._stack_tensors = self.model.model.stack_tensors  # cleared with the weight copies
        # LoRA: every adaptable linear reads the current forward's adapter rows from one context
        self.lora_context = LoraContext(backend=_lora_backend(config.lora.backend, device), slots=config.lora.max_loaded)
        self.lora_layers = lora_layers(self.model)
        for module in self.lora_layers:
            module.lora.context = self.lora_context
        # CPU GEMM kernels by rows, and the weight copies they read (rebuilt lazily after every change)
        self.gemm_plans = _plan_gemms(config, self.model, device, dtype, self.row_invariant, self.kernels.triton)
        self.weights_generation = 0  # bumped whenever the live weights change
        self._copy_generation: dict[str, int] = {}  # copy kind -> the weights_generation it was built from
        self._refreshed_rows: set[int] = set()  # row counts whose copies exist for this generation
        self._packed_modules = [m for m in self.model.modules() if isinstance(m, _GEMM_MODULES)] \
            if self.gemm_plans.plans and not self.gemm_plans.is_plain else []
        self._drop_packed_weights()
        if device.type == "cpu":
            logger.info("CPU %s; %s GEMMs by weight shape: %s; C++ kernels: %s", cpu_capability().describe(),
                        dtype, self.gemm_plans.describe(), self.kernels.describe())
        # CPU: all of torch's threads alone on the cores, one while another process computes on them
        # (by default for bf16 engines outside the batch-invariant mode: see KernelChoice.adapt_threads)
        self.threads = ThreadGovernor(torch.get_num_threads()) if self.kernels.adapt_threads else None
        # decode forwards replayed from a graph, decode forwards run eagerly (no graph fits, or none), and
        # samplings done by a sampler graph: what /metrics and the benchmarks report
        self.counts = {"num_graph_replays": 0, "num_eager_decode_steps": 0, "num_graph_samples": 0}
        self.penalty_state: Optional[PenaltyState] = None  # per-sequence penalty counts on the device (lazy)
        self.graph_runner = None
        # CUDA: decode graphs (a CPU engine on the CUDA plan: the same runner, bodies eager; none batch-invariant,
        # none of a mixture of experts off the CUDA plan: its per-expert loop reads the routed experts on the host)
        if config.enable_cuda_graph and not config.deterministic and (not model_config.num_experts or self.kernels.triton) \
                and (device.type == "cuda" or self.kernels.triton):
            from rollout.executor.cuda_graph_runner import CudaGraphRunner

            self.graph_runner = CudaGraphRunner(self, min(config.cuda_graph_max_bs, config.max_num_seqs))
            self.graph_runner.capture()

    def _kv_pool(self) -> KvPool:
        """The KV pool: kv_cache_tokens, or what the memory options leave for it (with each slot's routed
        experts beside it where the engine returns them)."""
        config, model_config, device, dtype = self.config, self.model_config, self.device, self.dtype
        layers, kv_heads = model_config.num_hidden_layers, self.model.model.layers[0].self_attn.num_kv_heads
        per_token = kv_bytes_per_token(layers, kv_heads, model_config.head_dim, dtype)
        tokens = config.kv_cache_tokens
        if tokens is None and device.type == "cuda" and config.gpu_memory_utilization is not None:
            tokens = min(kv_tokens_for_utilization(device, config.gpu_memory_utilization, per_token,
                                                   _activation_reserve(config, model_config, dtype)),
                         config.max_num_seqs * self.max_model_len)
        blocks = num_kv_blocks(tokens, self.block_size, per_token, device, config.kv_cache_memory_fraction,
                               config.max_num_seqs * self.max_model_len)
        return KvPool(layers, blocks, self.block_size, kv_heads, model_config.head_dim, dtype, device,
                      model_config.num_experts_per_tok if config.outputs.return_routed_experts else 0)

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
        if self._stack_tensors is not None:
            self._stack_tensors.clear()
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
        return self.kv.max_total_num_tokens

    @torch.inference_mode()
    def forward(self, batch: ModelWorkerBatch, future_token_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run the model over the batch; logits [R, vocab] (fp32) of the requested rows."""
        if self.threads is not None:
            self.threads.before_forward()
        # adapters' low-rank terms are torch GEMMs over the step's rows (not row-invariant): a step that has
        # them runs token by token in the batch-invariant mode (the same kernels at one row: the same bits)
        adapters = batch.lora_slots is not None and any(s >= 0 for s in batch.lora_slots)
        if self.config.deterministic and (not self.row_invariant or adapters):
            self.refresh_packed_weights(1)
            return self._forward_token_by_token(batch, future_token_ids)
        self.refresh_packed_weights(len(batch.input_ids), len(batch.logits_rows))
        if self.graph_runner is not None and batch.lora_slots is None and self.graph_runner.can_run(batch):
            self.counts["num_eager_decode_steps" if self.graph_runner.eager else "num_graph_replays"] += 1
            return self.graph_runner.replay(batch, future_token_ids)
        if all(q == 1 for q in batch.q_lens):
            self.counts["num_eager_decode_steps"] += 1
        fb = ForwardBatch.init_new(batch, self, future_token_ids)
        fb.attn.use_paged_kernel = self.use_paged_kernel
        self.lora_context.batch = LoraBatch.from_sequences(batch.lora_slots, batch.q_lens, self.device)
        try:
            hidden = self.model(fb.input_ids, fb.positions, self.kv.caches, fb.attn)
        finally:
            self.lora_context.batch = None
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
        slots = batch.lora_slots or [-1] * len(batch.q_lens)
        for table, ctx, q, slot in zip(batch.block_tables, batch.ctx_lens, batch.q_lens, slots):
            for j in range(q):
                positions, meta = build_attention_metadata([table], [ctx - q + j + 1], [1], self.block_size,
                                                           self.device, self.model_config.sliding_window)
                meta.use_paged_kernel = self.use_paged_kernel
                self.lora_context.batch = LoraBatch.from_sequences([slot], [1], self.device)
                try:
                    hidden = self.model(input_ids[row: row + 1], positions, self.kv.caches, meta)
                finally:
                    self.lora_context.batch = None
                if row in wanted:
                    logits[row] = self.model.compute_logits(hidden)
                row += 1
        return torch.cat([logits[r] for r in batch.logits_rows]) if batch.logits_rows else \
            torch.empty(0, self.model_config.vocab_size, device=self.device)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, sampling: SamplingInputs) -> SampleOutput:
        state = self._penalty_state(sampling)
        if state is not None and sampling.penalty_inits:
            state.write(sampling.penalty_inits)  # slots whose counts are written afresh from their histories
        slots = None
        if self.graph_runner is not None and self.graph_runner.samples(logits, sampling):
            self.counts["num_graph_samples"] += not self.graph_runner.eager
            out = self.graph_runner.sample(sampling, state)  # the sampler graph over the forward graph's logits
            slots = self.graph_runner.sampling.penalty_slots[: len(sampling.temperatures)]  # staged with it
        elif self.config.deterministic and logits.shape[0] > 1:  # row by row: no kernel sees another row
            out = sample_one_by_one(logits, sampling, self._sampling_info)
        else:
            out = sample(logits, self._sampling_info(sampling))
        if state is not None:  # every row's token into its slot's counts, on the device
            if slots is None:
                slots = torch.tensor(sampling.penalty_slots, dtype=torch.long, device=self.device)
            state.record(slots, out.token_ids)
        return out

    def _penalty_state(self, sampling: SamplingInputs) -> Optional[PenaltyState]:
        """The device's per-sequence penalty counts, made on first use (``rollout.batch.PenaltySlots``)."""
        if sampling.penalty_slots is None:
            return None
        if self.penalty_state is None:
            self.penalty_state = PenaltyState(penalty_capacity(self.config.max_num_seqs), self.model_config.vocab_size,
                                              self.device)
        return self.penalty_state

    def _sampling_info(self, sampling: SamplingInputs) -> SamplingBatchInfo:
        info = sampling.to_device(self.model_config.vocab_size, self.device)
        info.fused_draw = self.kernels.sampler
        info.penalty_state = self.penalty_state
        return info

    @torch.inference_mode()
    def score_processed(self, logits: torch.Tensor, batch: ModelWorkerBatch):
        """Replayed scoring of the batch's scored positions (``rollout.layers.sampler.score_processed``)."""
        idx = torch.tensor(batch.input_logprob_idx, dtype=torch.long, device=self.device)
        targets = torch.tensor(batch.input_logprob_targets, dtype=torch.long, device=self.device)
        return score_processed(logits.index_select(0, idx), targets, self._sampling_info(batch.input_logprob_sampling),
                               raw=self.config.outputs.logprob_mode == "raw", top_n=batch.input_top_logprobs_num)

    @torch.inference_mode()
    def compute_input_logprobs(self, logits: torch.Tensor, batch: ModelWorkerBatch):
        """Logprob of each scored prompt token under logits / temperature -> ([N], top ids, top lps, ranks)."""
        idx = torch.tensor(batch.input_logprob_idx, dtype=torch.long, device=self.device)
        temps = torch.tensor(batch.input_logprob_temps, dtype=torch.float32, device=self.device)
        targets = torch.tensor(batch.input_logprob_targets, dtype=torch.long, device=self.device)
        return temperature_logprobs(logits.index_select(0, idx), temps, targets, batch.input_top_logprobs_num)

    # ------------------------------------------------------------------ memory release / resume

    def release_memory(self, tags, backup_weights: bool = False) -> int:
        """Return the storage of whole buffers to the allocator (and, on CUDA, the driver).

        Parameters and KV views keep their tensor objects: resuming regrows the same storages, so
        nothing else needs rebinding (the storage address may change: the graph audit tells).
        Returns the bytes freed."""
        freed = 0
        if "cuda_graph" in tags and self.graph_runner is not None:
            self.graph_runner.free()
        if "kv_cache" in tags:
            freed += self.kv.release()
        if "weights" in tags and not self.params.released:
            freed += self.weight_copies_nbytes()  # the copies go with the weights
            freed += self.params.release(backup=backup_weights)
            self._weights_changed()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        elif freed:
            return_free_heap_to_os()  # the weight copies are many mid-sized allocations on the heap
        return freed

    def resume_memory(self, tags) -> list[str]:
        """Regrow released buffers. Weights come back from their backup if one was kept; else they
        hold nothing valid (``params.valid`` is False) until a full update commits. Returns what
        moved (graphs were then recaptured)."""
        if "weights" in tags and self.params.released:
            self.params.resume()
            self._weights_changed()
        if "kv_cache" in tags:
            self.kv.resume()
        moved = []
        if self.graph_runner is not None and not self.kv.released and not self.params.released:
            moved = self.graph_runner.needs_recapture()
            if moved or "cuda_graph" in tags or not self.graph_runner.graphs:
                self.graph_runner.capture()
        return moved

    # ------------------------------------------------------------------ after an update, readiness

    def after_weights_changed(self, complete: bool, force_recapture: bool = False, names=()) -> bool:
        """Called once a weight update committed on this rank: a complete one makes the weights
        valid again (after a release without backup), as do partial ones (``names``) once together they
        wrote every weight (veRL and slime push a model bucket by bucket); graphs are recaptured only if
        storage moved (or when asked). Returns whether graphs were recaptured."""
        if complete:
            self.params.valid = True
        elif not self.params.valid:
            self.params.rewritten |= coverage(self.name_map, names)
            self.params.valid = covers_all(self.name_map, self.params.rewritten)
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
        released = [t for t, r in (("weights", self.params.released), ("kv_cache", self.kv.released)) if r]
        if released:
            return (f"engine memory is released ({', '.join(released)}): call resume_memory_occupation() "
                    f"before generating")
        if not self.params.valid:
            return ("weights were released without a backup: push a full weight update "
                    "(update_weights_from_tensor/disk/distributed) before generating")
        return None

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.model.named_parameters())

    def weights_nbytes(self) -> int:
        return self.params.nbytes()

    def lora_nbytes(self) -> int:
        """Bytes of the resident LoRA adapters (every slot, this rank's parts)."""
        return sum(m.lora.nbytes() for m in self.lora_layers)

    def kv_nbytes(self) -> int:
        return self.kv.nbytes()

    def describe(self) -> Optional[str]:
        return (f"{self.model_config.architecture} {self.dtype} on {self.device}: "
                f"{self.weights_nbytes() / 1e6:.1f} MB weights, KV pool {self.max_total_num_tokens} tokens "
                f"({self.kv_nbytes() / 1e6:.1f} MB)")
