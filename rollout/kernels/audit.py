"""What a decode step's device work does, observed on any device: ``StepAudit`` refuses every host
synchronisation inside it and counts its kernel launches.

On a GPU a host synchronisation stalls the launch queue and a kernel costs ~3-4 µs to launch, so the step's
device work (the forward and the sampler, captured in a CUDA graph) must never read a value back to the host
and should launch few kernels. Both are properties of the code path, not of the device: run on a CPU under
``StepAudit`` the same code refuses what would synchronise a GPU —

- reading a tensor's value on the host: ``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``bool()`` /
  ``int()`` / ``float()`` of a tensor (``aten._local_scalar_dense`` beneath them);
- shapes that depend on values: ``nonzero``, ``masked_select``, ``unique``, boolean indexing,
  ``repeat_interleave`` without ``output_size``;
- host data turned into a tensor (``torch.tensor``, ``as_tensor``, ``from_numpy``: an upload from pageable
  memory), and a copy between devices that is not ``non_blocking``;

and counts every operator that launches work (views, allocations and metadata excepted) plus every Triton
kernel launched through ``triton_launch``. Triton's interpreter (``TRITON_INTERPRET=1``, how this CPU runs
the kernels) moves data through numpy, so the audit steps aside inside a launch.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_HOST_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "nonzero",
               "tensor", "as_tensor", "from_numpy", "asarray"}
_VALUE_SHAPED = {aten.nonzero.default, aten.masked_select.default, aten._local_scalar_dense.default,
                 aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default}
# no kernel behind these: allocation, metadata, aliasing
_FREE = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.lift_fresh.default,
         aten.detach.default}


class HostSyncError(RuntimeError):
    """A host synchronisation inside a step's device work."""


class _State(threading.local):
    audit: Optional[StepAudit] = None
    inside_launch: int = 0


_state = _State()


class _Guard(TorchFunctionMode):
    def __init__(self, audit: StepAudit):
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not _state.inside_launch:
            if name in _HOST_READS:
                self.audit.refuse(f"{name}() reads device data on the host")
            if name in ("to", "copy_") and not kwargs.get("non_blocking", False) and _crosses_devices(name, args,
                                                                                                         kwargs):
                self.audit.refuse(f"a blocking {name}() between devices (stage in pinned memory, non_blocking)")
        return func(*args, **kwargs)


def _crosses_devices(name: str, args, kwargs) -> bool:
    src = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if src is None:
        return False
    if name == "copy_":
        other = args[1] if len(args) > 1 else kwargs.get("src")
        return isinstance(other, torch.Tensor) and other.device != src.device
    target = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, (torch.device, str)):
            target = a
        elif isinstance(a, torch.Tensor):
            target = a.device
    return target is not None and torch.device(target) != src.device


class _Counter(TorchDispatchMode):
    def __init__(self, audit: StepAudit):
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _state.inside_launch:
            if func in _VALUE_SHAPED or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None):
                self.audit.refuse(f"{func} has a shape (or a value) only the device knows")
            if func is aten.index.Tensor and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                 for i in (args[1] if len(args) > 1 else ())):
                self.audit.refuse("boolean indexing has a shape only the device knows")
            if not func.is_view and func not in _FREE:
                self.audit.launches[str(func.overloadpacket.__name__)] += 1
        return func(*args, **kwargs)


class StepAudit:
    """``with StepAudit() as audit:`` around a step's device work; ``audit.launches`` counts operators
    and Triton kernels by name; a host synchronisation raises ``HostSyncError`` (``refuse=False``: it is
    recorded in ``audit.syncs`` instead)."""

    def __init__(self, refuse: bool = True):
        self.raise_on_sync = refuse
        self.launches: Counter = Counter()
        self.syncs: list[str] = []
        self._modes: list = []

    def refuse(self, what: str) -> None:
        self.syncs.append(what)
        if self.raise_on_sync:
            raise HostSyncError(f"host synchronisation inside the step's device work: {what}")

    @property
    def num_launches(self) -> int:
        return sum(self.launches.values())

    def __enter__(self) -> StepAudit:
        if _state.audit is not None:
            raise RuntimeError("StepAudit does not nest")
        _state.audit = self
        self._modes = [_Guard(self), _Counter(self)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
        _state.audit = None


@contextmanager
def triton_launch(name: str) -> Iterator[None]:
    """Around one Triton kernel launch: counted by an active ``StepAudit`` as one launch, and the audit
    steps aside inside it (the interpreter's own host copies are not the step's)."""
    if _state.audit is not None:
        _state.audit.launches[f"triton:{name}"] += 1
    _state.inside_launch += 1
    try:
        yield
    finally:
        _state.inside_launch -= 1
