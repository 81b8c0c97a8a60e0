"""Safetensors folders: which files, whether their headers can be trusted, and their tensors.

Everything a checkpoint says is checked before a byte of it is used: the index's ``weight_map``
(its shape, and that every file it names lies inside the folder, symlinks resolved), each file's
header (valid JSON of the right shape, known dtypes, non-negative dimensions, offsets inside the
file and not overlapping). Tensors are then yielded lazily, one read per tensor. Weights are never
unpickled.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from collections.abc import Iterable

import torch

from rollout.weights.loader import LazyTensor, WeightLoadError

# safetensors dtype name -> (torch dtype, bytes per element)
ST_DTYPES = {"F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
             "BF16": (torch.bfloat16, 2), "I64": (torch.int64, 8), "I32": (torch.int32, 4), "I16": (torch.int16, 2),
             "I8": (torch.int8, 1), "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1)}
MAX_HEADER_BYTES = 100_000_000
INDEX_FILE = "model.safetensors.index.json"


def _inside(folder: str, name: object) -> str:
    """``folder/name``, refused unless it resolves (symlinks followed) inside ``folder``."""
    if not isinstance(name, str) or not name:
        raise WeightLoadError(f"{INDEX_FILE}: weight_map values must be file names, got {name!r}")
    root = os.path.realpath(folder)
    path = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, path]) != root:
        raise WeightLoadError(f"{INDEX_FILE}: {name!r} lies outside the model folder {folder!r}; refused")
    return path


def safetensors_files(model_path: str) -> list[str]:
    """The folder's weight files: those its index names (each inside the folder), else every
    ``*.safetensors`` file in it."""
    if not os.path.isdir(model_path):
        raise WeightLoadError(f"{model_path!r} is not a folder (pass a Hugging Face safetensors folder)")
    index = os.path.join(model_path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
            raise WeightLoadError(f"{INDEX_FILE}: not a JSON object ({exc})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise WeightLoadError(f"{INDEX_FILE}: needs a non-empty \"weight_map\" object (tensor name -> file)")
        files = sorted({_inside(model_path, name) for name in weight_map.values()})
        missing = [os.path.basename(p) for p in files if not os.path.isfile(p)]
        if missing:
            raise WeightLoadError(f"{INDEX_FILE} names files that do not exist: {', '.join(missing[:5])}")
        return files
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {model_path!r} (only safetensors weights are loaded)")
    return [_inside(model_path, os.path.basename(p)) for p in files]


def _entry(name: str, key: str, entry: object) -> tuple[str, list[int], int, int]:
    """(dtype, shape, begin, end) of one header entry, or a clear error."""
    bad = f"{name}: header entry {key!r} is malformed"
    if not isinstance(entry, dict):
        raise WeightLoadError(f"{bad}: expected an object with dtype, shape and data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ST_DTYPES:
        raise WeightLoadError(f"{bad}: unsupported dtype {dtype!r} (supported: {sorted(ST_DTYPES)})")
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise WeightLoadError(f"{bad}: shape must be a list of non-negative integers, got {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        raise WeightLoadError(f"{bad}: data_offsets must be [begin, end] integers, got {offsets!r}")
    return dtype, shape, offsets[0], offsets[1]


def validate_safetensors_file(path: str) -> None:
    """Check a file's header, offsets and size before any byte of it is trusted."""
    size = os.path.getsize(path)
    name = os.path.basename(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightLoadError(f"{name}: truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise WeightLoadError(f"{name}: header length {n} exceeds the file ({size} bytes): corrupt or truncated")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise WeightLoadError(f"{name}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise WeightLoadError(f"{name}: header must be a JSON object, got {type(header).__name__}")
    data_len = size - 8 - n
    spans = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        dtype, shape, begin, end = _entry(name, key, entry)
        numel = 1
        for s in shape:
            numel *= s
        if not (0 <= begin <= end <= data_len) or end - begin != numel * ST_DTYPES[dtype][1]:
            raise WeightLoadError(f"{name}: {key} has bad offsets [{begin}, {end}) for shape {shape} {dtype} "
                                  f"in {data_len} data bytes (corrupt or truncated file)")
        spans.append((begin, end))
    spans.sort()
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        raise WeightLoadError(f"{name}: tensors overlap in the data region")
    # the tensors must tile the data region exactly (what the safetensors format requires)
    if any(a[1] != b[0] for a, b in zip(spans, spans[1:])) or (spans and spans[0][0] != 0):
        raise WeightLoadError(f"{name}: the data region has gaps between tensors (corrupt file)")
    end = spans[-1][1] if spans else 0
    if end != data_len:
        raise WeightLoadError(f"{name}: {data_len - end} unexpected bytes after the last tensor")


def iter_safetensors(model_path: str, validate: bool = False) -> Iterable[tuple[str, LazyTensor]]:
    """Yield (name, LazyTensor) for every tensor of a folder; shapes and dtypes come from headers
    (``validate``: every header is checked first, before anything is yielded)."""
    from safetensors import safe_open

    files = safetensors_files(model_path)
    if validate:
        for path in files:
            validate_safetensors_file(path)
    for path in files:
        try:
            handle = safe_open(path, framework="pt", device="cpu")
            names = list(handle.keys())
        except Exception as exc:  # noqa: BLE001 - the library's own error, said as ours
            raise WeightLoadError(f"{os.path.basename(path)}: cannot be read as safetensors ({exc})") from None
        for name in names:
            sl = handle.get_slice(name)
            dtype = ST_DTYPES.get(sl.get_dtype(), (None,))[0]
            if dtype is None:
                raise WeightLoadError(f"{name}: unsupported safetensors dtype {sl.get_dtype()}")
            yield name, LazyTensor(tuple(sl.get_shape()), dtype, (lambda h=handle, n=name: h.get_tensor(n)))
