"""Folding a step's result into the scheduler's state, in one place: each sampled row's token onto its
sequence (logprobs, top logprobs, the weight version it was sampled under, its sampling mask), a verify
chunk's rows through the Speculator, prompt logprobs onto their requests, stop checks, and each touched
request's ``on_update``. Ending or failing a sequence is the scheduler's (its queues)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from rollout.batch import GenerationBatchResult
from rollout.scheduler.request import Sequence

if TYPE_CHECKING:
    from rollout.scheduler.scheduler import ScheduledBatch, Scheduler


def read_back(token_ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    """A step's sampled tokens and their logprobs on the host in one device-to-host copy (one synchronisation
    on a GPU, not one per tensor): both as float64 (exact for token ids and fp32 values), through pinned memory."""
    if token_ids.device.type == "cpu":
        return token_ids.tolist(), logprobs.tolist()
    both = torch.stack([token_ids.to(torch.float64), logprobs.to(torch.float64)])
    host = torch.empty(both.shape, dtype=torch.float64, pin_memory=True)
    host.copy_(both, non_blocking=True)
    torch.cuda.current_stream(both.device).synchronize()
    rows = host.tolist()
    return [int(t) for t in rows[0]], rows[1]


class ResultFolder:
    def __init__(self, scheduler: Scheduler):
        self.s = scheduler

    def fold(self, sb: ScheduledBatch, result: GenerationBatchResult) -> None:
        """Every row of ``result`` onto its sequence (or, for prompt positions, its request), then each touched
        request's ``on_update``."""
        batch, scheduled, samplers = sb.batch, sb.scheduled, sb.samplers
        self.s.stats.num_steps += 1
        self.s.stats.forward_time_s += result.forward_time_s
        if batch.is_decode_only:
            self.s.stats.decode_forward_time_s += result.forward_time_s
            self.s.stats.decode_sample_time_s += result.sample_time_s
            if self.s.speculator is not None:  # the cost of a step by its rows: what speculation decides from
                self.s.speculator.observe(len(batch.q_lens), result.forward_time_s + result.sample_time_s)
        touched: dict[str, list[Sequence]] = {}
        if result.input_logprobs is not None:
            self._record_input_logprobs(sb, result)
        if samplers:
            self.s.stats.sample_time_s += result.sample_time_s
            self.s.stats.num_sample_steps += 1
            tokens, lps = read_back(result.next_token_ids, result.next_token_logprobs)
            top_ids = result.top_ids.tolist() if result.top_ids is not None else None
            top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
            masks = self._masks_by_row(samplers, result)
            now = time.perf_counter()
            verified = {row for _, first, guesses in sb.verifies for row in range(first, first + len(guesses) + 1)}

            def append(seq: Sequence, i: int) -> bool:
                """Row ``i``'s token onto ``seq``; False when the sequence is done (finished or failed)."""
                seq.token_ids.append(tokens[i])
                if seq.req.return_logprob:
                    seq.output_logprobs.append(lps[i])
                    if seq.req.top_logprobs_num and top_ids is not None:
                        k = seq.req.top_logprobs_num
                        seq.output_top_logprobs.append(list(zip(top_ids[i][:k], top_lps[i][:k])))
                # an adapter loaded under a version label of its own (a trainer's step): that label
                seq.output_versions.append(batch.weight_version if seq.req.lora is None or
                                           seq.req.lora.weight_version is None else seq.req.lora.weight_version)
                if masks is not None and i in masks:
                    if masks[i][0] is None:  # the kept set is larger than the cap: this request fails alone
                        self.s.fail_request(seq.req, self._mask_too_large())
                        return False
                    seq.output_sampling_masks.append(masks[i][0])
                    seq.output_sampling_logprobs.append(masks[i][1])
                if seq.first_token_time is None:
                    seq.first_token_time = now
                self.check_stop(seq)
                touched.setdefault(seq.req.rid, []).append(seq)
                return not seq.is_finished

            for i, seq in enumerate(samplers):
                if i in verified:
                    continue
                seq.num_pending -= 1
                if seq.is_finished:  # finished or aborted while this step ran: its extra slot is dropped
                    continue
                append(seq, i)
            for seq, first, guesses in sb.verifies:
                seq.spec_guesses = []
                if not seq.is_finished:
                    self.s.speculator.take_verified(seq, first, guesses, tokens, append)
        for seq, _ in scheduled:
            req = seq.req
            if (not seq.is_finished and req.params.max_new_tokens == 0
                    and seq.num_computed_tokens == seq.num_prompt_tokens):
                self.s.finish(seq, "length")
                touched.setdefault(req.rid, []).append(seq)
        for rid, seqs in touched.items():
            req = self.s.requests.get(rid)
            if req is not None and req.on_update is not None and not req.is_finished:
                req.on_update(req, seqs)

    @staticmethod
    def _masks_by_row(samplers: list[Sequence], result: GenerationBatchResult):
        """{sample row: (kept ids or None, renormalised logprob)} for the rows that asked for masks."""
        if result.sampling_masks is None:
            return None
        rows = [i for i, s in enumerate(samplers) if s.req.return_sampling_mask]
        lps = result.sampling_logprobs.tolist()
        return {row: (mask, lps[row]) for row, mask in zip(rows, result.sampling_masks)}

    def _mask_too_large(self) -> ValueError:
        return ValueError(f"a sampling mask of this request would hold more than max_sampling_mask_size="
                          f"{self.s.config.outputs.max_sampling_mask_size} token ids; restrict sampling (top_k, top_p, "
                          f"min_p, allowed_token_ids) or raise the engine's max_sampling_mask_size")

    def _record_input_logprobs(self, batch: ScheduledBatch, result: GenerationBatchResult) -> None:
        if result.input_sampling_logprobs is not None:  # replayed scoring
            lps = result.input_sampling_logprobs.tolist()
            masks = iter(result.input_sampling_masks or [])
            for i, req in enumerate(batch.input_owners):
                if req.score_from is None:
                    continue
                req.score_sampling_logprobs.append(lps[i])
                if req.return_sampling_mask:
                    mask = next(masks)
                    if mask is None and req.error is None:
                        self.s.fail_request(req, self._mask_too_large())
                    req.score_masks.append(mask)
        values = result.input_logprobs.tolist()
        top_ids = result.input_top_ids.tolist() if result.input_top_ids is not None else None
        top_lps = result.input_top_logprobs.tolist() if result.input_top_logprobs is not None else None
        ranks = result.input_ranks.tolist() if result.input_ranks is not None else None
        for i, req in enumerate(batch.input_owners):
            req.input_logprobs.append(values[i])
            if top_ids is not None:
                k = req.top_logprobs_num
                req.input_top_logprobs.append(list(zip(top_ids[i][:k], top_lps[i][:k])) if k else [])
            if ranks is not None and req.top_logprobs_num:
                req.input_ranks.append(ranks[i])

    def check_stop(self, seq: Sequence) -> None:
        """End ``seq`` if its last token stops it (EOS, a stop token, a stop string) or it reached its length."""
        p = seq.params
        tok = seq.token_ids[-1]
        n_out = seq.num_output_tokens
        if n_out >= p.min_new_tokens:
            if not p.ignore_eos and tok in self.s.eos_ids:
                return self.s.finish(seq, "stop", tok)
            if p.stop_token_ids and tok in p.stop_token_ids:
                return self.s.finish(seq, "stop", tok)
            if p.stop and self.s.detokenizer is not None:
                text = self.s.detokenizer(seq.output_ids, p.skip_special_tokens)
                tail_from = max(0, len(text) - max(len(s) for s in p.stop) - 16)
                hits = [(text.find(s, tail_from), s) for s in p.stop]
                hits = [(pos, s) for pos, s in hits if pos >= 0]
                if hits:
                    pos, s = min(hits)
                    seq.stop_text_offset = pos
                    seq.text = text[:pos + len(s)] if p.no_stop_trim else text[:pos]
                    return self.s.finish(seq, "stop", s)
        if n_out >= p.max_new_tokens or len(seq.token_ids) >= self.s.worker.context_len:
            self.s.finish(seq, "length")
