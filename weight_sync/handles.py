"""The RL frameworks' pickled tensor handles, read by an allowlist that runs nothing.

slime, miles and veRL push colocated weights to SGLang as base64 of ``MultiprocessingSerializer``
(torch's ``ForkingPickler``): a pickle whose tensors are handles to memory of the trainer's process —
CUDA IPC handles on GPU, shared-memory names on CPU — wrapped in SGLang's classes
(``FlattenedTensorMetadata`` in a ``{"flattened_tensor", "metadata"}`` dict: slime, miles;
``[(name, LocalSerializedTensor(values=[one nested payload per TP rank]))]``: veRL).

A general unpickler would run whatever callable a payload names. ``read_handles`` is to these payloads
what ``torch.load(weights_only=True)`` is to checkpoints: its ``find_class`` admits only

- torch's multiprocessing rebuild functions (``rebuild_tensor``, ``rebuild_typed_storage``,
  ``rebuild_storage_filename``, ``rebuild_cuda_tensor`` and SGLang's patched CUDA one) — each mapped to
  an *inert* stand-in that checks its arguments' types and records them as a spec, calling nothing;
- ``torch.Size``, the ``torch`` dtypes, and marker stand-ins for ``torch.Tensor`` and the storage classes
  (the real classes are never handed out: calling one would allocate what the payload says);
- SGLang's wrapper classes by name (``FlattenedTensorMetadata``, ``LocalSerializedTensor``), mapped to
  plain stand-ins whose ``__setstate__`` checks every field;

and refuses everything else by name, before anything is built from it; nothing is imported from the
payload's module names. Opcodes that reach other machinery (persistent ids, the copyreg extension
registry, old-protocol ``INST``/``OBJ``) are refused by a scan before loading. The result is pure data;
``materialize`` then maps the memory the specs name (a shared-memory segment's size checked against
the bytes the payload announces before it is mapped; the tensor's extent checked against its storage)
and returns tensors viewing it. Handles with file descriptors (torch's default ``file_descriptor``
sharing strategy) need the sender's multiprocessing authkey, so they are refused with what to do.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import pickle
import pickletools
from dataclasses import dataclass
from typing import Any, Optional

import torch

MAX_PAYLOAD_BYTES = 64 << 20  # one decoded payload (handles and metadata, never the tensors' bytes)
SHM_ROOT = "/dev/shm"  # where POSIX shared-memory names live on Linux
_REFUSED_OPCODES = {"PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4", "INST", "OBJ"}
_DTYPE_NAMES = {"float32", "float", "float16", "half", "bfloat16", "float64", "double", "int8", "uint8", "int16",
                "int32", "int64", "long", "int", "bool", "float8_e4m3fn", "float8_e5m2"}


class HandleError(ValueError):
    """A tensor-handle payload this server will not read (named in the message); nothing was run."""


# ------------------------------------------------------------------ inert specs


@dataclass(frozen=True)
class ShmStorage:
    """A CPU storage in a POSIX shared-memory segment (torch's ``file_system`` sharing strategy)."""

    manager: bytes  # torch_shm_manager's socket, which keeps the segment alive for its sender
    name: bytes  # the segment's name ("/torch_<pid>_...")
    nbytes: int


@dataclass(frozen=True)
class CudaStorage:
    """A CUDA allocation shared by an IPC handle (torch's reduction, or SGLang's patched one naming the
    device by UUID)."""

    args: tuple  # rebuild_cuda_tensor's arguments after its tensor class


@dataclass(frozen=True)
class TypedStorage:
    storage: ShmStorage
    dtype: torch.dtype


@dataclass(frozen=True)
class TensorSpec:
    storage: Any  # ShmStorage / TypedStorage (CPU) or CudaStorage
    offset: int = 0
    size: tuple = ()
    stride: tuple = ()


class _Marker:
    """A class name a payload may mention (``torch.Tensor``, a storage class) but never call."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise HandleError(f"{self.name} is not called by a tensor handle")

    def __repr__(self) -> str:
        return self.name


_TENSOR, _UNTYPED, _TYPED = _Marker("torch.Tensor"), _Marker("torch.UntypedStorage"), _Marker("torch.TypedStorage")


def _ints(value, what: str) -> tuple:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise HandleError(f"{what} must be non-negative integers")
    return tuple(value)


def _size(*args) -> tuple:
    if len(args) != 1:
        raise HandleError("torch.Size takes one tuple")
    return _ints(args[0], "a torch.Size")


def _storage_filename(cls, manager, name, size, dtype=None) -> ShmStorage:
    if cls is not _UNTYPED or not isinstance(manager, bytes) or not isinstance(name, bytes) or type(size) is not int \
            or size < 0:
        raise HandleError("rebuild_storage_filename takes (UntypedStorage, manager bytes, name bytes, size)")
    storage = ShmStorage(manager, name, size)
    return storage if dtype is None else TypedStorage(storage, _dtype(dtype))


def _typed_storage(storage, dtype) -> TypedStorage:
    if not isinstance(storage, ShmStorage):
        raise HandleError("rebuild_typed_storage takes a storage rebuilt from a handle")
    return TypedStorage(storage, _dtype(dtype))


def _dtype(dtype) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise HandleError("a dtype must be a torch dtype")
    return dtype


def _tensor(cls, storage, metadata) -> TensorSpec:
    if cls is not _TENSOR or not isinstance(storage, TypedStorage) or not isinstance(metadata, tuple) \
            or len(metadata) != 4:
        raise HandleError("rebuild_tensor takes (torch.Tensor, a typed storage, (offset, size, stride, grad))")
    offset, size, stride, _ = metadata
    if type(offset) is not int or offset < 0:
        raise HandleError("a tensor's storage offset must be a non-negative integer")
    return TensorSpec(storage, offset, _ints(size, "a size"), _ints(stride, "a stride"))


def _cuda_tensor(cls, *args) -> TensorSpec:
    if cls is not _TENSOR or len(args) != 14:
        raise HandleError("rebuild_cuda_tensor takes torch.Tensor and its 14 arguments")
    size, stride, offset, storage_cls, dtype, device, handle, nbytes, storage_offset, _, counter, counter_offset, \
        event, _ = args
    if storage_cls not in (_UNTYPED, _TYPED) or type(offset) is not int or offset < 0:
        raise HandleError("a CUDA handle's storage class or offset is not one torch writes")
    if not isinstance(device, (int, str)) or not all(isinstance(b, bytes) for b in (handle, counter, event or b"")) \
            or not all(type(n) is int and n >= 0 for n in (nbytes, storage_offset, counter_offset)):
        raise HandleError("a CUDA handle's device, handles or sizes are not of the types torch writes")
    _dtype(dtype)
    return TensorSpec(CudaStorage(args), offset, _ints(size, "a size"), _ints(stride, "a stride"))


class TensorMetadata:
    """SGLang's ``FlattenedTensorMetadata`` (name, shape, dtype, start_idx, end_idx, numel), its fields checked."""

    __slots__ = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) from a class with __slots__
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict) or set(state) != set(self.__slots__):
            raise HandleError(f"FlattenedTensorMetadata holds exactly {list(self.__slots__)}")
        if not isinstance(state["name"], str):
            raise HandleError("FlattenedTensorMetadata.name must be a string")
        self.name, self.shape, self.dtype = state["name"], _ints(state["shape"], "a shape"), _dtype(state["dtype"])
        for field in ("start_idx", "end_idx", "numel"):
            if type(state[field]) is not int or state[field] < 0:
                raise HandleError(f"FlattenedTensorMetadata.{field} must be a non-negative integer")
            setattr(self, field, state[field])
        if self.end_idx - self.start_idx != self.numel or math.prod(self.shape) != self.numel:
            raise HandleError(f"{self.name}: start_idx, end_idx, numel and shape disagree")


