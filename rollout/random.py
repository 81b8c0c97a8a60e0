"""Randomness as a function, not a stream.

Each draw is a pure function of (sample seed, output position): a counter-based hash
(splitmix64 finalizer applied to a mixed key), so a sample's tokens do not depend on batching,
preemption, tensor parallelism or overlap. Sample ``i`` of a request with seed ``s`` uses seed
``s + i``: a request with ``n=8`` draws exactly what eight requests with seeds ``s..s+7`` draw.
"""

from __future__ import annotations

import numpy as np
import torch

_MASK64 = (1 << 64) - 1


def _mix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniforms(seeds: list[int], positions: list[int]) -> np.ndarray:
    """Uniform floats in [0, 1) (float64), one per (seed, position) pair."""
    s = np.array([x & _MASK64 for x in seeds], dtype=np.uint64)
    p = np.array(positions, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = _mix64(s * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x632BE59BD9B4E019))
        z = _mix64(z ^ (p * np.uint64(0xD1B54A32D192ED03) + np.uint64(0x8CB92BA72F3D8DD7)))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def as_int64(x: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch shifts int64 arithmetically)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix64_t(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * as_int64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * as_int64(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


def seed_tensor(seeds: list[int], device=None) -> torch.Tensor:
    """Seeds as int64 bit patterns (a seed is taken modulo 2**64, as ``uniforms`` takes it)."""
    return torch.tensor([as_int64(x) for x in seeds], dtype=torch.int64, device=device)


def device_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``uniforms`` on the tensors' device, bit for bit, with no host round trip: int64 arithmetic wraps
    modulo 2**64 as numpy's uint64 does, so only the shifts need care. ``seeds`` from ``seed_tensor``,
    ``positions`` int64 (>= 0); float64 [N]. Static shapes and no data-dependent control flow: it can run
    inside a captured CUDA graph."""
    z = _mix64_t(seeds * as_int64(0x9E3779B97F4A7C15) + as_int64(0x632BE59BD9B4E019))
    z = _mix64_t(z ^ (positions * as_int64(0xD1B54A32D192ED03) + as_int64(0x8CB92BA72F3D8DD7)))
    return _shr(z, 11).to(torch.float64) * (1.0 / (1 << 53))


def derive_seed(engine_seed: int, request_counter: int) -> int:
    """Seed for a request that did not bring one: a function of the engine seed and its order."""
    return int(uniforms([engine_seed], [request_counter])[0] * (1 << 53))
