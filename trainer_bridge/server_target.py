"""``ServerTarget``: push a trainer's weights into rollout servers reached by URL (one or several
replicas), over their distributed route (one weight-update group the trainer's rank 0 hosts and
every replica's ranks join). Three lines::

    client = RolloutClient("http://127.0.0.1:30000", admin_api_key=key)
    target = ServerTarget(client)                       # rendezvous: the server's ranks join our group
    push_weights(model_engine, target, version="step-7")  # gather (ZeRO-3) -> broadcast buckets -> commit

Each gathered bucket is one staged call of a transaction: the server posts its receives
(``/update_weights_from_distributed`` with ``transaction=True``) while this process broadcasts the
bucket straight from its flat buffer; ``commit`` applies everything on every server rank, or
nothing. Under a multi-rank trainer every rank gathers (a collective), rank 0 alone talks to the
server.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.distributed as dist

from rollout.messages import WeightResult
from trainer_bridge.targets import WeightTarget
from weight_sync.distributed import WeightUpdateSender
from weight_sync.layout import dtype_from_name
from weight_sync.process_group import free_port


class _Call(threading.Thread):
    """An HTTP call that blocks until our broadcasts arrive: run beside them."""

    def __init__(self, fn, *args, **kwargs):
        super().__init__(daemon=True)
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.result = self.error = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller after join
            self.error = exc

    def get(self, timeout_s: float):
        self.join(timeout_s)
        if self.is_alive():
            raise TimeoutError(f"the server did not answer {self.fn.__name__} within {timeout_s}s")
        if self.error is not None:
            raise self.error
        return self.result


class ServerTarget(WeightTarget):
    """One weight-update group hosted by this process (rank 0) and joined by every rank of every
    server given (replica i's TP rank r is rank ``1 + sum(tp of replicas before i) + r``): each bucket
    is broadcast once to all replicas. Each replica commits all-or-nothing; ``commit`` returns the
    first failure, or the first replica's result."""

    def __init__(self, clients, master_address: str = "127.0.0.1", master_port: Optional[int] = None,
                 group_name: str = "trainer-push", backend: str = "gloo", timeout_s: float = 60.0,
                 partial_rollouts: bool = False):
        """``partial_rollouts``: commit in the middle of running requests (pause ``in_place`` →
        commit → continue) instead of waiting for them to finish; their later tokens carry the new
        version (``output_weight_versions``)."""
        self.partial_rollouts = partial_rollouts
        self.clients = list(clients) if isinstance(clients, (list, tuple)) else [clients]
        self.client = self.clients[0]
        self.group_name, self.timeout_s = group_name, timeout_s
        infos = [c.get_server_info() for c in self.clients]
        self.dtype = dtype_from_name(infos[0]["dtype"])
        self.device = torch.device("cpu" if backend == "gloo" else "cuda")
        self.is_sender = not (dist.is_initialized() and dist.get_rank() != 0)
        self.sender: Optional[WeightUpdateSender] = None
        if self.is_sender:
            port = master_port or free_port(master_address)
            sizes = [int(info["tp_size"]) for info in infos]
            world = 1 + sum(sizes)
            offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
            joins = [_Call(c.init_weights_update_group, master_address, port, off, world, group_name, backend,
                           timeout_s) for c, off in zip(self.clients, offsets)]
            self.sender = WeightUpdateSender(master_address, port, world, group_name, backend, timeout_s)
            for i, join in enumerate(joins):
                result = join.get(timeout_s + 10)
                if not result.success:
                    raise RuntimeError(f"replica {i} ({self.clients[i].base_url}) could not join weight group "
                                       f"{group_name!r}: {result.message}")

    def _each(self, fn_name: str, *args, **kwargs) -> list[WeightResult]:
        calls = [_Call(getattr(c, fn_name), *args, **kwargs) for c in self.clients]
        return [call.get(self.timeout_s + 10) for call in calls]

    def begin(self, version: str) -> None:
        if self.is_sender:
            for i, result in enumerate(self._each("begin_weight_update", version)):
                if not result.success:
                    raise RuntimeError(f"replica {i}: {result.message}")

    def add(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        if not self.is_sender:
            return
        names, dtypes, shapes = WeightUpdateSender.describe(named_tensors)
        nbytes = sum(t.numel() * t.element_size() for _, t in named_tensors) + (64 << 10)
        staged = [_Call(c.update_weights_from_distributed, names, dtypes, shapes, self.group_name,
                        bucket_bytes=nbytes, transaction=True) for c in self.clients]
        self.sender.send(named_tensors, bucket_bytes=nbytes)  # one broadcast reaches every replica
        for i, call in enumerate(staged):
            result = call.get(self.timeout_s + 10)
            if not result.success:
                raise RuntimeError(f"replica {i} rejected a bucket: {result.message}")

    def commit(self) -> Optional[WeightResult]:
        if not self.is_sender:
            return None
        if self.partial_rollouts:
            self._each("pause_generation", "in_place")
        try:
            results = self._each("commit_weight_update")
        finally:
            if self.partial_rollouts:
                self._each("continue_generation")
        return next((r for r in results if not r.success), results[0])

    def close(self) -> None:
        if self.sender is not None:
            self._each("destroy_weights_update_group", self.group_name)
            self.sender.close()
            self.sender = None
