"""``ReplicaRouter``: one trainer's view of several rollout servers (data-parallel replicas).

Prompts go to the replica with the fewest outstanding tokens (prompt + max_new_tokens × n of what
it is still working on); all ``n`` samples of a prompt stay on one replica (one shared prefill); a
session id sticks to the replica that holds its prefix (multi-turn); results come back merged in
prompt order, as one engine's would. A replica that fails is named in the error.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from rollout.outputs import RolloutOutput
from rollout.sampling_params import SamplingParams
from rollout.server.client import RolloutClient
from weight_sync.layout import dtype_from_name


class ReplicaError(RuntimeError):
    """A replica failed a request; ``replica`` is its index, ``url`` its address."""

    def __init__(self, replica: int, url: str, error: BaseException):
        super().__init__(f"replica {replica} ({url}) failed: {error}")
        self.replica, self.url = replica, url


class ReplicaRouter:
    tp_size = 1  # generation is driven from one trainer rank

    def __init__(self, clients: list[RolloutClient]):
        if not clients:
            raise ValueError("a router needs at least one replica")
        self.clients = list(clients)
        self.outstanding = [0] * len(clients)
        self.sessions: dict[str, int] = {}
        self._lock = threading.Lock()
        self.dtype: torch.dtype = dtype_from_name(clients[0].get_server_info()["dtype"])

    def pick(self, cost: int, session_id: Optional[str] = None) -> int:
        with self._lock:
            if session_id is not None and session_id in self.sessions:
                i = self.sessions[session_id]
            else:
                i = min(range(len(self.clients)), key=lambda k: (self.outstanding[k], k))
                if session_id is not None:
                    self.sessions[session_id] = i
            self.outstanding[i] += cost
            return i

    def generate(self, input_ids: list[list[int]], sampling_params: SamplingParams,
                 session_ids: Optional[list[str]] = None, **kw) -> list[RolloutOutput]:
        """Like ``RolloutEngine.generate``: prompt-major outputs, samples of a prompt together."""
        sp = sampling_params if isinstance(sampling_params, SamplingParams) else SamplingParams.from_dict(
            sampling_params)
        cost = [(len(p) + sp.max_new_tokens) * sp.n for p in input_ids]
        owner = [self.pick(c, session_ids[i] if session_ids else None) for i, c in enumerate(cost)]
        results: dict[int, list[RolloutOutput]] = {}
        errors: list[ReplicaError] = []

        def run(r: int) -> None:
            mine = [i for i, o in enumerate(owner) if o == r]
            try:
                outs = self.clients[r].generate(input_ids=[input_ids[i] for i in mine], sampling_params=sp, **kw)
                for o in outs:  # back to the caller's prompt index
                    o.prompt_index = mine[o.prompt_index]
                    results.setdefault(o.prompt_index, []).append(o)
            except Exception as exc:  # noqa: BLE001 - re-raised below, naming the replica
                errors.append(ReplicaError(r, self.clients[r].base_url, exc))
            finally:
                with self._lock:
                    self.outstanding[r] -= sum(cost[i] for i in mine)

        threads = [threading.Thread(target=run, args=(r,)) for r in sorted(set(owner))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return [o for i in range(len(input_ids)) for o in sorted(results[i], key=lambda o: o.sample_index)]

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """Replica 0's values; every replica must hold the same (else a ``ReplicaError``)."""
        values = [c.get_weights_by_name(name, truncate_size) for c in self.clients]
        for i, v in enumerate(values[1:], start=1):
            if v != values[0]:
                raise ReplicaError(i, self.clients[i].base_url, ValueError(f"{name} differs from replica 0"))
        return values[0]

    def get_weight_versions(self) -> list[str]:
        return [c.get_weight_version() for c in self.clients]
