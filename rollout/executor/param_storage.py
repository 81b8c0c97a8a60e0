"""``ParameterStorage``: a model's parameters as views into one flat buffer per dtype.

Laid out in wire order (biases last within each layer), so buckets from a trainer match this memory
as they travel (``weight_sync.layout.wire_order``). Storage never moves after construction unless
released and resumed (graphs audit that), so in-place updates keep captured pointers valid. A shadow
of the buffers (allocated on first use) takes an update that can fail midway; ``commit_shadow``
makes it live. Release frees whole buffers, optionally keeping a host backup for ``resume``.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from rollout.layers.linear import LOADER_HOOKS
from weight_sync.layout import wire_order


def return_free_heap_to_os() -> None:
    """glibc keeps freed mid-sized blocks in its heap (its mmap threshold grows as large blocks are
    freed); ``malloc_trim`` hands the free pages back, so released memory leaves the process."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):  # not glibc: the allocator keeps what it keeps
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def flatten_parameters(model: nn.Module, device: torch.device) -> dict[torch.dtype, torch.Tensor]:
    """Replace every (meta) parameter of ``model`` by a view into one zeroed flat buffer per dtype.

    Tied parameters stay tied (one view for both owners); loader attributes carry over."""
    named = list(dict(model.named_parameters()).items())
    unique = [named[i][1] for i in wire_order([n for n, _ in named])]
    buffers: dict[torch.dtype, torch.Tensor] = {}
    replacement: dict[int, nn.Parameter] = {}
    for dtype in sorted({p.dtype for p in unique}, key=str):
        group = [p for p in unique if p.dtype == dtype]
        flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=device)
        offset = 0
        for p in group:
            new = nn.Parameter(flat[offset: offset + p.numel()].view(p.shape), requires_grad=False)
            for attr in LOADER_HOOKS:
                if hasattr(p, attr):
                    setattr(new, attr, getattr(p, attr))
            replacement[id(p)] = new
            offset += p.numel()
        buffers[dtype] = flat
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = replacement[id(p)]
    return buffers


class ParameterStorage:
    def __init__(self, model: nn.Module, device: torch.device):
        self.buffers = flatten_parameters(model, device)
        self.released = False
        self.valid = True  # False after a release without backup, until every weight is written again
        self.rewritten: set = set()  # pieces written by partial updates since such a release
        self._backup: Optional[dict[torch.dtype, torch.Tensor]] = None
        self._shadow: Optional[dict[torch.dtype, torch.Tensor]] = None

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    # ------------------------------------------------------------------ the shadow

    def _shadow_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        if self._shadow is None:
            self._shadow = {d: torch.empty_like(b) for d, b in self.buffers.items()}
        return self._shadow[dtype]

    def shadow_view(self, view: torch.Tensor) -> torch.Tensor:
        """The region of the shadow that ``view`` (a view of a live parameter buffer) covers."""
        return self._shadow_buffer(view.dtype).as_strided(view.shape, view.stride(), view.storage_offset())

    def shadow_bytes(self, view: torch.Tensor, nbytes: int) -> Optional[torch.Tensor]:
        """``nbytes`` of the shadow as a byte view, from where ``view`` starts (None past its end)."""
        buf = self._shadow_buffer(view.dtype).view(torch.uint8)
        start = view.storage_offset() * view.element_size()
        return buf[start: start + nbytes] if start + nbytes <= buf.numel() else None

    def prepare_shadow(self) -> None:
        """Make the shadow equal the live weights (before an update that covers only some)."""
        for d, live in self.buffers.items():
            self._shadow_buffer(d).copy_(live)

    def commit_shadow(self) -> None:
        """The shadow becomes the live weights. On CPU the two buffers trade their memory (no copy;
        every parameter view follows its storage; the old weights become the next shadow). On
        CUDA it is one device copy per buffer, so graph pointers never move."""
        for d, live in self.buffers.items():
            shadow = self._shadow_buffer(d)
            if live.device.type == "cpu" and hasattr(live.untyped_storage(), "_swap_data_ptr_"):
                live.untyped_storage()._swap_data_ptr_(shadow.untyped_storage())
            else:
                live.copy_(shadow)

    # ------------------------------------------------------------------ release / resume

    def release(self, backup: bool = False) -> int:
        """Free every buffer's storage (and the shadow), keeping a host copy if ``backup``; the bytes
        of the buffers (0 if released already). Parameter views keep their tensor objects."""
        if self.released:
            return 0
        self._backup = {d: b.to("cpu", copy=True) for d, b in self.buffers.items()} if backup else None
        freed = self.nbytes()
        self._shadow = None
        for buf in self.buffers.values():
            buf.untyped_storage().resize_(0)
        self.released = True
        return freed

    def resume(self) -> None:
        """Regrow the storages: the backup's values if one was kept; else zeros, and ``valid`` is
        False until a full update commits."""
        if not self.released:
            return
        for dtype, buf in self.buffers.items():
            buf.untyped_storage().resize_(buf.numel() * buf.element_size())
            if self._backup is not None:
                buf.copy_(self._backup[dtype])
            else:
                buf.zero_()
        self.valid = self._backup is not None
        self.rewritten = set()
        self._backup = None
        self.released = False