class SerializedPerRank:
    """SGLang's ``LocalSerializedTensor``: one nested payload per TP rank (each read by this reader)."""

    __slots__ = ("values",)

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2:
            state = {**(state[0] or {}), **(state[1] or {})}
        values = state.get("values") if isinstance(state, dict) else None
        if set(state or ()) != {"values"} or not isinstance(values, list) or not values or \
                not all(isinstance(v, (bytes, str)) for v in values):
            raise HandleError("LocalSerializedTensor holds values: one payload per TP rank")
        self.values = values


_CALLABLES = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): _tensor,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): _typed_storage,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): _storage_filename,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _cuda_tensor,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _cuda_tensor,
    ("torch", "Size"): _size,
    ("torch", "Tensor"): _TENSOR,
    ("torch.nn.parameter", "Parameter"): _TENSOR,
    ("torch", "UntypedStorage"): _UNTYPED,
    ("torch.storage", "UntypedStorage"): _UNTYPED,
    ("torch.storage", "TypedStorage"): _TYPED,
}
_CLASSES = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): TensorMetadata,
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): SerializedPerRank,
    ("sglang.srt.utils", "LocalSerializedTensor"): SerializedPerRank,
}
_FD_HANDLE = ("file-descriptor handles (torch's default file_descriptor sharing strategy) can only be opened by a "
              "process holding the sender's multiprocessing authkey: call torch.multiprocessing.set_sharing_strategy("
              "'file_system') in the trainer before serializing (CPU), or send CUDA IPC handles (GPU)")


