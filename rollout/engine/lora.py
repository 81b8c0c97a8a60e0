"""``EngineLora``: the engine's side of LoRA adapters, owned by ``RolloutEngine``.

An adapter comes from a PEFT folder (read and checked here, on the caller's thread) or from tensors
and a config given in memory; it is loaded into a free slot on every TP rank at the next step
boundary (running requests go on: they are on other slots or on none), all or nothing, and
published to the scheduler's ``LoraRegistry`` only once every rank holds it. Nothing about the base
weights changes: no repacking, no flush, no new weight version. Loading a name already loaded adds a
new version beside the old one (requests that started on the old one finish on it; its slot is
emptied at the next adapter operation after they have). Unloading a name that running requests use
is refused, saying how many.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from rollout.engine.loop import EngineLoop
from rollout.engine.weights import EngineWeights
from rollout.outputs import WeightResult
from rollout.scheduler.lora_registry import LoraRegistry
from rollout.scheduler.scheduler import Scheduler
from rollout.weights.lora import AdapterConfig, read_peft_folder
from rollout.weights.safetensors_io import FolderNotAllowed
from rollout.worker.messages import LoadLora, ReceiveLora, UnloadLora
from rollout.worker.tp_worker import BaseTpWorker


def _check_name(name) -> str:
    if not isinstance(name, str) or not name or len(name) > 256 or any(c in name for c in "\x00\n\r"):
        raise ValueError("lora_name must be a non-empty string (at most 256 characters, no control characters)")
    return name


class EngineLora:
    def __init__(self, worker: BaseTpWorker, scheduler: Scheduler, loop: EngineLoop, weights: EngineWeights,
                 max_rank: int, max_memory_mb: Optional[float]):
        self.worker = worker
        self.scheduler = scheduler
        self.loop = loop
        self.weights = weights  # EngineWeights: its bucket carries tensors to spawned ranks
        self.max_rank = max_rank
        self.max_memory_bytes = None if max_memory_mb is None else int(max_memory_mb * 1e6)

    @property
    def registry(self) -> LoraRegistry:
        return self.scheduler.loras

    def load_from_folder(self, name: str, path: str, pinned: bool = False, allowed=(),
                         weight_version: Optional[str] = None) -> WeightResult:
        t0 = time.perf_counter()
        _check_name(name)
        try:
            config, named = read_peft_folder(path, allowed)
        except FolderNotAllowed:
            raise  # the server answers 403
        except (ValueError, OSError) as exc:
            return WeightResult.fail(f"adapter {name!r}: {exc}").published(self.scheduler.weight_version,
                                                                           time.perf_counter() - t0)
        return self._load(name, config, named, str(path), pinned, t0, weight_version)

    def load_from_tensors(self, name: str, tensors, config: dict, pinned: bool = False,
                          weight_version: Optional[str] = None) -> WeightResult:
        """``tensors``: a dict or (name, tensor) pairs under peft's names; ``config``: peft's LoRA config."""
        t0 = time.perf_counter()
        _check_name(name)
        named = list(tensors.items()) if isinstance(tensors, dict) else list(tensors)
        try:
            AdapterConfig.from_peft(config)
        except ValueError as exc:
            return WeightResult.fail(f"adapter {name!r}: {exc}").published(self.scheduler.weight_version,
                                                                           time.perf_counter() - t0)
        return self._load(name, dict(config), named, "tensors", pinned, t0, weight_version)

    def load_from_distributed(self, name: str, config: dict, spec: tuple, pinned: bool = False,
                              weight_version: Optional[str] = None) -> WeightResult:
        """``spec``: ``ReceiveLora``'s (names, dtypes, shapes, group_name, bucket_bytes, load_format). A
        refused call still receives (drains) the broadcasts when the group stands, so the sender completes."""
        t0 = time.perf_counter()
        _check_name(name)
        try:
            AdapterConfig.from_peft(config)
        except ValueError as exc:
            error = f"adapter {name!r}: {exc}"
        else:
            error = None

        def message(slot: Optional[int], left: Optional[int], collect: tuple[int, ...]) -> ReceiveLora:
            load = LoadLora(-1 if slot is None else slot, name, dict(config), max_rank=self.max_rank, max_bytes=left,
                            collect=collect)
            return ReceiveLora(load, *spec)

        return self._run(name, message, "distributed", pinned, t0, weight_version, refused=error, drain=True)

    def _load(self, name: str, config: dict, named: list, source: str, pinned: bool, t0: float,
              weight_version: Optional[str]) -> WeightResult:
        if not all(isinstance(t, torch.Tensor) for _, t in named):
            return WeightResult.fail(f"adapter {name!r}: every value must be a tensor")

        def message(slot: Optional[int], left: Optional[int], collect: tuple[int, ...]) -> LoadLora:
            assert slot is not None
            if self.weights.ranks_in_other_processes:
                return LoadLora(slot, name, config, handle=self.weights.write_bucket(named), max_rank=self.max_rank,
                                max_bytes=left, collect=collect)
            return LoadLora(slot, name, config, named_tensors=tuple(named), max_rank=self.max_rank, max_bytes=left,
                            collect=collect)

        return self._run(name, message, source, pinned, t0, weight_version)

    def _run(self, name: str, message, source: str, pinned: bool, t0: float, weight_version: Optional[str],
             refused: Optional[str] = None, drain: bool = False) -> WeightResult:
        """On the loop: a free slot and what the budget leaves, the ranks' load, the registry. A
        distributed load (``drain``) refused here still runs on the ranks, with slot -1 (receive and
        drop), so that the sender's broadcasts complete; its answer is then the refusal."""

        def on_loop() -> WeightResult:
            reg = self.registry
            # retired versions no request uses are emptied by the ranks as this load's first step (no round
            # trip of their own); the last one's memory is lent to it, and its slot taken: a new version of
            # the same adapter then lands in the views the collected one had, with nothing to install
            collected = reg.collect(self.scheduler.requests.values())
            slot = collected[-1] if collected else reg.free_slot()
            error = refused
            if error is None and slot is None:
                names = sorted({av.name for av in reg.resident.values()})
                error = (f"adapter {name!r}: max_loaded_loras={reg.max_loaded} adapter versions are "
                         f"resident ({', '.join(names)}); unload one or raise max_loaded_loras")
            if error is not None:
                if drain:
                    self.worker.run_weight_op(message(None, None, collected))
                else:
                    self._empty(collected)
                return WeightResult.fail(error).published(self.scheduler.weight_version, time.perf_counter() - t0)
            left = None if self.max_memory_bytes is None else \
                max(0, self.max_memory_bytes - sum(av.nbytes for av in reg.resident.values()))
            msg = message(slot, left, collected)
            result = self.worker.run_weight_op(msg)
            if result.success:
                av = reg.add(name, slot, nbytes=result.num_bytes, max_rank=result.detail.get("max_rank", 0),
                             modules=list(result.detail.get("modules", ())), source=source, pinned=pinned,
                             weight_version=None if weight_version is None else str(weight_version))
                result = WeightResult.ok(f"adapter {name!r} version {av.version} loaded into slot {slot}",
                                         num_bytes=result.num_bytes, lora_name=name, lora_version=av.version,
                                         slot=slot, modules=av.modules,
                                         loaded_adapters=reg.describe(self.scheduler.requests.values()),
                                         **{k: v for k, v in result.detail.items() if k == "received_in_place_bytes"})
            return result.published(self.scheduler.weight_version, time.perf_counter() - t0)

        return self.loop.call(on_loop)

    def unload(self, name: str) -> WeightResult:
        t0 = time.perf_counter()

        def on_loop() -> WeightResult:
            reg = self.registry
            if name not in reg.current:
                return WeightResult.fail(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(reg.current) or 'none'})")
            used = reg.users(self.scheduler.requests.values())
            busy = sum(used.get(av.slot, 0) for av in reg.versions_of(name))
            if busy:
                return WeightResult.fail(f"LoRA adapter {name!r} is in use by {busy} running request(s); abort them or "
                                         f"unload it once they finish")
            reg.retire(name)
            freed = self._empty(reg.collect(self.scheduler.requests.values()))
            return WeightResult.ok(f"adapter {name!r} unloaded", freed_bytes=freed,
                                   loaded_adapters=reg.describe(self.scheduler.requests.values())).published(
                self.scheduler.weight_version, time.perf_counter() - t0)

        return self.loop.call(on_loop)

    def _empty(self, slots: tuple[int, ...]) -> int:
        """The ranks free ``slots`` (dropped from the registry already); the bytes freed."""
        freed = 0
        for slot in slots:
            result = self.worker.run_weight_op(UnloadLora(slot))
            if not result.success:
                raise RuntimeError(f"emptying adapter slot {slot} failed: {result.message}")
            freed += int(result.detail.get("freed_bytes", 0))
        return freed

    def names(self) -> list[str]:
        """The adapters new requests can name, replaced AReaL versions included (read off the loop:
        snapshots of dicts' keys)."""
        return list(self.registry.current) + list(self.registry.aliases)

    def list(self) -> list[dict]:
        return self.loop.call(lambda: self.registry.describe(self.scheduler.requests.values()))
