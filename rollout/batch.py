"""What crosses the scheduler -> worker boundary: plain CPU data, cheap to send to other ranks.

``ModelWorkerBatch`` is the scheduler's batch; ``SamplingInputs`` the per-sample-row sampling
state (built from sequence state, so delayed sampling can build it late); the worker turns both
into device tensors (``ForwardBatch``, ``SamplingBatchInfo``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch

from rollout.layers.sampler import SamplingBatchInfo
from rollout.random import uniforms


@dataclass
class ScoredPosition:
    """The sampler's view of one scored output token (replayed scoring): the state a sequence had
    when it sampled there. ``SamplingInputs.from_seqs`` reads it as it reads a ``Sequence``."""

    params: object  # SamplingParams
    token_ids: list[int]  # the history: prompt + outputs before this token
    num_prompt_tokens: int
    req: object  # top_logprobs_num, return_sampling_mask
    seed: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


def penalty_capacity(max_num_seqs: int) -> int:
    """Slots of the device's penalty state: twice the sequences a step can hold (a step's rows never evict
    each other)."""
    return 2 * max_num_seqs


class PenaltySlots:
    """Which row of the device's penalty state (``rollout.layers.sampler.PenaltyState``) holds each sequence's
    token counts, kept by the scheduler. A sequence sampled with a repetition, frequency or presence penalty
    gets a slot; the device adds every token sampled for it, and ``synced`` is how many of its output tokens
    the slot holds by then. Anything that makes that untrue (a rejected speculative guess, a token dropped at
    a stop, a step that sampled it through another path) shows as a mismatch at its next sampling, and the
    slot is written afresh from the history: correct by construction, not by bookkeeping every path.
    The least recently used slot is reused when all are taken."""

    def __init__(self, capacity: int):
        self.slot_of: dict[int, list[int]] = {}  # seq id -> [slot, synced, last step used]
        self.free = list(range(capacity - 1, -1, -1))
        self.step = 0

    def take(self, seq, inits: list) -> int:
        """``seq``'s slot for this step (written afresh through ``inits`` when it does not hold the history)."""
        entry = self.slot_of.get(seq.seq_id)
        if entry is None:
            if not self.free:
                victim = min((k for k, e in self.slot_of.items() if e[2] < self.step),
                             key=lambda k: self.slot_of[k][2])
                self.free.append(self.slot_of.pop(victim)[0])
            entry = self.slot_of[seq.seq_id] = [self.free.pop(), -1, self.step]
        n_out = seq.num_output_tokens
        if entry[1] != n_out:
            inits.append((entry[0], list(seq.token_ids[:seq.num_prompt_tokens]), list(seq.output_ids)))
        entry[1], entry[2] = n_out + 1, self.step  # the device adds the token this step samples
        return entry[0]


class SparseRows:
    """(rows, token ids, values) of a per-row sparse logit processor (bias, penalties), built entry
    by entry, as ``SamplingInputs`` holds them; ``triple()`` is None when nothing was added."""

    __slots__ = ("rows", "ids", "values")

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.ids: list[int] = []
        self.values: list[float] = []

    def add(self, row: int, token: int, value: float) -> None:
        self.rows.append(row)
        self.ids.append(token)
        self.values.append(value)

    def extend(self, row: int, tokens, value: float) -> None:
        """``tokens`` (a collection) of ``row``, all with ``value``."""
        n = len(tokens)
        self.rows.extend([row] * n)
        self.ids.extend(tokens)
        self.values.extend([value] * n)

    def triple(self) -> Optional[tuple[list[int], list[int], list[float]]]:
        return (self.rows, self.ids, self.values) if self.rows else None