class _Reader(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        key = (module, name)
        if key in _CALLABLES:
            return _CALLABLES[key]
        if key in _CLASSES:
            return _CLASSES[key]
        if module == "torch" and name in _DTYPE_NAMES:
            return getattr(torch, name)
        if key in (("torch.multiprocessing.reductions", "rebuild_storage_fd"), ("multiprocessing.resource_sharer",
                                                                                "DupFd")):
            raise HandleError(_FD_HANDLE)
        raise HandleError(f"{module}.{name} is not a tensor handle this server reads (only torch's tensor rebuilds "
                          "from shared memory or CUDA IPC, and SGLang's bucket metadata); nothing was run")

    def persistent_load(self, pid):
        raise HandleError("persistent ids are not part of a tensor handle")


def decode(payload) -> bytes:
    """A payload as sent: base64 text (SGLang's ``output_str=True``; veRL encodes it itself) or bytes."""
    if isinstance(payload, (bytes, bytearray)):
        data = bytes(payload)
    elif isinstance(payload, str):
        if len(payload) > MAX_PAYLOAD_BYTES * 4 // 3 + 4:
            raise HandleError(f"a tensor-handle payload larger than {MAX_PAYLOAD_BYTES} bytes")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise HandleError("a tensor-handle payload must be base64 text") from None
    else:
        raise HandleError("a tensor-handle payload is base64 text")
    if len(data) > MAX_PAYLOAD_BYTES:
        raise HandleError(f"a tensor-handle payload larger than {MAX_PAYLOAD_BYTES} bytes")
    return data


def read_handles(payload) -> Any:
    """The payload's structure with every tensor as an inert ``TensorSpec`` (nothing mapped, nothing run);
    ``HandleError`` naming what is refused."""
    data = decode(payload)
    try:
        for op, _, _ in pickletools.genops(data):
            if op.name in _REFUSED_OPCODES:
                raise HandleError(f"pickle opcode {op.name} is not part of a tensor handle")
        return _Reader(io.BytesIO(data)).load()
    except HandleError:
        raise
    except RecursionError:
        raise HandleError("a tensor-handle payload nests too deep") from None
    except Exception as exc:  # noqa: BLE001 - a truncated or malformed pickle, whatever the parser says
        raise HandleError(f"a malformed tensor-handle payload ({type(exc).__name__}: {exc})") from None


# ------------------------------------------------------------------ from specs to tensors


def _extent(spec: TensorSpec) -> int:
    """Elements from the storage offset to one past the tensor's last element."""
    if any(s == 0 for s in spec.size):
        return spec.offset
    if len(spec.size) != len(spec.stride):
        raise HandleError("a tensor's size and stride differ in length")
    return spec.offset + 1 + sum((n - 1) * st for n, st in zip(spec.size, spec.stride))


def _shm_storage(storage: ShmStorage) -> torch.UntypedStorage:
    try:
        name = storage.name.decode("ascii")
    except UnicodeDecodeError:
        raise HandleError("a shared-memory name is ASCII") from None
    if not name.startswith("/") or "/" in name[1:] or name in ("/", "/.", "/.."):
        raise HandleError(f"{name!r} is not a shared-memory name")
    # the segment's keeper is torch's own shm manager (libshm connects to it): never any other socket
    if os.path.basename(storage.manager) != b"manager.sock" or \
            not os.path.basename(os.path.dirname(storage.manager)).startswith(b"torch-shm-dir-"):
        raise HandleError("a shared-memory handle names torch's shm manager socket (torch-shm-dir-*/manager.sock)")
    try:
        actual = os.stat(SHM_ROOT + name).st_size
    except OSError:
        raise HandleError(f"shared memory {name!r} does not exist (its sender has ended or freed it)") from None
    if actual < storage.nbytes:
        raise HandleError(f"shared memory {name!r} holds {actual} bytes, fewer than the {storage.nbytes} the handle "
                          "announces")
    try:
        return torch.UntypedStorage._new_shared_filename_cpu(storage.manager, storage.name, storage.nbytes)
    except Exception as exc:  # noqa: BLE001 - the manager or the segment went away
        raise HandleError(f"shared memory {name!r} could not be mapped ({exc})") from None


def materialize(spec: TensorSpec, device: Optional[torch.device] = None) -> torch.Tensor:
    """The tensor a spec names, viewing the sender's memory (nothing copied)."""
    if isinstance(spec.storage, CudaStorage):
        return _cuda(spec)
    typed = spec.storage
    if not isinstance(typed, TypedStorage):
        raise HandleError("a CPU tensor handle names a typed shared-memory storage")
    itemsize = typed.dtype.itemsize
    if _extent(spec) * itemsize > typed.storage.nbytes:
        raise HandleError(f"a tensor of size {list(spec.size)} at offset {spec.offset} reaches past its "
                          f"{typed.storage.nbytes}-byte storage")
    storage = _shm_storage(typed.storage)
    return torch.empty(0, dtype=typed.dtype).set_(storage, spec.offset, spec.size, spec.stride)


def _cuda(spec: TensorSpec) -> torch.Tensor:
    if not torch.cuda.is_available():
        raise HandleError("CUDA IPC handles need a GPU engine")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(spec.storage.args)
    device = args[5]
    if isinstance(device, str):  # SGLang's patch names the device by its UUID
        matches = [i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == device]
        if not matches:
            raise HandleError(f"no visible GPU has UUID {device}")
        args[5] = matches[0]
    args[3] = torch.storage.TypedStorage if spec.storage.args[3] is _TYPED else torch.UntypedStorage
    nbytes = args[7]
    if _extent(spec) * args[4].itemsize > nbytes:
        raise HandleError("a CUDA tensor reaches past the allocation its handle announces")
    try:
        return rebuild_cuda_tensor(torch.Tensor, *args)
    except Exception as exc:  # noqa: BLE001 - a handle of a freed or foreign allocation
        raise HandleError(f"a CUDA IPC handle could not be opened ({exc})") from None


# ------------------------------------------------------------------ the frameworks' layouts


def named_tensors(payload, tp_rank: int = 0) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of one TP rank's payload in any of the frameworks' layouts: slime's and miles'
    ``{"flattened_tensor", "metadata"}`` (or a list of them), veRL's ``[(name, LocalSerializedTensor)]``
    (this rank's nested payload read the same way), or plain ``[(name, tensor)]``. Tensors view the
    sender's memory."""
    return _layout(read_handles(payload), tp_rank)


def _layout(obj, tp_rank: int) -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, dict):
        obj = [obj]
    if not isinstance(obj, list) or not obj:
        raise HandleError("a tensor-handle payload holds a flattened bucket or (name, tensor) pairs")
    out: list[tuple[str, torch.Tensor]] = []
    for item in obj:
        if isinstance(item, dict):
            out.extend(_flattened(item))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, value = item
            if isinstance(value, SerializedPerRank):
                if tp_rank >= len(value.values):
                    raise HandleError(f"{name}: no payload for TP rank {tp_rank}")
                value = read_handles(value.values[tp_rank])
            if not isinstance(value, TensorSpec):
                raise HandleError(f"{name}: not a tensor handle")
            out.append((name, materialize(value)))
        else:
            raise HandleError("a tensor-handle payload holds a flattened bucket or (name, tensor) pairs")
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise HandleError("a tensor is given twice in one payload")
    return out


def _flattened(bucket: dict) -> list[tuple[str, torch.Tensor]]:
    flat, metadata = bucket.get("flattened_tensor"), bucket.get("metadata")
    if set(bucket) != {"flattened_tensor", "metadata"} or not isinstance(flat, TensorSpec) or \
            not isinstance(metadata, list) or not all(isinstance(m, TensorMetadata) for m in metadata):
        raise HandleError("a flattened bucket holds flattened_tensor (a handle) and metadata (FlattenedTensorMetadata)")
    tensor = materialize(flat)
    if tensor.dim() != 1:
        raise HandleError("a flattened bucket's tensor is one-dimensional")
    out = []
    for m in metadata:
        if m.end_idx > tensor.numel():
            raise HandleError(f"{m.name}: elements {m.start_idx}-{m.end_idx} lie past the bucket's {tensor.numel()}")
        view = tensor[m.start_idx:m.end_idx].reshape(m.shape)
        out.append((m.name, view if view.dtype == m.dtype else view.to(m.dtype)))
    return out


# ------------------------------------------------------------------ as a bucket handle every TP rank opens

KIND = "tensor_handles"  # ``{"kind": KIND, "payloads": [one per TP rank]}``, opened by ``open_bucket``


def handle(payloads) -> dict:
    """The frameworks' payloads (one per TP rank, as SGLang's ``serialized_named_tensors`` lists them) as a
    bucket handle: every TP rank of the engine opens it itself and reads its own entry."""
    if isinstance(payloads, (str, bytes)):
        payloads = [payloads]
    if not isinstance(payloads, list) or not payloads:
        raise HandleError("serialized_named_tensors is a list of payloads, one per TP rank")
    return {"kind": KIND, "payloads": list(payloads)}


class OpenedPayload:
    """A TP rank's entry of a ``handle``, read and mapped: ``named_tensors`` view the sender's memory until
    ``close``."""

    def __init__(self, opened: dict, tp_rank: int):
        payloads = opened.get("payloads")
        if not isinstance(payloads, list) or not payloads:
            raise HandleError("a tensor-handles bucket holds its payloads")
        # one entry per TP rank; fewer than this engine's ranks: CPU memory is one host's, the first serves all
        entry = payloads[tp_rank] if tp_rank < len(payloads) else payloads[0]
        self.named_tensors = named_tensors(entry, tp_rank)

    def close(self) -> None:
        self.named_tensors = []
