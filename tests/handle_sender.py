"""A trainer process that serializes its weights the way slime, miles and veRL do for SGLang's colocated
``/update_weights_from_tensor``: torch's ``ForkingPickler`` (SGLang's ``MultiprocessingSerializer``) over
real tensors of this live process, base64-encoded — CPU shared-memory handles (torch's ``file_system``
sharing strategy) — wrapped in SGLang's classes, rebuilt here from their recorded field layout under their
module names (``FlattenedTensorMetadata``, ``LocalSerializedTensor``). Also the hostile payloads.

Driven over stdin/stdout, one JSON line each way: the test sends a command, this answers with payloads.
``python tests/handle_sender.py MODEL_DIR``."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import sys
import types
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as tmp
from safetensors.torch import load_file

tmp.set_sharing_strategy("file_system")


def _module(name: str) -> types.ModuleType:
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    return sys.modules[name]


@dataclasses.dataclass
class FlattenedTensorMetadata:  # sglang.srt.weight_sync.tensor_bucket
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclasses.dataclass
class LocalSerializedTensor:  # sglang.srt.model_executor.model_runner
    values: list[bytes]


for cls, where in ((FlattenedTensorMetadata, "sglang.srt.weight_sync.tensor_bucket"),
                   (LocalSerializedTensor, "sglang.srt.model_executor.model_runner")):
    cls.__module__ = where
    setattr(_module(where), cls.__name__, cls)


def raw(obj) -> bytes:
    """SGLang's ``MultiprocessingSerializer.serialize(obj)``: torch's ForkingPickler."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


def serialize(obj) -> str:
    """``MultiprocessingSerializer.serialize(obj, output_str=True)``: base64 text (veRL encodes it itself)."""
    return base64.b64encode(raw(obj)).decode("utf-8")


class Flat:
    """slime's and miles' bucket: one flat tensor (kept and reused bucket after bucket, as a trainer's
    buffer is) and its metadata."""

    def __init__(self, numel: int):
        self.buffer = torch.zeros(numel)

    def payload(self, named) -> str:
        meta, at = [], 0
        for name, t in named:
            n = t.numel()
            self.buffer[at:at + n] = t.flatten()
            meta.append(FlattenedTensorMetadata(name, t.shape, t.dtype, at, at + n, n))
            at += n
        return serialize({"flattened_tensor": self.buffer[:at], "metadata": meta})


class Sentinel:
    """A payload whose unpickling would run a shell command that creates a file."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


class Eval:
    """A payload naming a global outside the allowlist (``builtins.eval``)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return eval, (f"open({self.path!r}, 'w')",)


class WrongSize:
    """A handle announcing four times the bytes its shared memory holds."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    def __reduce__(self):
        from torch.multiprocessing.reductions import rebuild_storage_filename, rebuild_tensor, rebuild_typed_storage

        storage = self.t.untyped_storage()
        storage.share_memory_()
        manager, name, size = storage._share_filename_cpu_()
        typed = (rebuild_typed_storage, ((rebuild_storage_filename, (torch.UntypedStorage, manager, name, size * 4)),
                                         self.t.dtype))
        return rebuild_tensor, (torch.Tensor, _Reduced(typed), (0, self.t.shape, self.t.stride(), False))


class _Reduced:
    def __init__(self, reduced):
        self.reduced = reduced

    def __reduce__(self):
        fn, args = self.reduced
        return fn, tuple(_Reduced(a) if isinstance(a, tuple) and len(a) == 2 and callable(a[0]) else a for a in args)


def main() -> None:
    torch.set_num_threads(1)
    tensors = [(n, t.float().contiguous()) for n, t in load_file(os.path.join(sys.argv[1], "model.safetensors")).items()]
    buckets = [tensors[i::3] for i in range(3)]
    flat = Flat(max(sum(t.numel() for _, t in b) for b in buckets))
    keep: list = []
    for line in sys.stdin:
        cmd = json.loads(line)
        kind, out = cmd["kind"], None
        if kind == "flat":  # bucket i into the one reused buffer
            out = flat.payload(buckets[cmd["bucket"]])
        elif kind == "scribble":  # the trainer reuses its buffer for something else
            flat.buffer.fill_(float("nan"))
            out = "ok"
        elif kind == "verl":  # per tensor, one nested payload per TP rank
            own = [(n, t.clone().share_memory_()) for n, t in buckets[cmd["bucket"]]]
            keep.append(own)
            out = serialize([(n, LocalSerializedTensor(values=[raw(t)] * cmd.get("tp", 1))) for n, t in own])
        elif kind == "os_system":
            out = serialize(Sentinel(cmd["path"]))
        elif kind == "global":
            out = serialize(Eval(cmd["path"]))
        elif kind == "nested":  # veRL's wrapper around a payload that would run a command
            out = serialize([(tensors[0][0], LocalSerializedTensor(values=[raw(Sentinel(cmd["path"]))]))])
        elif kind == "wrong_size":
            t = tensors[0][1].clone()
            keep.append(t)
            out = serialize([(tensors[0][0], WrongSize(t))])
        elif kind == "truncated":
            out = base64.b64encode(base64.b64decode(flat.payload(buckets[0]))[:-12]).decode()
        elif kind == "exit":
            break
        print(json.dumps({"payload": out}), flush=True)


if __name__ == "__main__":
    main()
