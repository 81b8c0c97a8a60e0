"""``DistributedTarget``: push a trainer's weights into engine replicas in other processes over one
weight-update group (NCCL on GPU, gloo on CPU). A replica is a rollout server reached by URL
(``RolloutClient``) or an in-process ``RolloutEngine`` whose TP ranks join the group::

    client = RolloutClient("http://127.0.0.1:30000", admin_api_key=key)
    target = DistributedTarget(client)                    # rendezvous: the replica's ranks join our group
    push_weights(model_engine, target, version="step-7")  # gather (ZeRO-3) -> broadcast buckets -> commit

The trainer's rank 0 hosts the group (rank 0) and every replica's TP ranks join it (replica i's
rank r is ``1 + sum(tp of the members before i) + r``): each bucket is broadcast once to every
replica. Each gathered bucket is one staged call of a transaction on each replica (its receives are
posted by ``/update_weights_from_distributed`` with ``transaction=True``); the broadcast runs in
the background while the trainer gathers the next bucket, and ``commit`` applies everything on
every replica, or nothing. ZeRO-3 gathering stays a collective on every trainer rank; only rank 0
talks to the replicas, and ``commit``'s outcome is shared with every rank.

Failures: a replica that dies (or stops answering) mid-push makes ``commit`` raise a
``ReplicaError`` naming it on every trainer rank, within the group's timeout; the others abort
the transaction and keep their weights. ``heal()`` (collective) drops dead replicas, takes back
restarted ones with a fresh group, and says whether the current weights must be pushed again; a
replica serves (``ReplicaSet.up``) only once it holds them.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

from rollout.outputs import WeightResult
from trainer_bridge.replicas import ReplicaError, ReplicaSet, describe
from trainer_bridge.serving import WeightReplica
from trainer_bridge.targets import WeightTarget
from weight_sync.bucket import BucketPool
from weight_sync.delta import WeightDelta
from weight_sync.distributed import ADAPTER_BUCKET_BYTES, WeightUpdateSender
from weight_sync.process_group import free_port

logger = logging.getLogger(__name__)
# a delta's buckets: deltas are a few percent of the model; one bucket per message keeps gloo's per-message cost low
DELTA_BUCKET_BYTES = 64 << 20


class _Call(threading.Thread):
    """A call that blocks until our broadcasts arrive (or a background send): run beside them;
    ``label`` names it in a timeout."""

    def __init__(self, label: str, fn: Callable[..., Any], *args: Any, **kwargs: Any):
        super().__init__(daemon=True)
        self.label, self.fn, self.args, self.kwargs = label, fn, args, kwargs
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by get()
            self.error = exc

    def get(self, timeout_s: float):
        self.join(timeout_s)
        if self.is_alive():
            raise TimeoutError(f"{self.label} did not return within {timeout_s}s")
        if self.error is not None:
            raise self.error
        return self.result


class DistributedTarget(WeightTarget):
    def __init__(self, replicas, master_address: str = "127.0.0.1", master_port: Optional[int] = None,
                 group_name: str = "trainer-push", backend: Optional[str] = None, timeout_s: float = 60.0,
                 partial_rollouts: bool = False):
        """``replicas``: one replica, a list, or the ``ReplicaSet`` the router uses.
        ``partial_rollouts``: commit in the middle of running requests (pause ``in_place`` → commit →
        continue) instead of waiting for them to finish; their later tokens carry the new version."""
        self.replicas = replicas if isinstance(replicas, ReplicaSet) else ReplicaSet(replicas)
        self.partial_rollouts = partial_rollouts
        self.master_address, self.master_port = master_address, master_port
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")  # NCCL on GPU, gloo on CPU
        self.group_name, self.backend, self.timeout_s = group_name, backend, timeout_s
        self.dtype = describe(self.replicas.replicas[0])[0]
        self.device = torch.device("cpu" if backend == "gloo" else "cuda")
        self.is_sender = not (dist.is_initialized() and dist.get_rank() != 0)
        self.sender: Optional[WeightUpdateSender] = None
        self.members: list[int] = []  # replicas in the current group (rank 0's view)
        self.ranks: dict[int, list[int]] = {}  # member -> its engine ranks in the group
        # members a catch-up push goes to alone (those that refused a delta the others took), until its commit
        self.behind: list[int] = []
        self.group = ""  # the current group's name
        self._generation = 0
        self._wire: Optional[_Call] = None  # sends the queued buckets, in order, one at a time
        self._queue: queue.Queue = queue.Queue()
        self._failed: dict[int, str] = {}  # replica -> why, in this push
        self._rejected: Optional[str] = None  # a replica refused a bucket (bad input, not a failure)
        self._broken = False  # the group must be rebuilt before the next push
        self.events: list[str] = []  # membership changes, for the trainer's step log (rank 0)
        self.buffers = BucketPool()  # push_weights packs into these, reused from push to push
        if self.is_sender:
            self._connect(self.replicas.serving())
            if self._failed:
                raise self._error()
        self._share(None)

    # ------------------------------------------------------------------ the group

    def _connect(self, members: list[int]) -> None:
        """Build a fresh group with ``members`` (rank 0). Replicas that fail to join land in ``_failed``."""
        if self.sender is not None:  # the old group: closed here, destroyed on the replicas still answering
            self.sender.close()
            self.sender = None
            group = self.group
            self._each("destroy_weights_update_group", lambda r: r.destroy_weights_update_group(group),
                       among=[m for m in self.members if m in members])
        self._failed = {}  # from here on: who could not join the new group
        self.members = []
        if not members:
            return
        port = (self.master_port if self._generation == 0 and self.master_port else free_port(self.master_address))
        self.group = self.group_name if self._generation == 0 else f"{self.group_name}-{self._generation}"
        self._generation += 1
        sizes = {}
        for i in members:
            try:
                sizes[i] = describe(self.replicas.replicas[i])[1]
            except Exception as exc:  # noqa: BLE001 - named below
                self._failed[i] = f"could not be reached ({type(exc).__name__}: {exc})"
        members = [i for i in members if i in sizes]
        world = 1 + sum(sizes.values())
        offsets, off = {}, 1
        for i in members:
            offsets[i], off = off, off + sizes[i]
        self.ranks = {i: list(range(offsets[i], offsets[i] + sizes[i])) for i in members}
        joins = {i: _Call("init_weights_update_group", self.replicas.replicas[i].init_weights_update_group,
                          self.master_address, port, offsets[i], world, self.group, self.backend, self.timeout_s)
                 for i in members}
        try:
            self.sender = WeightUpdateSender(self.master_address, port, world, self.group, self.backend,
                                             self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - somebody did not join: the joins say who
            logger.warning("weight group %r: %s", self.group, exc)
        for i, join in joins.items():
            try:
                result = join.get(self.timeout_s + 10)
                if not result.success:
                    self._failed[i] = f"could not join weight group {self.group!r}: {result.message}"
            except Exception as exc:  # noqa: BLE001
                self._failed[i] = f"could not join weight group {self.group!r}: {type(exc).__name__}: {exc}"
        if self.sender is None and not self._failed:
            self._failed = {i: f"weight group {self.group!r} did not form" for i in members}
        if self._failed:  # a group missing a member is useless: the next heal rebuilds it
            self._broken = True
        self.members = members

    def _each(self, label: str, call: Callable[[WeightReplica], Any],
              among: Optional[list[int]] = None) -> dict[int, Any]:
        """``call(replica)`` on every member (or ``among``) at once; a replica that raises or does not
        answer lands in ``_failed`` (a refusal comes back as its failed ``WeightResult``)."""
        calls = {i: _Call(label, call, self.replicas.replicas[i]) for i in (self.members if among is None else among)}
        out = {}
        for i, running in calls.items():
            try:
                out[i] = running.get(self.timeout_s + 10)
            except Exception as exc:  # noqa: BLE001 - the replica is named in the push's error
                self._failed[i] = f"{label}: {type(exc).__name__}: {exc}"
        return out

    def _share(self, payload):
        """Rank 0's ``payload`` and up-mask to every trainer rank (all ranks call this alike)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return payload
        box = [(payload, self.replicas.up)]
        dist.broadcast_object_list(box, src=0)
        payload, up = box[0]
        self.replicas.set_up(up)
        return payload

    def _error(self) -> ReplicaError:
        first, *others = sorted(self._failed)
        why = "; ".join([self._failed[first]] + [f"also replica {i} ({self.replicas.url(i)}): {self._failed[i]}"
                                                 for i in others])
        return ReplicaError(first, self.replicas.url(first), f"{why} (weight group {self.group!r})",
                            replicas=[first, *others])

    def _find_dead(self) -> None:
        """After a group failure: which members are gone (they fail their health check)?"""
        for i in self.members:
            if i not in self._failed and not self.replicas.healthy(i):
                self._failed[i] = "stopped answering during the push"

    # ------------------------------------------------------------------ one push

    def begin(self, version: str) -> None:
        self._failed, self._rejected = {}, None
        if not self.is_sender:
            return
        if self._broken or not self.members:  # refused at commit, naming who is missing
            self._failed = {i: "not in a working weight group (heal() rebuilds it)"
                            for i in range(len(self.replicas)) if i not in self.members or self._broken}
            return
        for i, result in self._each("begin_weight_update", lambda r: r.begin_weight_update(version),
                                    among=self._targets()).items():
            if not result.success:
                self._rejected = f"replica {i}: {result.message}"

    def _targets(self) -> list[int]:
        """The members this push goes to: all of them, or those behind alone (a catch-up push)."""
        return [m for m in self.members if m in self.behind] if self.behind else self.members

    def add(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Queue this bucket for the wire and return: the trainer gathers the next ones while the
        queued ones go out in order (each bucket has its own buffer). Never raises (every trainer
        rank must keep gathering); ``commit`` reports what went wrong."""
        if not self.is_sender or self._failed or self._rejected or self._broken:
            return
        if self._wire is None:
            self._wire = _Call("the wire thread", self._drain)
        self._queue.put(named_tensors)

    def _drain(self) -> None:
        """The wire thread: send queued buckets until the end mark; after a failure, drop the rest."""
        while (bucket := self._queue.get()) is not None:
            if not (self._failed or self._rejected or self._broken):
                self._send(bucket)

    def _send(self, named_tensors) -> None:
        names, dtypes, shapes = WeightUpdateSender.describe(named_tensors)
        nbytes = sum(t.numel() * t.element_size() for _, t in named_tensors) + (64 << 10)
        targets = self._targets()
        alone = {"point_to_point": True} if self.behind else {}  # a catch-up: sent to their ranks alone
        staged = {i: _Call("update_weights_from_distributed", self.replicas.replicas[i].update_weights_from_distributed,
                           names, dtypes, shapes, self.group, bucket_bytes=nbytes, load_format="rollout_bucket",
                           transaction=True, **alone)
                  for i in targets}
        try:
            assert self.sender is not None  # a bucket is queued only while the group stands
            to = [r for i in targets for r in self.ranks[i]] if self.behind else None
            self.sender.send(named_tensors, bucket_bytes=nbytes, to=to)  # one broadcast reaches every replica
        except Exception as exc:  # noqa: BLE001 - a peer is gone: find out which
            logger.warning("weight group %r: %s", self.group, exc)
            self._broken = True
        for i, call in staged.items():
            try:
                result = call.get(self.timeout_s + 10)
                if not result.success:
                    if result.error_kind == WeightResult.GROUP:  # its receive failed: the group broke
                        self._broken = True
                    else:
                        self._rejected = f"replica {i} rejected a bucket: {result.message}"
            except Exception as exc:  # noqa: BLE001
                self._failed[i] = f"update_weights_from_distributed: {type(exc).__name__}: {exc}"
        if self._broken:
            self._find_dead()

    def _wait_pending(self) -> None:
        """Every queued bucket is through (or dropped after a failure)."""
        if self._wire is None:
            return
        self._queue.put(None)
        try:
            self._wire.get(2 * self.timeout_s + 20)
        except Exception as exc:  # noqa: BLE001 - a hung send: the group is unusable
            self._broken = True
            self._find_dead()
            logger.warning("weight group %r: %s", self.group, exc)
            self._queue = queue.Queue()  # a hung thread keeps the old one
        self._wire = None

    def commit(self) -> WeightResult:
        """Apply on every replica or none (a catch-up push: on those behind, or none of them). Returns the first
        refusal (or the first replica's result); raises ``ReplicaError`` on every trainer rank when a replica
        failed."""
        payload = None
        if self.is_sender:
            self._wait_pending()
            if self._broken and not self._failed:
                self._find_dead()
            targets = self._targets()
            if not (self._failed or self._rejected or self._broken):
                if self.partial_rollouts:
                    self._each("pause_generation", lambda r: r.pause_generation("in_place"), among=targets)
                try:
                    results = self._each("commit_weight_update", lambda r: r.commit_weight_update(), among=targets)
                finally:
                    if self.partial_rollouts:
                        self._each("continue_generation", lambda r: r.continue_generation(),
                                   among=[m for m in targets if m not in self._failed])
                bad = [r for r in results.values() if not r.success]
                if not self._failed:
                    for i in targets:
                        self.replicas.mark(i, True)  # rejoined replicas serve from now on
                    payload = ("result", bad[0] if bad else results[targets[0]])
            if payload is None:
                survivors = [m for m in targets if m not in self._failed]
                self._each("abort_weight_update", lambda r: r.abort_weight_update(),
                           among=survivors)  # they keep the weights they had
                if self._failed:
                    for i in self._failed:
                        self.replicas.mark(i, False)
                    self._broken = True
                    payload = ("error", self._error())
                elif self._broken:
                    payload = ("error", ReplicaError(-1, self.group, "the weight group broke but every replica "
                                                     "answers its health check", replicas=[]))
                else:
                    payload = ("result", WeightResult.fail(self._rejected or "a replica refused the push"))
        self.behind = []  # (every trainer rank) the catch-up, if this was one, is over
        kind, value = self._share(payload)
        if kind == "error":
            raise value
        return value

    # ------------------------------------------------------------------ deltas

    def push_delta(self, delta: WeightDelta) -> WeightResult:
        """A delta push (``weight_sync.delta``) to every member: each posts its receives
        (``update_weights_from_delta_distributed``) while rank 0 broadcasts the delta's tensors once, then
        applies it all or nothing against the base its header names. A member holding another base refuses
        (``WeightResult.BASE``, after receiving: the group stays in step) and that result comes back, so the
        trainer pushes in full: where other members took the delta, to those that refused alone (``behind``,
        ``delta_taken_elsewhere``: the next push's buckets go point to point to their ranks), else to every
        member; the next push is a delta again. A replica that fails is named in a ``ReplicaError`` on every
        trainer rank, as for a full push."""
        result, behind = self._one_call(lambda: self._send_delta(delta))
        self.behind = behind
        return result

    def delta_taken_elsewhere(self) -> bool:
        return bool(self.behind)

    def _one_call(self, send: Callable[[], tuple[str, Any]]) -> Any:
        """A push in one call to every member (``send`` on rank 0: its result), its outcome shared with every
        trainer rank; members that failed are marked down and named in the ``ReplicaError`` raised."""
        payload = None
        if self.is_sender:
            self._failed, self._rejected = {}, None
            self._wait_pending()
            if self._broken or not self.members:
                self._failed = {i: "not in a working weight group (heal() rebuilds it)"
                                for i in range(len(self.replicas)) if i not in self.members or self._broken}
            else:
                payload = send()
            if self._failed:
                for i in self._failed:
                    self.replicas.mark(i, False)
                self._broken = True
                payload = ("error", self._error())
        kind, value = self._share(payload)
        if kind == "error":
            raise value
        return value

    def _send_delta(self, delta: WeightDelta) -> tuple[str, Any]:
        named = delta.named_tensors()
        names, dtypes, shapes = WeightUpdateSender.describe(named)
        results = self._broadcast("update_weights_from_delta_distributed", "a delta push", named, DELTA_BUCKET_BYTES,
                                  lambda r: r.update_weights_from_delta_distributed(
                                      delta.header(), names, dtypes, shapes, self.group, bucket_bytes=DELTA_BUCKET_BYTES))
        bad = [r for r in results.values() if not r.success]
        base = [i for i, r in results.items() if not r.success and r.error_kind == WeightResult.BASE]
        if not base:
            return ("result", (bad[0] if bad else results[self.members[0]], []))
        took = [i for i, r in results.items() if r.success]
        if not took or len(bad) > len(base):  # nobody took it, or some refused it otherwise: a full push to all
            return ("result", (results[base[0]], []))
        first = results[base[0]]
        return ("result", (WeightResult.fail(f"replica {base[0]} ({self.replicas.url(base[0])}) refused the delta: "
                                             f"{first.message}; replicas {took} took it", kind=WeightResult.BASE),
                           base))

    def _broadcast(self, label: str, what: str, named: list[tuple[str, torch.Tensor]], bucket_bytes: int,
                   receive: Callable[[WeightReplica], WeightResult]) -> dict[int, WeightResult]:
        """``receive(replica)`` on every member at once while rank 0 broadcasts ``named`` once in buckets of
        ``bucket_bytes``; each member's result. A peer that is gone breaks the group: the members that stopped
        answering are named in ``_failed`` (all of them where none can be told apart)."""
        calls = {i: _Call(label, receive, self.replicas.replicas[i]) for i in self.members}
        try:
            assert self.sender is not None
            self.sender.send(named, bucket_bytes=bucket_bytes)  # one broadcast reaches every replica
        except Exception as exc:  # noqa: BLE001 - a peer is gone: find out which
            logger.warning("weight group %r: %s", self.group, exc)
            self._broken = True
        results = {}
        for i, call in calls.items():
            try:
                results[i] = call.get(self.timeout_s + 10)
                if not results[i].success and results[i].error_kind == WeightResult.GROUP:
                    self._broken = True
            except Exception as exc:  # noqa: BLE001
                self._failed[i] = f"{label}: {type(exc).__name__}: {exc}"
        if self._broken:
            self._find_dead()
            if not self._failed:
                self._failed = {i: f"its weight group broke during {what}" for i in self.members}
        return results

    # ------------------------------------------------------------------ adapters

    def push_adapter(self, name: str, config: dict, named_tensors: list[tuple[str, torch.Tensor]],
                     version: str) -> WeightResult:
        """A LoRA adapter to every member: each posts its receives (``load_lora_adapter_from_distributed``)
        while rank 0 broadcasts the tensors once, in buckets. The base weights never move. A refusal
        comes back as the failed result (replicas that took it serve the new version, the others keep
        the one they had); a replica that fails is named in a ``ReplicaError`` on every trainer rank,
        marked down, and ``heal`` rebuilds the group (the adapter is pushed again then). Each replica
        holds a whole version, never part of one: the others may already serve the new one."""
        return self._one_call(lambda: self._send_adapter(name, config, named_tensors, version))

    def _send_adapter(self, name: str, config: dict, named_tensors: list[tuple[str, torch.Tensor]],
                      version: str) -> tuple[str, Any]:
        names, dtypes, shapes = WeightUpdateSender.describe(named_tensors)
        results = self._broadcast("load_lora_adapter_from_distributed", "an adapter push", named_tensors,
                                  ADAPTER_BUCKET_BYTES, lambda r: r.load_lora_adapter_from_distributed(
                                      name, config, names, dtypes, shapes, self.group, load_format="rollout_bucket",
                                      bucket_bytes=ADAPTER_BUCKET_BYTES, weight_version=version))
        bad = [r for r in results.values() if not r.success]
        if not self._failed and not bad:
            for i in self.members:
                self.replicas.mark(i, True)  # rejoined replicas serve once they hold the adapter
        return ("result", bad[0] if bad else results[self.members[0]])

    # ------------------------------------------------------------------ membership

    def heal(self) -> bool:
        """Collective on every trainer rank. Drops members that fail their health check, takes back
        replicas that answer again (a fresh group for all), and returns True when the current weights
        must be pushed (a rejoined replica, or a push that failed); until then a rejoined replica
        does not serve."""
        repush = False
        if self.is_sender:
            healthy = [i for i in range(len(self.replicas)) if self.replicas.healthy(i)]
            for i in range(len(self.replicas)):
                if i not in healthy:
                    self.replicas.mark(i, False)
            back = [i for i in healthy if i not in self.members]
            lost = [i for i in self.members if i not in healthy]
            if back or lost or self._broken:
                for i in lost:
                    self._event(f"replica {i} ({self.replicas.url(i)}) failed its health check: "
                                "left the weight group; the others carry on")
                repush = bool(back) or self._broken
                self._broken = False
                self._connect(healthy)
                while self._failed:  # those that could not join stay out; the rest try again
                    for i in self._failed:
                        self.replicas.mark(i, False)
                    self._broken = False
                    self._connect([i for i in self.members if i not in self._failed])
                for i in back:
                    if i in self.members:
                        self._event(f"replica {i} ({self.replicas.url(i)}) rejoined with a fresh group; "
                                    "it serves once it holds the current weights")
                        self.replicas.mark(i, False)
        return bool(self._share(repush))

    def take_events(self) -> list[str]:
        events, self.events = self.events, []
        return events

    def _event(self, text: str) -> None:
        logger.warning("%s", text)
        self.events.append(text)

    def close(self) -> None:
        if self.sender is not None:
            group = self.group
            self._each("destroy_weights_update_group", lambda r: r.destroy_weights_update_group(group))
            self.sender.close()
            self.sender = None
