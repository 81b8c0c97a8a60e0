"""Safetensors folders: pinned once, read only through the pin, every header checked before use.

A folder is opened once as a directory descriptor (``PinnedFolder``), and everything after reads
through that descriptor: the listing, the index and each weight file (opened relative to it,
``openat``-style). Whatever the folder's path names later — swapped for a symlink to another model
while an update waits for a quiet point — what is read is the folder that was checked. Weight
files of an update are regular files of the folder itself: a symlink is refused, never followed
(``follow_links`` is for the model an operator starts the engine with, e.g. a Hugging Face cache
snapshot whose files link to its blobs). A spawned TP rank receives the descriptor itself over its
pipe (``send_handle``), not the path.

Everything a checkpoint says is checked before a byte of it is used: the index's ``weight_map``
(its shape, and that every file it names is a plain name in the folder), each file's header (valid
JSON of the right shape, known dtypes, non-negative dimensions, offsets inside the file, tiling the
data region). Tensors are then read lazily, one ``pread`` per tensor at its checked offset. Weights
are never unpickled.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from rollout.weights.loader import LazyTensor, WeightLoadError

# safetensors dtype name -> (torch dtype, bytes per element)
ST_DTYPES = {"F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
             "BF16": (torch.bfloat16, 2), "I64": (torch.int64, 8), "I32": (torch.int32, 4), "I16": (torch.int16, 2),
             "I8": (torch.int8, 1), "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1)}
MAX_HEADER_BYTES = 100_000_000
INDEX_FILE = "model.safetensors.index.json"
SUFFIX = ".safetensors"


class FolderNotAllowed(PermissionError):
    """The folder lies outside the folders updates may read (``--allowed-weight-dirs``)."""


def fd_path(fd: int) -> str:
    """Where an open descriptor's file is now (symlinks resolved), from the kernel, not a path."""
    if sys.platform == "darwin":
        import fcntl

        return fcntl.fcntl(fd, fcntl.F_GETPATH, bytes(1024)).rstrip(b"\0").decode()  # type: ignore[attr-defined]
    return os.readlink(f"/proc/self/fd/{fd}")


def is_under(path: str, folders: Sequence[str]) -> bool:
    return any(os.path.commonpath([path, d]) == d for d in folders)


class PinnedFolder:
    """A folder held open by its directory descriptor (owned: ``close`` or ``with``).

    ``open`` resolves the path once; ``allowed`` (real paths) is checked against where the open
    descriptor lies, so that no later change of the path can move what this reads."""

    def __init__(self, fd: int, path: str):
        self._fd: Optional[int] = fd
        self.path = path

    @classmethod
    def open(cls, path: str | os.PathLike, allowed: Sequence[str] = ()) -> PinnedFolder:
        path = os.fspath(path)
        if "\x00" in path:
            raise WeightLoadError("the model path contains a NUL byte")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise WeightLoadError(f"{path!r} is not a folder that can be opened ({exc.strerror}): pass a Hugging "
                                  "Face safetensors folder") from None
        folder = cls(fd, path)
        if allowed:
            real = folder.real_path()
            if not is_under(real, allowed):
                folder.close()
                raise FolderNotAllowed(f"{path!r} (which is {real!r}) is outside --allowed-weight-dirs")
        return folder

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise ValueError(f"the pinned folder {self.path!r} is closed")
        return self._fd

    def real_path(self) -> str:
        return fd_path(self.fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> PinnedFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def __reduce__(self):
        raise TypeError("a PinnedFolder is a descriptor of this process: send it with "
                        "multiprocessing.reduction.send_handle, not pickled")

    def __repr__(self) -> str:
        return f"PinnedFolder({self.path!r}, fd={self._fd})"


def _pread(fd: int, out: memoryview, offset: int, what: str) -> None:
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], offset + got)
        if n == 0:
            raise WeightLoadError(f"{what}: the file ended early (truncated while being read?)")
        got += n


@dataclass(frozen=True)
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _entry(name: str, key: str, entry: object) -> _Entry:
    """One header entry, or a clear error."""
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
    return _Entry(dtype, tuple(shape), offsets[0], offsets[1])


