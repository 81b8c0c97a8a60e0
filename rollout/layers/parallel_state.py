"""Tensor-parallel state of this process: rank, size and the device communicator.

The state is a typed object installed while a model is built (``tp_state_context``), kept by each layer
that communicates. TP=1 needs no communicator at all. The communicator
wraps either a free-standing process group (the engine's own rendezvous: the caller's default
group, if any, is never touched) or a group of the caller's ``torch.distributed`` job.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


class Communicator:
    """Collectives over one group: a raw ``ProcessGroup`` or a registered ``dist`` group."""

    def __init__(self, pg: Optional[dist.ProcessGroup] = None, group: Optional[dist.ProcessGroup] = None):
        assert (pg is None) != (group is None)
        self.pg, self.group = pg, group

    def close(self) -> None:
        """Drop the group: its owner is tearing it down (a closed communicator serves no collective)."""
        self.pg = self.group = None

    def all_reduce(self, x: torch.Tensor) -> None:
        if self.pg is not None:
            self.pg.allreduce([x]).wait()
        else:
            dist.all_reduce(x, group=self.group)

    def all_gather(self, x: torch.Tensor, world: int) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(world)]
        if self.pg is not None:
            self.pg.allgather([parts], [x]).wait()
        else:
            dist.all_gather(parts, x, group=self.group)
        return parts

    def broadcast(self, x: torch.Tensor, src_rank: int) -> None:
        """``src_rank`` is the rank within this group."""
        if self.pg is not None:
            opts = dist.BroadcastOptions()
            opts.rootRank = src_rank
            self.pg.broadcast([x], opts).wait()
        else:
            dist.broadcast(x, src=dist.get_global_rank(self.group, src_rank), group=self.group)


@dataclass(frozen=True)
class TpState:
    tp_rank: int = 0
    tp_size: int = 1
    comm: Optional[Communicator] = None

    def __post_init__(self) -> None:
        assert 0 <= self.tp_rank < self.tp_size, (self.tp_rank, self.tp_size)
        assert self.tp_size == 1 or self.comm is not None, "TP>1 needs a communicator"


_STATE = TpState()


def get_tp_state() -> TpState:
    return _STATE


@contextlib.contextmanager
def tp_state_context(state: TpState):
    """Install ``state`` while a model is built (layers read it at construction)."""
    global _STATE
    old, _STATE = _STATE, state
    try:
        yield state
    finally:
        _STATE = old


def tp_all_reduce(x: torch.Tensor, state: TpState) -> torch.Tensor:
    """Sum over the TP group of ``state`` (each layer keeps the state it was built under, so two
    engines in one process never share a group by accident)."""
    if state.tp_size > 1:
        state.comm.all_reduce(x)
    return x


def tp_all_gather_last_dim(x: torch.Tensor, state: TpState) -> torch.Tensor:
    """Concatenate each rank's shard of the last dimension, in rank order."""
    if state.tp_size == 1:
        return x
    return torch.cat(state.comm.all_gather(x.contiguous(), state.tp_size), dim=-1)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size ({denominator})")
    return numerator // denominator
