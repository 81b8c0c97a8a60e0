"""Tensor-parallel state of this process: rank, size and the device group.

The state is a typed object installed per process (``set_tp_state``), read by the layers when
they are built and when they communicate. TP=1 needs no process group at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TpState:
    tp_rank: int = 0
    tp_size: int = 1
    group: Optional[dist.ProcessGroup] = None

    def __post_init__(self) -> None:
        assert 0 <= self.tp_rank < self.tp_size, (self.tp_rank, self.tp_size)
        assert self.tp_size == 1 or self.group is not None, "TP>1 needs a process group"


_STATE = TpState()


def set_tp_state(state: TpState) -> None:
    global _STATE
    _STATE = state


def get_tp_state() -> TpState:
    return _STATE


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    state = _STATE
    if state.tp_size == 1:
        return x
    dist.all_reduce(x, group=state.group)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard of the last dimension, in rank order."""
    state = _STATE
    if state.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x, group=state.group)
    return torch.cat(parts, dim=-1)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size ({denominator})")
    return numerator // denominator