@dataclass
class SamplingInputs:
    temperatures: list[float]
    uniforms: list[float]
    top_ks: Optional[list[int]] = None
    top_ps: Optional[list[float]] = None
    min_ps: Optional[list[float]] = None
    bias: Optional[tuple[list[int], list[int], list[float]]] = None
    allowed: Optional[tuple[list[int], list[list[int]]]] = None
    repetition: Optional[tuple[list[int], list[int], list[float]]] = None
    additive_penalty: Optional[tuple[list[int], list[int], list[float]]] = None
    banned: Optional[tuple[list[int], list[int]]] = None
    top_logprobs_num: int = 0
    raw_logprobs: bool = False
    mask_rows: Optional[list[int]] = None  # rows whose kept-token set is returned
    max_mask_size: int = 0
    seeds: Optional[list[int]] = None  # what each row's uniform is drawn from (on the device: sample_static)
    draw_positions: Optional[list[int]] = None
    # penalties from the device's per-sequence counts (PenaltySlots): each row's slot (-1: none) and
    # penalties, and the slots to write afresh first (slot, prompt ids, output ids)
    penalty_slots: Optional[list[int]] = None
    repetition_penalties: Optional[list[float]] = None
    frequency_penalties: Optional[list[float]] = None
    presence_penalties: Optional[list[float]] = None
    penalty_inits: list = field(default_factory=list)

    @property
    def fits_static(self) -> bool:
        """Whether ``rollout.layers.sampler.sample_static`` samples these rows (inside a CUDA graph): no
        bias, allowed tokens, min-tokens ban, penalties rebuilt on the host or top logprobs, and the seeds
        known (penalties from device counts and masks it takes)."""
        return (self.seeds is not None and self.bias is None and self.allowed is None and self.repetition is None
                and self.additive_penalty is None and self.banned is None and self.top_logprobs_num == 0)

    @staticmethod
    def from_seqs(seqs, eos_ids: tuple[int, ...], raw_logprobs: bool, max_mask_size: int = 0,
                  penalty_slots: Optional[PenaltySlots] = None) -> SamplingInputs:
        """One row per sequence: the state that decides its next token (position = output index). With
        ``penalty_slots`` a real sequence's penalties come from the device's counts (its slot), not from sets
        rebuilt here."""
        params = [s.params for s in seqs]
        info = SamplingInputs(
            temperatures=[p.temperature for p in params],
            uniforms=uniforms([s.seed for s in seqs], [s.num_output_tokens for s in seqs]).tolist(),
            seeds=[s.seed for s in seqs], draw_positions=[s.num_output_tokens for s in seqs],
            top_logprobs_num=max((s.req.top_logprobs_num for s in seqs), default=0),
            raw_logprobs=raw_logprobs,
        )
        mask_rows = [i for i, s in enumerate(seqs) if s.req.return_sampling_mask]
        if mask_rows:
            info.mask_rows, info.max_mask_size = mask_rows, max_mask_size
        if any(p.top_k > 0 for p in params):
            info.top_ks = [p.top_k for p in params]
        if any(p.top_p < 1 for p in params):
            info.top_ps = [p.top_p for p in params]
        if any(p.min_p > 0 for p in params):
            info.min_ps = [p.min_p for p in params]
        bias, rep, add = SparseRows(), SparseRows(), SparseRows()
        allowed: tuple[list[int], list[list[int]]] = ([], [])
        banned: tuple[list[int], list[int]] = ([], [])
        penalized = [p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)
                     for p in params]
        dense = penalty_slots is not None and any(penalized)
        if dense:
            penalty_slots.step += 1
            info.penalty_slots = [-1] * len(seqs)
            info.repetition_penalties = [p.repetition_penalty for p in params]
            info.frequency_penalties = [float(p.frequency_penalty) for p in params]
            info.presence_penalties = [float(p.presence_penalty) for p in params]
        for row, (s, p) in enumerate(zip(seqs, params)):
            for tok, val in (p.logit_bias or {}).items():
                bias.add(row, tok, val)
            if p.allowed_token_ids:
                allowed[0].append(row), allowed[1].append(list(p.allowed_token_ids))
            if dense and penalized[row] and hasattr(s, "seq_id"):  # a real sequence (not a view): its slot
                info.penalty_slots[row] = penalty_slots.take(s, info.penalty_inits)
                penalized[row] = False
            elif dense:  # the slot-less rows are neutral on the device (their penalties, if any, go below)
                info.repetition_penalties[row], info.frequency_penalties[row] = 1.0, 0.0
                info.presence_penalties[row] = 0.0
            if penalized[row] and p.repetition_penalty != 1.0:
                rep.extend(row, set(s.token_ids), p.repetition_penalty)
            if penalized[row] and (p.frequency_penalty or p.presence_penalty):
                counts: dict[int, int] = {}
                for t in s.output_ids:
                    counts[t] = counts.get(t, 0) + 1
                for tok, c in counts.items():
                    add.add(row, tok, p.frequency_penalty * c + p.presence_penalty)
            if s.num_output_tokens < p.min_new_tokens:
                stops = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(eos_ids))
                banned[0].extend([row] * len(stops)), banned[1].extend(stops)
        info.bias = bias.triple()
        info.allowed = allowed if allowed[0] else None
        info.repetition = rep.triple()
        info.additive_penalty = add.triple()
        info.banned = banned if banned[0] else None
        return info

    def row(self, i: int) -> SamplingInputs:
        """Row ``i`` alone, as a one-row batch."""
        def pick(x):
            return None if x is None else [x[i]]

        def rows_of(t):  # (rows, *values) with rows remapped to 0
            if t is None:
                return None
            keep = [k for k, r in enumerate(t[0]) if r == i]
            return None if not keep else tuple([0] * len(keep) if j == 0 else [col[k] for k in keep]
                                               for j, col in enumerate(t))

        return SamplingInputs(
            temperatures=[self.temperatures[i]], uniforms=[self.uniforms[i]], top_ks=pick(self.top_ks),
            top_ps=pick(self.top_ps), min_ps=pick(self.min_ps), bias=rows_of(self.bias), allowed=rows_of(self.allowed),
            repetition=rows_of(self.repetition), additive_penalty=rows_of(self.additive_penalty),
            banned=rows_of(self.banned), top_logprobs_num=self.top_logprobs_num, raw_logprobs=self.raw_logprobs,
            mask_rows=[0] if self.mask_rows is not None and i in self.mask_rows else None,
            max_mask_size=self.max_mask_size, seeds=pick(self.seeds), draw_positions=pick(self.draw_positions),
            penalty_slots=pick(self.penalty_slots), repetition_penalties=pick(self.repetition_penalties),
            frequency_penalties=pick(self.frequency_penalties), presence_penalties=pick(self.presence_penalties))

    def to_device(self, vocab_size: int, device: torch.device) -> SamplingBatchInfo:
        def t(x, dtype):
            return torch.tensor(x, dtype=dtype, device=device)

        temps = t(self.temperatures, torch.float32)
        info = SamplingBatchInfo(temperatures=temps, uniforms=t(self.uniforms, torch.float32).clamp_(max=1 - 2**-24),
                                 top_logprobs_num=self.top_logprobs_num, raw_logprobs=self.raw_logprobs,
                                 all_greedy=all(x <= 0 for x in self.temperatures),
                                 has_greedy=any(x <= 0 for x in self.temperatures),
                                 all_temp_one=all(x == 1.0 or x <= 0 for x in self.temperatures))
        if self.mask_rows is not None:
            info.mask_rows, info.max_mask_size = t(self.mask_rows, torch.long), self.max_mask_size
        if self.top_ks is not None:
            info.top_ks = t(self.top_ks, torch.long)
        if self.top_ps is not None:
            info.top_ps = t(self.top_ps, torch.float32)
        if self.min_ps is not None:
            info.min_ps = t(self.min_ps, torch.float32)
        if self.bias is not None:
            info.bias = (t(self.bias[0], torch.long), t(self.bias[1], torch.long), t(self.bias[2], torch.float32))
        if self.allowed is not None:
            mask = torch.zeros(len(self.allowed[0]), vocab_size, dtype=torch.bool)
            for i, ids in enumerate(self.allowed[1]):
                mask[i, ids] = True
            info.allowed = (t(self.allowed[0], torch.long), mask.to(device))
        if self.repetition is not None:
            r = self.repetition
            info.repetition = (t(r[0], torch.long), t(r[1], torch.long), t(r[2], torch.float32))
        if self.additive_penalty is not None:
            a = self.additive_penalty
            info.additive_penalty = (t(a[0], torch.long), t(a[1], torch.long), t(a[2], torch.float32))
        if self.banned is not None:
            info.banned = (t(self.banned[0], torch.long), t(self.banned[1], torch.long))
        if self.penalty_slots is not None:
            info.penalties = (t(self.penalty_slots, torch.long), t(self.repetition_penalties, torch.float32),
                              t(self.frequency_penalties, torch.float64), t(self.presence_penalties, torch.float64))
        return info


