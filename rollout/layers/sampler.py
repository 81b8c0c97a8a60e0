"""The sampler: processed logits -> token, and the log-probability of that token under the very
distribution it was drawn from, in one pass and without syncing the host.

Order on the logits: logit_bias / allowed_token_ids -> repetition, frequency, presence penalties
-> min_new_tokens stop mask -> temperature (0 = greedy) -> top_k -> top_p -> min_p -> draw.
The draw is inverse-CDF sampling with a uniform supplied per row (see ``rollout.random``), so the
token is a pure function of the distribution and the (seed, position) pair; on CPU one C++ call
(``rollout.kernels.cpu.ops``) does it where the engine turns it on (``fused_draw``). No full-vocabulary
sort on the common path: top-k uses ``topk``; top-p looks at a small candidate set and falls
back to a sort only for the rows whose candidates do not reach ``top_p``.

Greedy rows report the log-probability under the raw logits; ``raw`` mode reports raw logprobs
for every row.

Sampling masks (rows in ``mask_rows`` only, so the common path pays nothing): the sorted ids whose
processed logit is finite — what survived bias/allowed tokens, the min-tokens ban, top-k, top-p and
min-p — and the drawn token's logprob renormalised over them (a greedy row: the token alone, 0).
Reading them back costs one host sync per step that asks for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from rollout.kernels.cpu import ops

_TOP_P_CANDIDATES = 64


@dataclass
class SamplingBatchInfo:
    """Device-side sampling inputs for S rows (one per sample drawn this step)."""

    temperatures: torch.Tensor  # [S] float32, 0 = greedy
    uniforms: torch.Tensor  # [S] float32 in [0, 1)
    top_ks: Optional[torch.Tensor] = None  # [S] long, <= 0 = off; None when no row uses it
    top_ps: Optional[torch.Tensor] = None  # [S] float32; None when no row uses it
    min_ps: Optional[torch.Tensor] = None  # [S] float32; None when no row uses it
    bias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # rows, token ids, values
    allowed: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # rows [A], mask [A, V]
    repetition: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # rows, ids, penalty
    additive_penalty: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # rows, ids, amount
    banned: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # rows, ids (min_new_tokens)
    top_logprobs_num: int = 0
    raw_logprobs: bool = False
    mask_rows: Optional[torch.Tensor] = None  # [M] rows whose kept-token set is returned
    max_mask_size: int = 0  # a larger kept set is reported as None (its request fails)
    all_greedy: bool = False
    has_greedy: bool = False
    all_temp_one: bool = False  # every sampled row has temperature 1: skip the division
    fused_draw: bool = False  # CPU: the draw and its logprob in one C++ call (rollout.kernels.cpu.ops)
    # penalties from the device's counts: per row (slot, repetition, frequency, presence) and the state
    penalties: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = None
    penalty_state: Optional[PenaltyState] = None


class PenaltyState:
    """Per sequence slot (``rollout.batch.PenaltySlots``), on the device: which tokens its history holds (the
    repetition penalty's set: prompt and outputs) and how often each was sampled (frequency and presence),
    updated by every sampled token with no host round trip. Row ``capacity`` is a scratch slot that rows
    without one read and write (with neutral penalties it changes nothing)."""

    def __init__(self, capacity: int, vocab: int, device: torch.device):
        self.scratch = capacity
        self.seen = torch.zeros(capacity + 1, vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(capacity + 1, vocab, dtype=torch.int32, device=device)

    def write(self, inits) -> None:
        """Slots written afresh from their histories: (slot, prompt ids, output ids)."""
        for slot, prompt, outputs in inits:
            self.seen[slot].zero_()
            self.counts[slot].zero_()
            device = self.seen.device
            self.seen[slot, torch.tensor(prompt + outputs, dtype=torch.long, device=device)] = True
            if outputs:
                ids = torch.tensor(outputs, dtype=torch.long, device=device)
                self.counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def _rows(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.where(slots < 0, self.scratch, slots)

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Each row's sampled token into its slot."""
        rows = self._rows(slots)
        self.seen[rows, tokens] = True
        self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    def apply(self, x: torch.Tensor, penalties) -> torch.Tensor:
        """Repetition, then frequency and presence, on ``x`` [S, V]: the values the host's sparse path gives
        (the same formula per entry; the additive amount computed in float64 and rounded once, as the host's)."""
        slots, rep, freq, pres = penalties
        rows = self._rows(slots)
        seen, counts = self.seen[rows], self.counts[rows]
        r = rep.unsqueeze(1)
        x = torch.where(seen, torch.where(x < 0, x * r, x / r), x)
        amount = freq.unsqueeze(1) * counts.to(torch.float64) + pres.unsqueeze(1)
        return x - torch.where(counts > 0, amount, 0.0).to(torch.float32)


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [S] long
    logprobs: torch.Tensor  # [S] float32
    top_ids: Optional[torch.Tensor] = None  # [S, k]
    top_logprobs: Optional[torch.Tensor] = None  # [S, k]
    masks: Optional[list] = None  # per mask row: sorted kept ids (list), or None past max_mask_size
    sampling_logprobs: Optional[torch.Tensor] = None  # [S] renormalised over the kept set (greedy: 0)


def sampling_masks(x: torch.Tensor, dist: Optional[torch.Tensor], token_ids: torch.Tensor,
                    processed_lp: torch.Tensor, info: SamplingBatchInfo) -> tuple[list, torch.Tensor]:
    """Kept-token sets of the mask rows (one host sync) and every row's renormalised logprob."""
    rows = info.mask_rows
    greedy = info.temperatures <= 0
    kept = kept_sets(x.index_select(0, rows) if dist is None else dist.index_select(0, rows),
                     token_ids.index_select(0, rows), greedy.index_select(0, rows) | (dist is None))
    return masks_of(kept, info.max_mask_size), torch.where(greedy, torch.zeros_like(processed_lp), processed_lp)


def kept_sets(dist: torch.Tensor, token_ids: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """Each row's kept set as a [R, V] bool: the ids whose processed logit is finite, a greedy row's token
    alone."""
    one_hot = torch.zeros_like(dist, dtype=torch.bool).scatter_(1, token_ids.unsqueeze(1), True)
    return torch.where(greedy.unsqueeze(1), one_hot, torch.isfinite(dist))


def masks_of(kept: torch.Tensor, max_mask_size: int) -> list:
    """Each row's kept token ids, sorted (None past ``max_mask_size``), from a [M, V] bool: one host sync."""
    counts = kept.sum(dim=1).tolist()
    ids = kept.nonzero()[:, 1].tolist()
    masks, start = [], 0
    for c in counts:
        masks.append(ids[start: start + c] if c <= max_mask_size else None)
        start += c
    return masks


def apply_logit_processors(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Bias, allow-lists, penalties and the min-tokens mask; returns a new tensor when any applies."""
    x = logits
    if info.bias or info.allowed or info.repetition or info.additive_penalty or info.banned or info.penalties:
        x = logits.clone()
    if info.bias is not None:
        rows, ids, vals = info.bias
        x.index_put_((rows, ids), vals, accumulate=True)
    if info.allowed is not None:
        rows, mask = info.allowed
        x[rows] = torch.where(mask, x[rows], float("-inf"))
    if info.repetition is not None:
        rows, ids, pen = info.repetition
        vals = x[rows, ids]
        x[rows, ids] = torch.where(vals < 0, vals * pen, vals / pen)
    if info.penalties is not None:  # rows with a slot (the others neutral here): repetition, then additive
        x = info.penalty_state.apply(x, info.penalties)
    if info.additive_penalty is not None:
        rows, ids, amount = info.additive_penalty
        x.index_put_((rows, ids), -amount, accumulate=True)
    if info.banned is not None:
        rows, ids = info.banned
        x[rows, ids] = float("-inf")
    return x


def _mask_top_k(x: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    use = top_ks > 0
    k = torch.where(use, top_ks, 1).clamp(max=x.shape[-1])
    kmax = int(k.max())  # a bound for topk's size: one small host read per step at most
    kth = x.topk(kmax, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    kth = torch.where(use.unsqueeze(1), kth, float("-inf"))
    return x.masked_fill(x < kth, float("-inf"))


def _mask_top_p(x: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    probs = x.softmax(dim=-1)
    k = min(_TOP_P_CANDIDATES, x.shape[-1])
    cand_p, cand_idx = probs.topk(k, dim=-1)
    keep_c = (cand_p.cumsum(-1) - cand_p) < top_ps.unsqueeze(1)
    keep_c[:, 0] = True  # the most likely token always survives (a top_p that is 0 in float32 keeps it)
    keep = torch.zeros_like(x, dtype=torch.bool).scatter_(1, cand_idx, keep_c)
    # Rows whose candidates hold less than top_p of the mass need the exact full sort.
    uncovered = (cand_p.sum(-1) < top_ps) & (top_ps < 1)
    if bool(uncovered.any()):
        rows = uncovered.nonzero().squeeze(1)
        sp, si = probs[rows].sort(dim=-1, descending=True)
        keep_rows = (sp.cumsum(-1) - sp) < top_ps[rows].unsqueeze(1)
        keep_rows[:, 0] = True
        keep[rows] = torch.zeros_like(keep_rows).scatter_(1, si, keep_rows)
    keep |= (top_ps >= 1).unsqueeze(1)
    return x.masked_fill(~keep, float("-inf"))


def _mask_min_p(x: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    probs = x.softmax(dim=-1)
    threshold = min_ps.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return x.masked_fill(probs < threshold, float("-inf"))


def processed_logits(logits: torch.Tensor, info: SamplingBatchInfo, x: torch.Tensor) -> torch.Tensor:
    """Temperature then top-k / top-p / min-p masks on ``x`` (logits after processors)."""
    if not info.all_temp_one:
        t = torch.where(info.temperatures > 0, info.temperatures, 1.0)
        x = x / t.unsqueeze(1)
    if info.top_ks is not None:
        x = _mask_top_k(x, info.top_ks)
    if info.top_ps is not None:
        x = _mask_top_p(x, info.top_ps)
    if info.min_ps is not None:
        x = _mask_min_p(x, info.min_ps)
    return x


def processed_logprobs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Log-probabilities of the distribution sampled from (rows with temperature > 0)."""
    return torch.log_softmax(processed_logits(logits, info, apply_logit_processors(logits, info)), dim=-1)


def _exp_cumsum(dist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row max, cumulative sum of exp(dist - row max)): the one pass both the draw and its logprob use."""
    row_max = dist.max(dim=-1, keepdim=True).values
    return row_max, (dist - row_max).exp_().cumsum_(dim=-1)


def _fused(dist: torch.Tensor, info: SamplingBatchInfo) -> bool:
    return info.fused_draw and ops.sampling_available(dist)


def drawn_logprob(dist: torch.Tensor, ids: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """log softmax(dist)[ids], computed exactly as ``sample`` computes a drawn token's logprob with
    the same ``info`` (so a replayed score equals the reported one bit for bit)."""
    return dist_logprob(dist, ids, info.fused_draw)


def dist_logprob(dist: torch.Tensor, ids: torch.Tensor, fused: bool) -> torch.Tensor:
    """log softmax(dist)[ids] as the sampler computes a drawn token's: the C++ kernel where ``fused`` (the CPU
    plan's sampler) and it serves these rows, else the exp / cumsum pass of the torch draw."""
    if fused and ops.sampling_available(dist):
        return ops.logprob(dist, ids)
    row_max, cdf = _exp_cumsum(dist)
    return (dist.gather(1, ids.unsqueeze(1)) - row_max - cdf[:, -1:].log()).squeeze(1)


def token_logprob(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(x)[ids], each row computed alone in one fixed order, whatever the batch or the thread
    count. (``x[ids] - logsumexp(x)`` was not: torch splits a one-row sum across its threads, so a
    one-row decode step reported another last bit on one thread than on two — measured in a real
    generation, ``benchmarks/NOTES.md``; ``log_softmax`` reduces each row on one thread.)"""
    return torch.log_softmax(x, dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)


def sample(logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
    """logits: [S, V] fp32 (one row per sample) -> tokens and their logprobs."""
    x = apply_logit_processors(logits, info)
    if info.all_greedy:
        token_ids = x.argmax(dim=-1)
        logprobs = token_logprob(logits, token_ids)
        dist = None
    else:
        dist = processed_logits(logits, info, x)
        if _fused(dist, info):
            token_ids, logprobs = ops.draw(dist, info.uniforms)
        else:
            # Inverse-CDF draw and the drawn token's logprob from one exp/cumsum pass, no sort.
            row_max, cdf = _exp_cumsum(dist)
            total = cdf[:, -1:]
            drawn = torch.searchsorted(cdf, info.uniforms.unsqueeze(1) * total, right=True)
            token_ids = drawn.squeeze(1).clamp_(max=logits.shape[-1] - 1)
            logprobs = (dist.gather(1, token_ids.unsqueeze(1)) - row_max - total.log()).squeeze(1)
        if info.has_greedy:
            greedy = info.temperatures <= 0
            token_ids = torch.where(greedy, x.argmax(dim=-1), token_ids)
            logprobs = torch.where(greedy, token_logprob(logits, token_ids), logprobs)
    masks = sampling_lp = None
    if info.mask_rows is not None:
        masks, sampling_lp = sampling_masks(x, dist, token_ids, logprobs, info)
    if info.raw_logprobs:
        logprobs = token_logprob(logits, token_ids)
    out = SampleOutput(token_ids=token_ids, logprobs=logprobs, masks=masks, sampling_logprobs=sampling_lp)
    if info.top_logprobs_num > 0:
        # The same distribution each row's logprob comes from.
        lp = torch.log_softmax(logits, dim=-1)
        if dist is not None and not info.raw_logprobs:
            greedy = (info.temperatures <= 0).unsqueeze(1)
            lp = torch.where(greedy, lp, torch.log_softmax(dist, dim=-1))
        out.top_logprobs, out.top_ids = lp.topk(min(info.top_logprobs_num, logits.shape[-1]), dim=-1)
    return out


class StaticSampling:
    """The per-row sampling inputs of up to ``max_rows`` rows in fixed device buffers, so that
    ``sample_static`` over them can be captured in a CUDA graph with the forward: temperature (0 = greedy),
    top-k (<= 0: off), top-p (>= 1: off), min-p (0: off), and each row's seed and output position, from which
    the uniform is drawn on the device (``rollout.random.device_uniforms``, the host's bits). ``stage`` fills
    them from the host through a pinned buffer with ``non_blocking`` copies."""

    def __init__(self, max_rows: int, device: torch.device):
        pin = device.type == "cuda"
        self.host = torch.zeros(3, max_rows, dtype=torch.float32, pin_memory=pin)  # temperatures, top_ps, min_ps
        self.host_ids = torch.zeros(4, max_rows, dtype=torch.int64, pin_memory=pin)  # top_ks, seeds, positions, slots
        self.copied = torch.cuda.Event() if pin else None  # the last copies out of the host buffers
        self.temperatures = torch.zeros(max_rows, dtype=torch.float32, device=device)
        self.top_ps = torch.ones(max_rows, dtype=torch.float32, device=device)
        self.min_ps = torch.zeros(max_rows, dtype=torch.float32, device=device)
        self.top_ks = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.seeds = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        # penalties from the device's counts: per row its slot (-1: the scratch) and penalties (neutral: 1, 0, 0)
        self.host_pen = torch.zeros(2, max_rows, dtype=torch.float64, pin_memory=pin)  # frequency, presence
        self.host_rep = torch.ones(max_rows, dtype=torch.float32, pin_memory=pin)
        self.penalty_slots = torch.full((max_rows,), -1, dtype=torch.int64, device=device)
        self.repetition = torch.ones(max_rows, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(max_rows, dtype=torch.float64, device=device)
        self.presence = torch.zeros(max_rows, dtype=torch.float64, device=device)

    def penalties(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.penalty_slots[:b], self.repetition[:b], self.frequency[:b], self.presence[:b]

    def stage(self, sampling, bs: int) -> None:
        """``sampling`` (the scheduler's ``SamplingInputs`` of n <= bs rows, ``fits_static``) into the first
        ``bs`` rows; padding rows are greedy."""
        from rollout.random import as_int64

        n = len(sampling.temperatures)
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copies are done (its tokens were read since)
        floats = self.host.numpy()[:3, :bs]
        ids = self.host_ids.numpy()[:3, :bs]
        floats[:, n:] = ((0.0,), (1.0,), (0.0,))
        ids[:, n:] = 0
        floats[0, :n] = sampling.temperatures
        floats[1, :n] = sampling.top_ps if sampling.top_ps is not None else 1.0
        floats[2, :n] = sampling.min_ps if sampling.min_ps is not None else 0.0
        ids[0, :n] = sampling.top_ks if sampling.top_ks is not None else 0
        ids[1, :n] = [as_int64(x) for x in sampling.seeds]
        ids[2, :n] = sampling.draw_positions
        for dst, row in ((self.temperatures, 0), (self.top_ps, 1), (self.min_ps, 2)):
            dst[:bs].copy_(self.host[row, :bs], non_blocking=True)  # rounded to float32 as to_device rounds
        for dst, row in ((self.top_ks, 0), (self.seeds, 1), (self.positions, 2)):
            dst[:bs].copy_(self.host_ids[row, :bs], non_blocking=True)
        if sampling.penalty_slots is not None:
            pen, rep, slots = self.host_pen.numpy()[:, :bs], self.host_rep.numpy()[:bs], self.host_ids.numpy()[3, :bs]
            pen[:, n:], rep[n:], slots[n:] = 0.0, 1.0, -1
            slots[:n] = sampling.penalty_slots
            pen[0, :n] = sampling.frequency_penalties
            pen[1, :n] = sampling.presence_penalties
            rep[:n] = sampling.repetition_penalties  # rounded to float32 as to_device rounds
            self.penalty_slots[:bs].copy_(self.host_ids[3, :bs], non_blocking=True)
            self.repetition[:bs].copy_(self.host_rep[:bs], non_blocking=True)
            self.frequency[:bs].copy_(self.host_pen[0, :bs], non_blocking=True)
            self.presence[:bs].copy_(self.host_pen[1, :bs], non_blocking=True)
        if self.copied is not None:
            self.copied.record()


def sample_static(logits: torch.Tensor, st: StaticSampling, raw_logprobs: bool = False, filtered: bool = True,
                  state: Optional[PenaltyState] = None, masks: bool = False) -> tuple[torch.Tensor, ...]:
    """``sample`` for rows without logit bias, allowed tokens, a min-tokens ban or top logprobs, with fixed
    shapes and no host synchronisation (every row goes through every step; an option a row does not use
    leaves it as it was):
    logits [B, V] fp32 and the first B rows of ``st`` -> (tokens [B], logprobs [B]) — the tokens and the bits
    ``sample`` gives. One full-vocabulary sort serves top-k and top-p where ``sample`` takes ``topk`` and a
    candidate set: the same values in the same order. ``filtered=False``: rows without top-k, top-p and
    min-p only (no sorts). With ``state``: repetition, frequency and presence penalties first, from the
    device's counts (``PenaltyState``), each row's slot and penalties in ``st``. With ``masks``: also every
    row's kept set as a [B, V] bool (a greedy row: its token) and its token's logprob renormalised over it
    (greedy: 0) — ``sample``'s masks before they are read back."""
    from rollout.random import device_uniforms

    b, vocab = logits.shape
    temps = st.temperatures[:b]
    greedy = temps <= 0
    processed = logits if state is None else state.apply(logits, st.penalties(b))
    x = processed / torch.where(greedy, 1.0, temps).unsqueeze(1)
    dist = _filtered(x, st, b, vocab) if filtered else x
    u = device_uniforms(st.seeds[:b], st.positions[:b]).float().clamp_(max=1 - 2**-24)
    row_max, cdf = _exp_cumsum(dist)
    total = cdf[:, -1:]
    drawn = torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True).squeeze(1).clamp_(max=vocab - 1)
    tokens = torch.where(greedy, processed.argmax(dim=-1), drawn)
    drawn_lp = (dist.gather(1, tokens.unsqueeze(1)) - row_max - total.log()).squeeze(1)
    raw_lp = token_logprob(logits, tokens)
    reported = raw_lp if raw_logprobs else torch.where(greedy, raw_lp, drawn_lp)
    if not masks:
        return tokens, reported
    return tokens, reported, kept_sets(dist, tokens, greedy), torch.where(greedy, 0.0, drawn_lp)


def _filtered(x: torch.Tensor, st: StaticSampling, b: int, vocab: int) -> torch.Tensor:
    """Top-k, then top-p, then min-p on every row (a row's off value leaves it as it was)."""
    top_ks = st.top_ks[:b]
    use_k = top_ks > 0
    ordered = x.sort(dim=-1, descending=True).values
    k = torch.where(use_k, top_ks, 1).clamp(max=vocab)
    kth = torch.where(use_k.unsqueeze(1), ordered.gather(1, (k - 1).unsqueeze(1)), float("-inf"))
    x = x.masked_fill(x < kth, float("-inf"))
    top_ps = st.top_ps[:b]
    probs = x.softmax(dim=-1)
    sp, si = probs.sort(dim=-1, descending=True)
    keep_sorted = (sp.cumsum(-1) - sp) < top_ps.unsqueeze(1)
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted).scatter_(1, si, keep_sorted) | (top_ps >= 1).unsqueeze(1)
    x = x.masked_fill(~keep, float("-inf"))
    probs = x.softmax(dim=-1)
    threshold = st.min_ps[:b].unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return x.masked_fill(probs < threshold, float("-inf"))


def sample_one_by_one(logits: torch.Tensor, sampling, to_info) -> SampleOutput:
    """``sample`` one row at a time (the batch-invariant mode), the outputs stacked as one batch's.
    ``sampling`` is the scheduler's ``SamplingInputs`` (``row(i)``, ``mask_rows``), ``to_info`` turns
    one row of it into this module's ``SamplingBatchInfo``."""
    outs = [sample(logits[i: i + 1], to_info(sampling.row(i))) for i in range(logits.shape[0])]

    def cat(name):
        parts = [getattr(o, name) for o in outs]
        return None if parts[0] is None else torch.cat(parts)

    masks = [m for o in outs for m in (o.masks or [])] if sampling.mask_rows is not None else None
    sampling_lp = None
    if sampling.mask_rows is not None:  # rows without a mask report their logprob (never read)
        sampling_lp = torch.cat([o.sampling_logprobs if o.sampling_logprobs is not None else o.logprobs for o in outs])
    return SampleOutput(cat("token_ids"), cat("logprobs"), cat("top_ids"), cat("top_logprobs"), masks, sampling_lp)


def score_processed(rows: torch.Tensor, targets: torch.Tensor, info: SamplingBatchInfo, raw: bool = False,
                    top_n: int = 0):
    """Replayed scoring: each given token's logprob as generation would have reported it (the
    processed distribution; raw for greedy rows or with ``raw``), its logprob renormalised over the
    kept set, and the kept sets -> (reported [N], top ids, top lps, sampling lps [N], masks).
    ``rows`` [N, V] the logits that produced each target."""
    x = apply_logit_processors(rows, info)
    dist = processed_logits(rows, info, x)
    greedy = info.temperatures <= 0
    raw_lp = token_logprob(rows, targets)  # the formulas ``sample`` reports with, for equal bits
    processed_lp = drawn_logprob(dist, targets, info)
    picked = raw_lp if raw else torch.where(greedy, raw_lp, processed_lp)
    argmax = x.argmax(dim=-1)
    sampling_lp = torch.where(greedy, torch.where(targets == argmax, 0.0, float("-inf")), processed_lp)
    masks = None
    if info.mask_rows is not None:
        masks, _ = sampling_masks(x, dist, argmax, sampling_lp, info)
    top_ids = top_lp = None
    if top_n > 0:
        table = torch.log_softmax(rows, dim=-1)
        if not raw:
            table = torch.where(greedy.unsqueeze(1), table, torch.log_softmax(dist, dim=-1))
        top_lp, top_ids = table.topk(min(top_n, table.shape[-1]), dim=-1)
    return picked, top_ids, top_lp, sampling_lp, masks


def temperature_logprobs(rows: torch.Tensor, temperatures: torch.Tensor, targets: torch.Tensor, top_n: int = 0):
    """Logprob of each target under its row's logits / temperature -> ([N], top ids, top lps, ranks);
    with ``top_n`` each target's rank too (1 + the tokens more likely than it, vLLM's ``rank``)."""
    lp = torch.log_softmax(rows / temperatures.unsqueeze(1), dim=-1)
    picked = lp.gather(1, targets.unsqueeze(1)).squeeze(1)
    if top_n > 0:
        top_lp, top_ids = lp.topk(min(top_n, lp.shape[-1]), dim=-1)
        ranks = (lp > picked.unsqueeze(1)).sum(dim=1) + 1
        return picked, top_ids, top_lp, ranks
    return picked, None, None, None
