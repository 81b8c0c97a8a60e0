"""``ReplicaSet``: the engine replicas one trainer drives, and which of them serve the current weights.

A replica is a ``WeightReplica`` (``trainer_bridge.serving``): a ``RolloutClient`` (a server by URL)
or an in-process ``RolloutEngine`` (whose TP ranks may live in other processes). The router sends
prompts only to replicas that are *up*; the weight target marks a replica *down* when it fails
(named in a ``ReplicaError``) and *up* again once it has rejoined the weight-update group and
received the current weights. One set is shared by a trainer rank's router and target.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Optional, Union, cast

import torch

from trainer_bridge.serving import WeightReplica


class ReplicaError(RuntimeError):
    """Replica(s) failed; ``replica`` is the (first) index, ``url`` its address, ``replicas`` all of them."""

    def __init__(self, replica: int, url: str, error, replicas: Optional[list[int]] = None):
        super().__init__(f"replica {replica} ({url}) failed: {error}")
        self.replica, self.url = replica, url
        self.replicas = replicas if replicas is not None else [replica]


def describe(replica: WeightReplica) -> tuple[torch.dtype, int]:
    """(dtype, ranks in a weight-update group) of a replica: a server (asked over HTTP once) or an
    in-process engine."""
    return replica.dtype, replica.group_ranks


class ReplicaSet:
    def __init__(self, replicas: Union[WeightReplica, Sequence[WeightReplica]]):
        listed = list(replicas) if isinstance(replicas, (list, tuple)) else [cast(WeightReplica, replicas)]
        if not listed:
            raise ValueError("at least one replica is needed")
        self.replicas = listed
        self.up = [True] * len(listed)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.replicas)

    def url(self, i: int) -> str:
        return self.replicas[i].address

    def healthy(self, i: int) -> bool:
        """A server answers ``/health``; an in-process engine's loop still runs (its failures
        surface as errors of its calls, which name it all the same)."""
        return bool(self.replicas[i].health())

    def serving(self) -> list[int]:
        with self._lock:
            return [i for i, u in enumerate(self.up) if u]

    def mark(self, i: int, up: bool) -> None:
        with self._lock:
            self.up[i] = up

    def set_up(self, mask: list[bool]) -> None:
        with self._lock:
            self.up = list(mask)

    def require_serving(self) -> list[int]:
        live = self.serving()
        if not live:
            raise RuntimeError(f"no replica serves the current weights (all {len(self)} failed: "
                               f"{', '.join(self.url(i) for i in range(len(self)))})")
        return live
