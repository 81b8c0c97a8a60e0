"""CUDA graphs for decode (CUDA only; eager on CPU).

``CudaGraphRunner`` captures the decode forward (all sequences with one new token, logits for
every row) for a fixed set of batch sizes, over static input buffers; a batch is padded up to
the next captured size (padding rows write their K/V to a reserved scratch block and attend to
one position) and replayed when it fits. ``capture()`` frees old graphs before capturing new
ones, so a recapture never holds two sets. ``StorageAudit`` records the storage addresses the
graphs depend on (parameters and the KV pool) so callers can tell whether a recapture is needed:
in-place weight updates keep every address; a memory release/resume that moves storage does not.

A step is two parts. ``stage`` is the host's: the batch's block tables, positions and slots computed with
numpy into pinned staging buffers and copied to the static device buffers ``non_blocking`` (no per-row
tensor, no blocking copy, only the block-table columns this step reads). ``run`` is the device's, what a
graph captures: the forward over the static buffers, as a plain decode step (``all_decode``: no row
selection; no mask when the paged kernel reads the cache). Sampling is a graph of its own per batch size,
replayed when the step samples (under overlap, later, with the inputs known then) and only for rows without
processors, masks or top logprobs (``SamplingInputs.fits_static``): ``sample_static`` over the forward
graph's logits, the uniforms drawn on the device from each row's seed and position; two variants, with
and without top-k / top-p / min-p (whose sorts a temperature-only batch does not pay).
``run`` and ``run_sampler`` have no host synchronisation — the suite
runs it on CPU under ``rollout.kernels.audit.StepAudit``, which refuses one and counts its launches.
"""

from __future__ import annotations

import gc
import itertools
import logging
from typing import Optional

import numpy as np
import torch

