"""Rollout routing replay (R3, arXiv 2510.11370): the trainer's mixture-of-experts model routes each token to
the experts the engine routed it to.

A token the trainer routes to other experts than the engine did has another logprob by construction — the
largest part of the engine/trainer mismatch on MoE models, and one that grows as the router moves during
training. The engine returns each token's experts per layer (``return_routed_experts``:
``RolloutOutput.routed_experts``, SGLang's ``meta_info.routed_experts``); here the ``transformers`` routers
(every ``*TopKRouter``, the ``mlp.gate`` of Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE in transformers v5) are
forced to them for one forward: the router still computes its logits from the trainer's own weights, and the
routing weights are its softmax gathered at the replayed experts (renormalised where the model renormalises),
so the router's gradient flows through the experts that were actually used. Rows without recorded experts
(padding, environment tokens of a multi-turn trajectory, the last token of a sequence) keep the model's own
routing. Works on the bare model and inside DeepSpeed (hooks on the modules: ZeRO-3 gathers as usual).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import Optional

import torch
from torch import nn

from trainer_bridge.push import unwrapped

_LAYER = re.compile(r"layers\.(\d+)\.")


def routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, router module) of every top-k softmax router in a ``transformers`` MoE model."""
    found = []
    for name, module in unwrapped(model).named_modules():
        if type(module).__name__.endswith("TopKRouter") and name.endswith("mlp.gate"):
            layer = _LAYER.search(name)
            if layer is not None:
                found.append((int(layer.group(1)), module))
    return found


def replay_rows(routed: Sequence[Optional[torch.Tensor]], lengths: Sequence[int], width: int) -> torch.Tensor:
    """The batch's forced experts [B, width, layers, top_k] (-1: the model routes that row itself) from each
    sequence's recorded experts (``routed[i]`` [n_i, layers, top_k] for its first n_i positions, or None)."""
    first = next((r for r in routed if r is not None), None)
    if first is None:
        raise ValueError("routing replay: no rollout carries routed experts (the engine must record them: "
                         "enable_return_routed_experts / --enable-return-routed-experts)")
    num_layers, top_k = first.shape[-2:]
    rows = torch.full((len(lengths), width, num_layers, top_k), -1, dtype=torch.long)
    for i, r in enumerate(routed):
        if r is None:
            continue
        if r.dim() != 3 or r.shape[1:] != (num_layers, top_k) or r.shape[0] > lengths[i]:
            raise ValueError(f"sequence {i}: routed experts of shape {list(r.shape)} do not fit its {lengths[i]} "
                             f"tokens x {num_layers} layers x top-{top_k}")
        rows[i, : r.shape[0]] = r.long()
    return rows


@contextlib.contextmanager
def replaying(model: nn.Module, rows: torch.Tensor) -> Iterator[None]:
    """Within the block, every forward of ``model`` over a [B, width] batch routes as ``rows`` [B, width,
    layers, top_k] says (``replay_rows``)."""
    found = routers(model)
    if not found:
        raise ValueError("routing replay: the model has no top-k router (not a transformers v5 mixture of experts)")
    if max(layer for layer, _ in found) >= rows.shape[2]:
        raise ValueError(f"routing replay: the model has routers up to layer {max(layer for layer, _ in found)}, the "
                         f"engine recorded {rows.shape[2]} layers")
    handles = [module.register_forward_hook(_forcing(rows[:, :, layer].reshape(-1, rows.shape[-1]),
                                                     vars(module).get("norm_topk_prob", True)))
               for layer, module in found]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _forcing(forced: torch.Tensor, renormalise: bool):
    def hook(_module, _args, output):
        logits, scores, natural = output
        if logits.shape[0] != forced.shape[0]:
            raise ValueError(f"routing replay: the router saw {logits.shape[0]} tokens, the replayed rows are "
                             f"{forced.shape[0]}")
        want = forced.to(natural.device)
        idx = torch.where(want[:, :1] < 0, natural, want)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, idx)
        if renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(scores.dtype), idx

    return hook
