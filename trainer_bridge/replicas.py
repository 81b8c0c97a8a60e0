"""``ReplicaSet``: the engine replicas one trainer drives, and which of them serve the current weights.

A replica is anything with the engine's verbs: a ``RolloutClient`` (a server by URL) or an
in-process ``RolloutEngine`` (whose TP ranks may live in other processes). The router sends
prompts only to replicas that are *up*; the weight target marks a replica *down* when it fails
(named in a ``ReplicaError``) and *up* again once it has rejoined the weight-update group and
received the current weights. One set is shared by a trainer rank's router and target.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from weight_sync.layout import dtype_from_name


class ReplicaError(RuntimeError):
    """Replica(s) failed; ``replica`` is the (first) index, ``url`` its address, ``replicas`` all of them."""

    def __init__(self, replica: int, url: str, error, replicas: Optional[list[int]] = None):
        super().__init__(f"replica {replica} ({url}) failed: {error}")
        self.replica, self.url = replica, url
        self.replicas = replicas if replicas is not None else [replica]


def describe(replica) -> tuple[torch.dtype, int]:
    """(dtype, TP size) of a server (asked over HTTP) or of an in-process engine."""
    if hasattr(replica, "get_server_info"):
        info = replica.get_server_info()
        return dtype_from_name(info["dtype"]), int(info["tp_size"])
    return replica.dtype, replica.tp_size


def address(replica) -> str:
    return getattr(replica, "base_url", None) or f"in-process engine {id(replica):#x}"


def is_healthy(replica) -> bool:
    """A server answers ``/health``. An in-process engine shares our process: it counts as healthy,
    and its failures surface as errors of its calls (which name it all the same)."""
    return bool(replica.health()) if hasattr(replica, "health") else True


class ReplicaSet:
    def __init__(self, replicas):
        replicas = list(replicas) if isinstance(replicas, (list, tuple)) else [replicas]
        if not replicas:
            raise ValueError("at least one replica is needed")
        self.replicas = replicas
        self.up = [True] * len(replicas)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.replicas)

    def url(self, i: int) -> str:
        return address(self.replicas[i])

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