from rollout.layers.attention import AttentionMetadata
from rollout.layers.sampler import SampleOutput, StaticSampling, masks_of, sample_static

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class StorageAudit:
    """The data pointers and shapes of every tensor a captured graph reads or writes."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.record = {name: (t.data_ptr(), tuple(t.shape)) for name, t in tensors.items()}

    def changed(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        now = {name: (t.data_ptr(), tuple(t.shape)) for name, t in tensors.items()}
        return sorted(n for n in set(now) | set(self.record) if now.get(n) != self.record.get(n))


class CudaGraphRunner:
    def __init__(self, runner, max_batch_size: int, batch_sizes=DEFAULT_BATCH_SIZES):
        """``runner``: the ``ModelRunner`` (its model, KV pool and device). Nothing is captured until
        ``capture()``; off CUDA nothing ever is (``eager``): every step runs the graphs' bodies eagerly —
        how a CPU engine on the CUDA kernel plan runs, and tests, this path."""
        self.runner = runner
        self.batch_sizes = sorted(b for b in batch_sizes if b <= max_batch_size) or [1]
        self.max_bs = self.batch_sizes[-1]
        self.max_blocks = -(-runner.max_model_len // runner.block_size)
        device = runner.device
        self.eager = device.type != "cuda"
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(self.max_bs, self.max_blocks, dtype=torch.long, device=device)
        self.ctx_lens = torch.ones(self.max_bs, dtype=torch.long, device=device)
        # host side: pinned (on CUDA) staging the static buffers are copied from, two sets used in turn; each
        # set's event marks its copies, waited on before the set is written again (two steps later: done)
        pin = device.type == "cuda"
        self._staging = [(torch.zeros(4, self.max_bs, dtype=torch.long, pin_memory=pin),  # pos, slots, ctx, ids
                          torch.zeros(self.max_bs * self.max_blocks, dtype=torch.long, pin_memory=pin),
                          torch.cuda.Event() if pin else None) for _ in range(2)]
        self._turn = 0
        self._rows = torch.arange(self.max_bs, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.sampling = StaticSampling(self.max_bs, device)
        self.raw_logprobs = runner.config.outputs.logprob_mode == "raw"
        # (batch size, with top-k/top-p/min-p, with penalties, with masks) -> graph, and its outputs
        self.sampler_graphs: dict[tuple[int, bool, bool, bool], torch.cuda.CUDAGraph] = {}
        self.sampled: dict[tuple[int, bool, bool, bool], tuple[torch.Tensor, ...]] = {}
        self.last: Optional[tuple[int, int]] = None  # (rows, padded size) of the last forward
        self.pool = None
        self.audit: Optional[StorageAudit] = None

    def graph_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {f"param:{n}": p for n, p in self.runner.model.named_parameters()}
        tensors["kv_buffer"] = self.runner.kv.buffer
        return tensors

    def needs_recapture(self) -> list[str]:
        """Names of tensors whose storage moved since capture (empty: graphs are valid)."""
        return [] if self.audit is None else self.audit.changed(self.graph_tensors())

    def _meta(self, bs: int) -> AttentionMetadata:
        window = self.runner.model_config.sliding_window
        lens = self.ctx_lens[:bs]
        mask = None
        if not self.runner.use_paged_kernel or window is not None:  # the gather + SDPA path reads a mask
            bsz = self.runner.block_size
            keys = torch.arange(self.max_blocks * bsz, device=lens.device).unsqueeze(0)
            mask = keys < lens.unsqueeze(1)
            if window is not None:
                mask &= keys > lens.unsqueeze(1) - 1 - window
            mask = mask.view(bs, 1, 1, -1)
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bs], decode_rows=self._rows[:bs],
                                 decode_blocks=self.block_tables[:bs], decode_mask=mask, decode_ctx_lens=lens,
                                 all_decode=True, use_paged_kernel=self.runner.use_paged_kernel,
                                 sliding_window=window)

    def run(self, bs: int) -> torch.Tensor:
        """The device work of a decode step of ``bs`` rows over the static buffers (what a graph captures):
        logits [bs, vocab]."""
        # the copies the CPU's GEMM plan reads at bs rows (a padded batch: the forward refreshed its own count;
        # none on CUDA)
        self.runner.refresh_packed_weights(bs)
        model = self.runner.model
        hidden = model(self.input_ids[:bs], self.positions[:bs], self.runner.kv.caches, self._meta(bs))
        return model.compute_logits(hidden)

    def run_sampler(self, bs: int, filtered: bool, state=None, masks: bool = False) -> tuple[torch.Tensor, ...]:
        """The device work of sampling the last forward's ``bs`` logits rows (what a sampler graph captures);
        with ``state`` (``PenaltyState``) the penalties from its counts first; with ``masks`` the kept sets."""
        return sample_static(self.outputs[bs], self.sampling, self.raw_logprobs, filtered=filtered, state=state,
                             masks=masks)

    def _capture_sampler(self, bs: int, filtered: bool, state, masks: bool) -> None:
        """The sampler graph of one variant (with penalties or masks: on first use, while serving — so the capture
        is thread-local: under overlap the scheduler's thread reads the last step's tokens meanwhile)."""
        key = (bs, filtered, state is not None, masks)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.run_sampler(bs, filtered, state, masks)  # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                self.sampled[key] = self.run_sampler(bs, filtered, state, masks)
        torch.cuda.current_stream().wait_stream(stream)
        self.sampler_graphs[key] = graph

    def free(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.sampler_graphs.clear()
        self.sampled.clear()
        self.last = None
        self.pool = None
        if not self.eager:
            gc.collect()
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def capture(self) -> None:
        """(Re)capture every batch size; old graphs are freed first so memory never holds two sets."""
        self.free()
        if self.eager:
            return
        scratch = self.runner.kv.scratch_block
        self.block_tables.fill_(scratch)
        self.slot_mapping.fill_(scratch * self.runner.block_size)
        self.ctx_lens.fill_(1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its pool
                for _ in range(2):
                    self.run(bs)  # warm-up (allocator, autotuning) outside the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.outputs[bs] = self.run(bs)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bs] = graph
                for filtered in (False, True):
                    self.run_sampler(bs, filtered)  # warm-up
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        self.sampled[bs, filtered, False, False] = self.run_sampler(bs, filtered)
                    self.sampler_graphs[bs, filtered, False, False] = graph
        torch.cuda.current_stream().wait_stream(stream)
        self.audit = StorageAudit(self.graph_tensors())
        logger.info("captured CUDA graphs for batch sizes %s", self.batch_sizes)

    recapture = capture

    def can_run(self, batch) -> bool:
        return ((self.eager or bool(self.graphs)) and len(batch.q_lens) <= self.max_bs and all(q == 1 for q in batch.q_lens)
                and not batch.input_logprob_idx and len(batch.logits_rows) == len(batch.q_lens)
                and max(len(t) for t in batch.block_tables) <= self.max_blocks)

    def stage(self, batch, future_token_ids: Optional[torch.Tensor] = None) -> tuple[int, int]:
        """The host's part of a decode step: the batch (all q_len == 1) into the static buffers, padded to
        the next captured size (padding rows write to the scratch block and attend to one position). Input
        ids < 0 are the previous step's samples (overlap): read on the device from ``future_token_ids``.
        Returns (n, the padded size)."""
        n = len(batch.q_lens)
        bs = next(b for b in self.batch_sizes if b >= n)
        bsz = self.runner.block_size
        scratch = self.runner.kv.scratch_block
        widths = np.fromiter(map(len, batch.block_tables), dtype=np.int64, count=n)
        width = int(widths.max())
        flat = np.fromiter(itertools.chain.from_iterable(batch.block_tables), dtype=np.int64, count=int(widths.sum()))
        staged, staged_tables, copied = self._staging[self._turn]
        self._turn ^= 1
        if copied is not None:
            copied.synchronize()  # this set's copies of two steps ago are done (they were long since)
        host_tables = staged_tables[: bs * width].view(bs, width)  # contiguous: a non_blocking copy stays one
        tables = host_tables.numpy()
        tables.fill(scratch)
        tables[:n][np.arange(width) < widths[:, None]] = flat
        pos, slots, ctx, ids = staged.numpy()[:, :bs]
        ctx.fill(1)
        ctx[:n] = batch.ctx_lens
        ids.fill(0)
        ids[:n] = batch.input_ids
        np.subtract(ctx, 1, out=pos)
        np.add(tables[np.arange(bs), pos // bsz] * bsz, pos % bsz, out=slots)
        for dst, src in ((self.positions, 0), (self.slot_mapping, 1), (self.ctx_lens, 2), (self.input_ids, 3)):
            dst[:bs].copy_(staged[src, :bs], non_blocking=True)
        if batch.has_placeholders:  # the previous step's tokens, never seen by the host
            raw = self.input_ids[:n]
            raw.copy_(torch.where(raw < 0, future_token_ids[(-raw - 1).clamp(min=0)], raw))
        self.block_tables[:bs, :width].copy_(host_tables, non_blocking=True)
        if copied is not None:
            copied.record()
        return n, bs

    @torch.inference_mode()
    def replay(self, batch, future_token_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Decode ``batch`` (all q_len == 1) with a captured graph; returns logits [B, vocab].

        The logits are a view of the graph's static output: read them (sample) before the next
        replay. The worker samples each step before the next forward is launched, also under
        overlap (one forward thread, in launch order)."""
        n, bs = self.stage(batch, future_token_ids)
        if bs in self.graphs:
            self.graphs[bs].replay()
        else:  # not captured (a CPU test of this path): the same device work, eagerly
            self.outputs[bs] = self.run(bs)
        self.last = (n, bs)
        return self.outputs[bs][:n]

    def samples(self, logits: torch.Tensor, sampling) -> bool:
        """Whether ``sample`` serves these logits and inputs: the last forward's whole output, rows that
        ``sample_static`` handles, the engine's logprob mode."""
        if self.last is None or sampling is None:
            return False
        n, bs = self.last
        out = self.outputs.get(bs)
        return (out is not None and logits.shape[0] == n and logits.data_ptr() == out.data_ptr()
                and len(sampling.temperatures) == n and sampling.fits_static
                and sampling.raw_logprobs == self.raw_logprobs)

    @torch.inference_mode()
    def sample(self, sampling, state=None) -> SampleOutput:
        """Sample the last forward's rows (``samples`` said yes) with the sampler graph: the tokens and
        logprobs ``rollout.layers.sampler.sample`` gives, copied out of the graph's buffers. ``state``: the
        penalty counts, when these rows carry penalty slots."""
        n, bs = self.last
        filtered = sampling.top_ks is not None or sampling.top_ps is not None or sampling.min_ps is not None
        masks = sampling.mask_rows is not None
        key = (bs, filtered, state is not None, masks)
        self.sampling.stage(sampling, bs)
        if not self.eager and key not in self.sampler_graphs and bs in self.graphs:
            self._capture_sampler(bs, filtered, state, masks)
        if key in self.sampler_graphs:
            self.sampler_graphs[key].replay()
            outs = self.sampled[key]
        else:
            outs = self.run_sampler(bs, filtered, state, masks)
        out = SampleOutput(token_ids=outs[0][:n].clone(), logprobs=outs[1][:n].clone())
        if masks:  # the kept sets read back (one sync, as the eager sampler's), and the renormalised logprobs
            rows = torch.tensor(sampling.mask_rows, dtype=torch.long, device=outs[2].device)
            out.masks = masks_of(outs[2].index_select(0, rows), sampling.max_mask_size)
            out.sampling_logprobs = outs[3][:n].clone()
        return out
