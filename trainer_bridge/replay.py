"""Trainer-side replay of the engine's sampling: the processed logprobs the engine reported,
recomputed from the trainer's own logits (differentiably), given each token's sampling mask.

The engine's order is replayed with the engine's own processor code (``rollout.layers.sampler``):
logit bias -> repetition / frequency / presence penalties over the history at that position ->
temperature -> the mask (every token the engine's allowed-tokens list, min-tokens ban, top-k, top-p
and min-p dropped is dropped here too) -> log-softmax. Without the mask the trainer's logprob is
normalised over the whole vocabulary while the engine's is normalised over the kept set: the
importance ratio is then off by the kept mass on every token (truncated-support bias).
"""

from __future__ import annotations

from typing import Optional, cast

import torch

from rollout.batch import SamplingInputs, SparseRows
from rollout.sampling_params import SamplingParams


def replay_logprobs(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                    masks: Optional[list[list[int]]], params: SamplingParams) -> torch.Tensor:
    """logits: [T, V] — the trainer's raw logits at the positions that produced each of the T output
    tokens. Returns [T] logprobs of ``output_ids`` under the processed distribution (the engine's
    ``output_token_sampling_logprobs``), differentiable in ``logits``. ``masks`` None: no truncation
    replayed (only bias, penalties and temperature). Greedy tokens (temperature 0) are point masses:
    their logprob is 0, as the engine reports."""
    T, V = logits.shape[0], logits.shape[-1]
    if T != len(output_ids) or (masks is not None and len(masks) != T):
        raise ValueError(f"{T} logits rows, {len(output_ids)} output tokens and "
                         f"{None if masks is None else len(masks)} masks must agree")
    p = params.resolved({})
    temperature = float(p.temperature if p.temperature is not None else 1.0)  # resolved: never None
    if temperature <= 0:
        return logits.new_zeros(T)
    rows = _processor_rows(prompt_ids, output_ids, p)
    info = rows.to_device(V, logits.device)
    from rollout.layers.sampler import apply_logit_processors

    x = apply_logit_processors(logits.float(), info) / temperature
    if masks is not None:
        keep = torch.zeros(T, V, dtype=torch.bool, device=logits.device)
        for t, m in enumerate(masks):
            keep[t, m] = True
        x = x.masked_fill(~keep, float("-inf"))
    return torch.log_softmax(x, dim=-1).gather(1, torch.tensor(output_ids, device=logits.device)[:, None])[:, 0]


def _processor_rows(prompt_ids: list[int], output_ids: list[int], p: SamplingParams) -> SamplingInputs:
    """One sampling row per output position with the history the engine saw when it sampled there."""
    T = len(output_ids)
    rows = SamplingInputs(temperatures=[float(p.temperature if p.temperature is not None else 1.0)] * T,
                          uniforms=[0.0] * T)
    bias = SparseRows()
    for t in range(T):
        for tok, val in (p.logit_bias or {}).items():
            bias.add(t, tok, val)
    rows.bias = bias.triple()
    if p.repetition_penalty != 1.0:
        penalty = float(cast(float, p.repetition_penalty))  # resolved: set
        rep = SparseRows()
        seen = set(prompt_ids)
        for t in range(T):
            rep.extend(t, seen, penalty)
            seen.add(output_ids[t])
        rows.repetition = rep.triple()
    if p.frequency_penalty or p.presence_penalty:
        add = SparseRows()
        counts: dict[int, int] = {}
        for t in range(T):
            for tok, c in counts.items():
                add.add(t, tok, p.frequency_penalty * c + p.presence_penalty)
            counts[output_ids[t]] = counts.get(output_ids[t], 0) + 1
        rows.additive_penalty = add.triple()
    return rows

