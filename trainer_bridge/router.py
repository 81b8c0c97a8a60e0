"""``ReplicaRouter``: one trainer's view of several rollout engines (data-parallel replicas).

Prompts go to the serving replica with the fewest outstanding tokens (prompt + max_new_tokens × n
of what it is still working on); all ``n`` samples of a prompt stay on one replica (one shared
prefill); a session id sticks to the replica that holds its prefix (multi-turn); results come back
merged in prompt order, as one engine's would. A replica that fails mid-rollout is marked down
(the error names it) and its prompts run again on the others; the weight target brings it back
once it has rejoined and holds the current weights.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch

from rollout.outputs import RolloutOutput, WeightResult
from rollout.sampling_params import SamplingParams
from rollout.server.client import RolloutServerError
from trainer_bridge.replicas import ReplicaError, ReplicaSet, describe
from trainer_bridge.serving import WeightReplica

logger = logging.getLogger(__name__)

__all__ = ["ReplicaError", "ReplicaRouter"]


class ReplicaRouter:
    """A ``RolloutService`` (``trainer_bridge.serving``) over several replicas."""

    def __init__(self, replicas: Union[ReplicaSet, WeightReplica, Sequence[WeightReplica]]):
        self.replicas = replicas if isinstance(replicas, ReplicaSet) else ReplicaSet(replicas)
        self.outstanding = [0] * len(self.replicas)
        self.sessions: dict[str, int] = {}  # routing keys -> the replica their prefix went to
        self.open_sessions: dict[str, int] = {}  # engine sessions -> the replica holding their history
        self._lock = threading.Lock()
        self._dtype = describe(self.replicas.replicas[0])[0]
        self.failures: list[ReplicaError] = []  # every replica failure seen, in order
        self._reported = 0  # failures already handed out by take_replica_failures

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def tp_size(self) -> int:
        """1: each trainer rank routes its own share of the prompts."""
        return 1

    @property
    def address(self) -> str:
        return f"router over {', '.join(self.replicas.url(i) for i in range(len(self.replicas)))}"

    def serving_replicas(self) -> int:
        return len(self.replicas.serving())

    def take_replica_failures(self) -> list[str]:
        with self._lock:
            new, self._reported = self.failures[self._reported:], len(self.failures)
        return [str(e) for e in new]

    def health(self) -> bool:
        """Some replica serves the current weights and answers."""
        return any(self.replicas.healthy(i) for i in self.replicas.serving())

    def pick(self, cost: int, session_id: Optional[str] = None) -> int:
        live = self.replicas.require_serving()
        with self._lock:
            i = self.sessions.get(session_id) if session_id is not None else None
            if i not in live:  # new session, or its replica is gone (its prefix is recomputed elsewhere)
                i = self._least_loaded(live)
                if session_id is not None:
                    self.sessions[session_id] = i
            self.outstanding[i] += cost
            return i

    def generate(self, input_ids: list[list[int]], sampling_params: Union[SamplingParams, list[SamplingParams]],
                 session_ids: Optional[list[str]] = None, session_id: Union[str, list[Optional[str]], None] = None,
                 **kw: Any) -> list[RolloutOutput]:
        """Like ``RolloutEngine.generate``: prompt-major outputs, samples of a prompt together.

        ``session_ids``: routing keys only (a prompt goes where its key went before, for its cached
        prefix). ``session_id``: turns of sessions opened with ``open_session`` (one per prompt, or one
        for a single prompt): each goes to the replica holding its session; if that replica fails, the
        turn fails naming it (the session's history lived there), it is never sent elsewhere."""
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(input_ids)
        sps = [p if isinstance(p, SamplingParams) else SamplingParams.from_dict(p) for p in params]
        turns = ([session_id] if isinstance(session_id, str) else list(session_id)) if session_id is not None \
            else [None] * len(input_ids)
        if len(sps) != len(input_ids) or len(turns) != len(input_ids):
            raise ValueError(f"{len(input_ids)} prompts need as many sampling params and session ids "
                             f"(got {len(sps)} and {len(turns)})")
        cost = [(len(p) + sp.max_new_tokens) * sp.n for p, sp in zip(input_ids, sps)]
        results: dict[int, list[RolloutOutput]] = {}
        todo = list(range(len(input_ids)))
        while todo:  # a failed replica's prompts go round again on the others
            owner = {i: self._owner(i, cost[i], turns[i], session_ids[i] if session_ids else None) for i in todo}
            failed: list[int] = []
            lost: list[ReplicaError] = []
            refused: list[Exception] = []  # a 4xx: the request's fault, not the replica's

            def run(r: int, mine: list[int]) -> None:
                try:
                    sessions = [turns[i] for i in mine]
                    params = [sps[i] for i in mine]  # one object when they are one (the usual single-turn case)
                    outs = self.replicas.replicas[r].generate(
                        input_ids=[input_ids[i] for i in mine],
                        sampling_params=params[0] if all(p is params[0] for p in params) else params,
                        session_id=sessions if any(s is not None for s in sessions) else None, **kw)
                    for o in outs:  # back to the caller's prompt index
                        o.prompt_index = mine[o.prompt_index]
                        results.setdefault(o.prompt_index, []).append(o)
                except RolloutServerError as exc:
                    if exc.status in (400, 413, 422):  # bad input: every replica would refuse it, the caller's fault
                        refused.append(exc)
                        return
                    self._lose(r, exc, mine, turns, failed, lost)
                except Exception as exc:  # noqa: BLE001 - the replica is named and its prompts rerouted
                    self._lose(r, exc, mine, turns, failed, lost)
                finally:
                    with self._lock:
                        self.outstanding[r] -= sum(cost[i] for i in mine)

            by_replica = {r: [i for i in todo if owner[i] == r] for r in sorted(set(owner.values()))}
            threads = [threading.Thread(target=run, args=(r, mine)) for r, mine in by_replica.items()]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if refused:
                raise refused[0]
            if lost:  # a session's history was on the failed replica: its turn cannot run elsewhere
                raise lost[0]
            for i in failed:
                results.pop(i, None)
            todo = sorted(failed)
        return [o for i in range(len(input_ids)) for o in sorted(results[i], key=lambda o: o.sample_index)]

    def _lose(self, r: int, exc: Exception, mine: list[int], turns: list, failed: list[int],
              lost: list[ReplicaError]) -> None:
        """Replica ``r`` failed ``mine``: named, marked down, its prompts to go round again (a session's turn
        cannot: it is lost with the replica that held the session)."""
        err = ReplicaError(r, self.replicas.url(r), exc)
        logger.warning("%s; its %d prompt(s) go to the other replicas", err, len(mine))
        self.failures.append(err)
        self.replicas.mark(r, False)
        failed.extend(mine)
        if any(turns[i] is not None for i in mine):
            lost.append(err)

    def _least_loaded(self, live: list[int]) -> int:
        return min(live, key=lambda k: (self.outstanding[k], k))

    def _owner(self, i: int, cost: int, session: Optional[str], key: Optional[str]) -> int:
        if session is None:
            return self.pick(cost, key)
        with self._lock:
            r = self.open_sessions.get(session)
            if r is None:
                raise ValueError(f"session {session!r} was not opened through this router (open_session)")
            if r not in self.replicas.serving():
                raise ReplicaError(r, self.replicas.url(r), RuntimeError(
                    f"the replica holding session {session!r} is down; its history was there"))
            self.outstanding[r] += cost
            return r

    # ------------------------------------------------------------------ sessions (pinned to one replica)

    def open_session(self, session_id: Optional[str] = None, timeout_s: Optional[float] = None) -> str:
        """Open a session on the least loaded serving replica; its turns all go there."""
        live = self.replicas.require_serving()
        with self._lock:
            r = self._least_loaded(live)
        sid = self.replicas.replicas[r].open_session(session_id, timeout_s)
        with self._lock:
            self.open_sessions[sid] = r
        return sid

    def close_session(self, session_id: str) -> None:
        with self._lock:
            r = self.open_sessions.pop(session_id, None)
        if r is None:
            raise ValueError(f"session {session_id!r} is not open through this router")
        self.replicas.replicas[r].close_session(session_id)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The serving replicas' values; every one must hold the same (else a ``ReplicaError``)."""
        live = self.replicas.require_serving()
        values = {i: self.replicas.replicas[i].get_weights_by_name(name, truncate_size) for i in live}
        for i in live[1:]:
            if values[i] != values[live[0]]:
                raise ReplicaError(i, self.replicas.url(i), ValueError(f"{name} differs from replica {live[0]}"))
        return values[live[0]]

    def _on_serving(self, label: str, call: Callable[[WeightReplica], WeightResult]) -> WeightResult:
        """``call`` on every serving replica: the first failure (naming its replica), else one result
        whose ``freed_bytes`` (if any) is the replicas' sum."""
        results = {i: call(self.replicas.replicas[i]) for i in self.replicas.require_serving()}
        for i, r in results.items():
            if not r.success:
                return WeightResult.fail(f"{label} on replica {i} ({self.replicas.url(i)}): {r.message}")
        first = next(iter(results.values()))
        if "freed_bytes" in first.detail:
            total = sum(int(r.detail["freed_bytes"]) for r in results.values())
            return dataclasses.replace(first, detail={**first.detail, "freed_bytes": total})
        return first

    def release_memory_occupation(self, tags: Optional[list[str]] = None,
                                  backup_weights: bool = False) -> WeightResult:
        return self._on_serving("release_memory_occupation",
                                lambda r: r.release_memory_occupation(tags, backup_weights))

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> WeightResult:
        return self._on_serving("resume_memory_occupation", lambda r: r.resume_memory_occupation(tags))

    def get_weight_versions(self) -> list[Optional[str]]:
        """Every replica's version (None for one that is down)."""
        live = set(self.replicas.serving())
        return [self.replicas.replicas[i].get_weight_version() if i in live else None
                for i in range(len(self.replicas))]
