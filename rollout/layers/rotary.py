"""Rotary position embeddings with the scaling variants the Llama-family configs use.

Supported ``rope_type``: ``default``, ``linear``, ``llama3``. The cos/sin table covers
``max_position`` positions and is indexed by absolute position, so paged decoding needs no
per-step recomputation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        if torch.get_default_device().type == "meta":  # a model built on meta (the runner rebuilds the tables for
            # real): shapes only — computing them there would run torch's reference decompositions, whose first use
            # imports torch._dynamo (~1 s of every process's start, ~0.5 s of its exit)
            self.register_buffer("cos", torch.empty(max_position, head_dim), persistent=False)
            self.register_buffer("signed_sin", torch.empty(max_position, head_dim), persistent=False)
            return
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        # Not parameters: never loaded, never updated; a buffer so .to(device) moves them.
        self.register_buffer("cos", emb.cos(), persistent=False)
        # rotate_half(x) * sin == x.roll(D / 2) * cat(-sin1, sin2) exactly (negation is exact): the
        # sign is folded into the table once, so a layer rotates with one roll and no cat
        half = emb.shape[-1] // 2
        self.register_buffer("signed_sin", torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], dim=-1),
                             persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) of these positions in ``dtype`` (as Hugging Face rotates), [T, 1, D]
        each: looked up once per forward for every layer, for ``apply_rotary``."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.signed_sin[positions].to(dtype).unsqueeze(1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D]; rotated in their dtype, as Hugging Face does."""
        cos, sin = self.tables(positions, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] with ``RotaryEmbedding.tables`` of its positions."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
