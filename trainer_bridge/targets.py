"""Where pushed weights go. The interface is the same for every deployment, so a disaggregated
deployment (engines on other devices or hosts, over ``weight_sync.WeightUpdateSender``) only
adds a target."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch

from rollout.engine.engine import RolloutEngine
from rollout.outputs import WeightResult
from weight_sync.bucket import BucketPool
from weight_sync.delta import WeightDelta


class WeightTarget(ABC):
    """One transaction per push: ``begin(version)`` -> ``add(bucket)``* -> ``commit()``.

    ``dtype``: what buckets are cast to (the engines' weights'); ``buffers``: a pool the push packs
    into, reused from push to push (None: a fresh buffer per bucket)."""

    dtype: torch.dtype
    buffers: Optional[BucketPool] = None

    @abstractmethod
    def begin(self, version: str) -> None: ...

    @abstractmethod
    def add(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None: ...

    @abstractmethod
    def commit(self) -> WeightResult:
        """Apply everything added, all-or-nothing; returns the engine's ``WeightResult``."""

    @abstractmethod
    def push_adapter(self, name: str, config: dict, named_tensors: list[tuple[str, torch.Tensor]],
                     version: str) -> WeightResult:
        """A LoRA adapter (peft's config and tensors, whole) as a new version of ``name`` whose tokens
        carry ``version``; only its tensors move. Every trainer rank calls it alike."""

    def push_delta(self, delta: WeightDelta) -> WeightResult:
        """A delta push (``weight_sync.delta``) to every engine, each all-or-nothing; a target that takes none
        refuses it as against the wrong base (``WeightResult.BASE``), so the trainer pushes in full."""
        return WeightResult.fail(f"{type(self).__name__} takes no delta pushes yet: push in full",
                                 kind=WeightResult.BASE)

    def delta_taken_elsewhere(self) -> bool:
        """After a delta refused by its base: whether other engines of the target took it — then the full push
        that follows goes to those that refused alone, and the delta is the new base."""
        return False

    def heal(self) -> bool:
        """Collective on every trainer rank: bring the target's membership up to date; True when the
        current weights must be pushed again. A target whose engines cannot come and go: False."""
        return False

    def take_events(self) -> list[str]:
        """Membership changes since the last call, for the trainer's step log."""
        return []


class ColocatedTarget(WeightTarget):
    """The engine shares this process (external launch: every trainer rank hosts one engine TP
    rank). Buckets hold full tensors already cast to the engine's dtype; each engine rank slices
    its own shard at commit, with no extra communication. Every trainer rank pushes (SPMD)."""

    def __init__(self, engine: RolloutEngine, flush_cache: bool = True):
        self.engine = engine
        self.flush_cache = flush_cache
        self.dtype = engine.dtype
        self.device = engine.device
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._version: Optional[str] = None
        self.buffers = BucketPool()  # push_weights packs into these, reused from push to push

    def begin(self, version: str) -> None:
        self._pending, self._version = [], version

    def add(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self._pending.extend(named_tensors)

    def commit(self) -> WeightResult:
        pending, self._pending = self._pending, []
        return self.engine.update_weights_from_tensor(pending, weight_version=self._version,
                                                      flush_cache=self.flush_cache)

    def push_delta(self, delta: WeightDelta) -> WeightResult:
        return self.engine.update_weights_from_delta(delta, flush_cache=self.flush_cache)

    def push_adapter(self, name: str, config: dict, named_tensors: list[tuple[str, torch.Tensor]],
                     version: str) -> WeightResult:
        return self.engine.load_lora_adapter_from_tensors(name, named_tensors, config, weight_version=version)