@dataclass
class ModelWorkerBatch:
    input_ids: list[int]  # [T] new tokens of every scheduled sequence, in order
    block_tables: list[list[int]]  # per sequence
    ctx_lens: list[int]  # per sequence: context length after this step
    q_lens: list[int]  # per sequence: new tokens this step
    logits_rows: list[int]  # rows of the flat batch whose logits are needed
    sample_logits_idx: list[int]  # per sample row: index into logits_rows
    sampling: Optional[SamplingInputs]  # None when nothing is sampled
    input_logprob_idx: list[int] = field(default_factory=list)  # indices into logits_rows
    input_logprob_targets: list[int] = field(default_factory=list)  # the prompt token each scores
    input_logprob_temps: list[float] = field(default_factory=list)
    input_top_logprobs_num: int = 0
    input_logprob_sampling: Optional[SamplingInputs] = None  # replayed scoring: one processed row per scored token
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), after the forward
    weight_version: str = "default"
    has_placeholders: bool = False  # input ids < 0 are -(row + 1) of the previous batch's samples
    lora_slots: Optional[list[int]] = None  # per sequence its LoRA adapter slot (-1: none); None: no adapter

    @property
    def is_prefill_only(self) -> bool:
        return not self.sample_logits_idx

    @property
    def is_decode_only(self) -> bool:
        """One new token per sequence, each sampled, nothing scored: a plain decode step."""
        return (len(self.input_ids) == len(self.q_lens) == len(self.sample_logits_idx)
                and not self.input_logprob_idx)


@dataclass
class GenerationBatchResult:
    next_token_ids: Optional[torch.Tensor] = None  # [S]
    next_token_logprobs: Optional[torch.Tensor] = None  # [S]
    top_ids: Optional[torch.Tensor] = None
    top_logprobs: Optional[torch.Tensor] = None
    input_logprobs: Optional[torch.Tensor] = None  # [N_in]
    input_top_ids: Optional[torch.Tensor] = None
    input_top_logprobs: Optional[torch.Tensor] = None
    input_ranks: Optional[torch.Tensor] = None  # [N_in], with input top logprobs (not for replayed scoring)
    input_sampling_masks: Optional[list] = None  # replayed scoring: per mask row of input_logprob_sampling
    input_sampling_logprobs: Optional[torch.Tensor] = None
    sampling_masks: Optional[list] = None  # per row of SamplingInputs.mask_rows: sorted kept ids, None past the cap
    sampling_logprobs: Optional[torch.Tensor] = None  # [S] logprob renormalised over the kept set
    delay_sample_func: Optional[Callable[[SamplingInputs], GenerationBatchResult]] = None
    forward_time_s: float = 0.0
    sample_time_s: float = 0.0
