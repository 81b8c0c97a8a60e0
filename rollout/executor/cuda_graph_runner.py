"""CUDA graphs for decode (CUDA only; eager on CPU).

``CudaGraphRunner`` captures the decode forward (all sequences with one new token, logits for
every row) for a fixed set of batch sizes, over static input buffers; a batch is padded up to
the next captured size (padding rows write their K/V to a reserved scratch block and attend to
one position) and replayed when it fits. ``capture()`` frees old graphs before capturing new
ones, so a recapture never holds two sets. ``StorageAudit`` records the storage addresses the
graphs depend on (parameters and the KV pool) so callers can tell whether a recapture is needed:
in-place weight updates keep every address; a memory release/resume that moves storage does not.
"""

from __future__ import annotations

import gc
import logging
from typing import Optional

import torch

from rollout.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class StorageAudit:
    """The data pointers and shapes of every tensor a captured graph reads or writes."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.record = {name: (t.data_ptr(), tuple(t.shape)) for name, t in tensors.items()}

    def changed(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        now = {name: (t.data_ptr(), tuple(t.shape)) for name, t in tensors.items()}
        return sorted(n for n in set(now) | set(self.record) if now.get(n) != self.record.get(n))


class CudaGraphRunner:
    def __init__(self, runner, max_batch_size: int, batch_sizes=DEFAULT_BATCH_SIZES):
        self.runner = runner
        self.batch_sizes = sorted(b for b in batch_sizes if b <= max_batch_size) or [1]
        self.max_bs = self.batch_sizes[-1]
        self.max_blocks = -(-runner.max_model_len // runner.block_size)
        device = runner.device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(self.max_bs, self.max_blocks, dtype=torch.long, device=device)
        self.ctx_lens = torch.ones(self.max_bs, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
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
        bsz = self.runner.block_size
        keys = torch.arange(self.max_blocks * bsz, device=self.ctx_lens.device).unsqueeze(0)
        lens = self.ctx_lens[:bs].unsqueeze(1)
        mask = keys < lens
        window = self.runner.model_config.sliding_window
        if window is not None:
            mask &= keys > lens - 1 - window
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bs], decode_rows=torch.arange(bs, device=keys.device),
                                 decode_blocks=self.block_tables[:bs], decode_mask=mask.view(bs, 1, 1, -1),
                                 decode_ctx_lens=self.ctx_lens[:bs], use_paged_kernel=self.runner.use_paged_kernel,
                                 sliding_window=window)

    def _run(self, bs: int) -> torch.Tensor:
        model = self.runner.model
        hidden = model(self.input_ids[:bs], self.positions[:bs], self.runner.kv.caches, self._meta(bs))
        return model.compute_logits(hidden)

    def free(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None
        gc.collect()
        torch.cuda.empty_cache()

    @torch.inference_mode()
    def capture(self) -> None:
        """(Re)capture every batch size; old graphs are freed first so memory never holds two sets."""
        self.free()
        scratch = self.runner.kv.scratch_block
        self.block_tables.fill_(scratch)
        self.slot_mapping.fill_(scratch * self.runner.block_size)
        self.ctx_lens.fill_(1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its pool
                for _ in range(2):
                    self._run(bs)  # warm-up (allocator, autotuning) outside the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.outputs[bs] = self._run(bs)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.current_stream().wait_stream(stream)
        self.audit = StorageAudit(self.graph_tensors())
        logger.info("captured CUDA graphs for batch sizes %s", self.batch_sizes)

    recapture = capture

    def can_run(self, batch) -> bool:
        return (bool(self.graphs) and len(batch.q_lens) <= self.max_bs and all(q == 1 for q in batch.q_lens)
                and not batch.input_logprob_idx and len(batch.logits_rows) == len(batch.q_lens)
                and max(len(t) for t in batch.block_tables) <= self.max_blocks)

    @torch.inference_mode()
    def replay(self, batch, input_ids: torch.Tensor) -> torch.Tensor:
        """Decode ``batch`` (all q_len == 1) with a captured graph; returns logits [B, vocab].

        The logits are a view of the graph's static output: read them (sample) before the next
        replay. The worker samples each step before the next forward is launched, also under
        overlap (one forward thread, in launch order)."""
        n = len(batch.q_lens)
        bs = next(b for b in self.batch_sizes if b >= n)
        bsz = self.runner.block_size
        scratch = self.runner.kv.scratch_block
        tables = torch.full((bs, self.max_blocks), scratch, dtype=torch.long)
        for i, t in enumerate(batch.block_tables):
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        ctx = torch.ones(bs, dtype=torch.long)
        ctx[:n] = torch.tensor(batch.ctx_lens, dtype=torch.long)
        pos = ctx - 1
        slots = tables[torch.arange(bs), pos // bsz] * bsz + pos % bsz
        slots[n:] = scratch * bsz
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.input_ids[n:bs].zero_()
        self.positions[:bs].copy_(pos, non_blocking=True)
        self.slot_mapping[:bs].copy_(slots, non_blocking=True)
        self.block_tables[:bs].copy_(tables, non_blocking=True)
        self.ctx_lens[:bs].copy_(ctx, non_blocking=True)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
