"""The LoRA adapters resident on the engine, as the scheduler sees them (loop thread only).

An adapter is served under its name; loading the same name again adds a new version in another slot
and new requests get it, while requests that started on the earlier version finish on it: a version
a newer one replaced (or an unload took) is *retired* and its slot is emptied once no request in
flight uses it. Each loaded version has a ``uid`` that no other load ever gets: it is part of the
prefix-cache key of every request on it, so KV computed under one adapter version is never reused
under another, nor under the base weights, and loading or unloading one adapter flushes nothing.

AReaL names each version of its adapter ``<name>-v<version>`` and never unloads the old ones; its
vLLM server keeps an old name routable to the newest version. With ``versioned_names``, loading
``X-vN`` does the same: every current ``X-vM`` with M < N is retired as a replaced version is (requests
on it finish there) and its name becomes an alias of ``X-vN`` for new requests, so versions never
pile up past ``max_loaded_loras``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class AdapterVersion:
    name: str
    version: int  # 1, 2, ... per name
    slot: int
    uid: int  # unique over the engine's life
    nbytes: int = 0
    max_rank: int = 0
    modules: list[str] = field(default_factory=list)
    source: str = ""  # the folder it was read from, or "tensors"
    pinned: bool = False
    weight_version: Optional[str] = None  # the label its tokens carry (None: the base weights' version)
    retired: bool = False

    def describe(self, users: int) -> dict:
        return {"name": self.name, "version": self.version, "slot": self.slot, "current": not self.retired,
                "num_running_requests": users, "bytes": self.nbytes, "max_rank": self.max_rank,
                "modules": len(self.modules), "source": self.source, "pinned": self.pinned,
                "weight_version": self.weight_version}


_VERSIONED = re.compile(r"^(?P<base>.+)-v(?P<n>\d+)$")  # AReaL's get_versioned_lora_name


class LoraRegistry:
    def __init__(self, max_loaded: int, versioned_names: bool = True):
        self.max_loaded = max_loaded  # resident versions at most (slots 0 .. max_loaded - 1)
        self.versioned_names = versioned_names
        self.current: dict[str, AdapterVersion] = {}  # name -> the version new requests get
        self.resident: dict[int, AdapterVersion] = {}  # slot -> version (current or retired)
        self.aliases: dict[str, str] = {}  # a replaced ``X-vM`` -> the current ``X-vN`` (versioned_names)
        self._uids = itertools.count(1)

    def resolve(self, name: str) -> AdapterVersion:
        av = self.current.get(name)
        if av is None and name in self.aliases:
            av = self.current.get(self.aliases[name])
        if av is None:
            loaded = sorted(self.current) or "none"
            raise ValueError(f"lora_path {name!r}: no LoRA adapter of that name is loaded (loaded: {loaded}); "
                             f"load it with load_lora_adapter first")
        return av

    @staticmethod
    def users(requests: Iterable) -> dict[int, int]:
        """slot -> how many requests in flight run on it."""
        counts: dict[int, int] = {}
        for req in requests:
            if req.lora is not None:
                counts[req.lora.slot] = counts.get(req.lora.slot, 0) + 1
        return counts

    def collect(self, requests: Iterable) -> tuple[int, ...]:
        """Drop the retired versions no request in flight uses; their slots, for the ranks to empty."""
        used = self.users(requests)
        slots = tuple(av.slot for av in self.resident.values() if av.retired and not used.get(av.slot))
        for slot in slots:
            del self.resident[slot]
        return slots

    def free_slot(self) -> Optional[int]:
        return next((s for s in range(self.max_loaded) if s not in self.resident), None)

    def add(self, name: str, slot: int, **info) -> AdapterVersion:
        """A version of ``name`` now lives in ``slot``; the previous one (if any) is retired."""
        previous = self.current.get(name)
        if previous is not None:
            previous.retired = True
        av = AdapterVersion(name, (previous.version + 1) if previous is not None else 1, slot, next(self._uids),
                            **info)
        self.current[name] = av
        self.resident[slot] = av
        self.aliases.pop(name, None)
        for older in self._older_versions(name):
            self.current.pop(older).retired = True
            self.aliases[older] = name
        for alias, target in list(self.aliases.items()):
            if target not in self.current:  # pointed at a version just replaced
                self.aliases[alias] = name
        return av

    def _older_versions(self, name: str) -> list[str]:
        """The current names ``name`` replaces: the same ``X`` with a lower ``-v`` number."""
        m = _VERSIONED.match(name) if self.versioned_names else None
        if m is None:
            return []
        return [other for other in self.current if other != name and (o := _VERSIONED.match(other)) is not None
                and o["base"] == m["base"] and int(o["n"]) < int(m["n"])]

    def retire(self, name: str) -> AdapterVersion:
        """``name`` is no longer served (its resident versions are emptied by the caller); names that
        were its aliases go with it."""
        av = self.current.pop(name)
        av.retired = True
        self.aliases = {alias: target for alias, target in self.aliases.items() if target != name}
        return av

    def versions_of(self, name: str) -> list[AdapterVersion]:
        return [av for av in self.resident.values() if av.name == name]

    def describe(self, requests: Iterable) -> list[dict]:
        used = self.users(requests)
        return [av.describe(used.get(av.slot, 0)) for av in sorted(self.resident.values(), key=lambda a: a.slot)]