def parse_header(name: str, fd: int, size: int) -> tuple[int, dict[str, _Entry]]:
    """(where the data region starts, the checked entries) of an open safetensors file of ``size``
    bytes; refused unless its offsets lie in the file and tile the data region exactly."""
    head = bytearray(8)
    if size < 8:
        raise WeightLoadError(f"{name}: truncated (no safetensors header)")
    _pread(fd, memoryview(head), 0, name)
    (n,) = struct.unpack("<Q", head)
    if n > size - 8 or n > MAX_HEADER_BYTES:
        raise WeightLoadError(f"{name}: header length {n} exceeds the file ({size} bytes): corrupt or truncated")
    raw = bytearray(n)
    _pread(fd, memoryview(raw), 8, name)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightLoadError(f"{name}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise WeightLoadError(f"{name}: header must be a JSON object, got {type(header).__name__}")
    data_len = size - 8 - n
    entries: dict[str, _Entry] = {}
    for key, raw_entry in header.items():
        if key == "__metadata__":
            continue
        e = _entry(name, key, raw_entry)
        numel = 1
        for s in e.shape:
            numel *= s
        if not (0 <= e.begin <= e.end <= data_len) or e.end - e.begin != numel * ST_DTYPES[e.dtype][1]:
            raise WeightLoadError(f"{name}: {key} has bad offsets [{e.begin}, {e.end}) for shape {list(e.shape)} "
                                  f"{e.dtype} in {data_len} data bytes (corrupt or truncated file)")
        entries[key] = e
    spans = sorted((e.begin, e.end) for e in entries.values())
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        raise WeightLoadError(f"{name}: tensors overlap in the data region")
    # the tensors must tile the data region exactly (what the safetensors format requires)
    if any(a[1] != b[0] for a, b in zip(spans, spans[1:])) or (spans and spans[0][0] != 0):
        raise WeightLoadError(f"{name}: the data region has gaps between tensors (corrupt file)")
    end = spans[-1][1] if spans else 0
    if end != data_len:
        raise WeightLoadError(f"{name}: {data_len - end} unexpected bytes after the last tensor")
    return 8 + n, entries


class SafetensorsFolder:
    """The weight files of a pinned folder, each opened once through it and held open (``with``).

    ``tensors()`` checks every file's header, then yields ``(name, LazyTensor)``: each tensor is read
    when the loader copies it."""

    def __init__(self, folder: PinnedFolder, follow_links: bool = False):
        self.folder = folder
        self.follow_links = follow_links
        self._fds: list[int] = []

    def __enter__(self) -> SafetensorsFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def _open(self, name: str) -> int:
        """A regular file of the folder, opened through the folder's descriptor."""
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if self.follow_links else os.O_NOFOLLOW)
        try:
            fd = os.open(name, flags, dir_fd=self.folder.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP and not self.follow_links:
                raise WeightLoadError(f"{name} is a symbolic link: weight files are read only as regular files of "
                                      "the folder itself, never through a link (which could point outside the "
                                      "model folder)") from None
            if exc.errno == errno.ENOENT:
                raise WeightLoadError(f"{name} does not exist in {self.folder.path!r}") from None
            raise WeightLoadError(f"{name}: cannot be opened ({exc.strerror})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise WeightLoadError(f"{name} is not a regular file")
        self._fds.append(fd)
        return fd

    def file_names(self) -> list[str]:
        """The weight files: those the index names, else every ``*.safetensors`` file of the folder."""
        # The pinned descriptor's directory offset is shared by every rank it was passed to: each
        # lists the folder through a description of its own ("." opened through the pin: the same
        # folder, never a path lookup), or ranks listing at once would skip or repeat entries.
        own = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.folder.fd)
        try:
            names = os.listdir(own)
        finally:
            os.close(own)
        if INDEX_FILE in names:
            index = self.read_json(INDEX_FILE, MAX_HEADER_BYTES)
            if not isinstance(index, dict):
                raise WeightLoadError(f"{INDEX_FILE}: not a JSON object")
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise WeightLoadError(f"{INDEX_FILE}: needs a non-empty \"weight_map\" object (tensor name -> file)")
            for value in weight_map.values():
                if not isinstance(value, str) or not value or "/" in value or value in (".", ".."):
                    raise WeightLoadError(f"{INDEX_FILE}: weight_map values must be file names in the model folder "
                                          f"itself, got {value!r} (a path outside the model folder, or in a "
                                          "subfolder, is refused)")
            wanted = sorted(set(weight_map.values()))
            missing = [n for n in wanted if n not in names]
            if missing:
                raise WeightLoadError(f"{INDEX_FILE} names files that do not exist: {', '.join(missing[:5])}")
            return wanted
        files = sorted(n for n in names if n.endswith(SUFFIX))
        if not files:
            raise WeightLoadError(f"no *.safetensors files in {self.folder.path!r} (only safetensors weights are "
                                  "loaded)")
        return files

    def read_json(self, name: str, max_bytes: int = 1_000_000) -> object:
        """A JSON file of the folder (an index, a config), read through the pinned folder like the weights."""
        fd = self._open(name)
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise WeightLoadError(f"{name}: {size} bytes is too large for a JSON file here (at most {max_bytes})")
        raw = bytearray(size)
        _pread(fd, memoryview(raw), 0, name)
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise WeightLoadError(f"{name}: not valid JSON ({exc})") from None

    def tensors(self) -> Iterator[tuple[str, LazyTensor]]:
        """Every tensor of the folder; all headers are checked before the first is yielded."""
        checked = []
        for name in self.file_names():
            fd = self._open(name)
            start, entries = parse_header(name, fd, os.fstat(fd).st_size)
            checked.append((fd, start, entries))
        for fd, start, entries in checked:
            for key, e in entries.items():
                dtype = ST_DTYPES[e.dtype][0]
                yield key, LazyTensor(e.shape, dtype, (lambda fd=fd, at=start + e.begin, e=e, k=key:
                                                       self._read(fd, at, e, k)))

    def _read(self, fd: int, offset: int, e: _Entry, key: str) -> torch.Tensor:
        if fd not in self._fds:  # never read a descriptor number this reader no longer owns
            raise WeightLoadError(f"{key}: read after the weight files were closed")
        buf = torch.empty(e.end - e.begin, dtype=torch.uint8)
        if buf.numel():
            _pread(fd, memoryview(buf.numpy()), offset, key)
        return buf.view(ST_DTYPES[e.dtype][0]).view(e.shape)
