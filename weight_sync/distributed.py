"""Weights over a process group: the trainer's sender side and the engine's receiving side.

A weight-update group is its own rendezvous (a TCP store hosted by the trainer's rank 0, which is
rank 0 of the group; engine TP rank ``r`` joins as ``rank_offset + r``), separate from the
engine's TP group and from any default group, formed as SGLang's clients form it
(``weight_sync.process_group``), so their trainers join it. Tensors travel as flattened buckets: both sides
split the same (name, dtype, shape) list with the same ``bucket_bytes``, so one broadcast moves a
whole bucket. Every rendezvous and every broadcast has a timeout; errors name the group and stage.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from weight_sync.layout import bucket_layouts, contiguous_run, dtype_name, pack, spec_tuple, views
from weight_sync.process_group import new_process_group

DEFAULT_BUCKET_BYTES = 128 << 20
# a LoRA adapter's buckets (cut where its A tensors end, ``layout.bucket_specs``): a rank-16 SmolLM2 adapter
# goes as two messages, its A (9.6 MB, received in place) and its B (9.9 MB, copied out while nothing else
# waits). 4 MiB buckets, to copy one out while the next travels, were ~10% slower on two cores (Zen 4,
# gloo: each message costs ~0.1 ms, and the copy slows the transfer it overlaps by as much as it takes)
ADAPTER_BUCKET_BYTES = 32 << 20
# load_format of a distributed update: how the sender's broadcasts lay out the tensors of one call
DIRECT = "direct"  # SGLang's default: one broadcast per tensor, in the call's order, exactly its bytes
FLATTENED = "flattened_bucket"  # SGLang's flattened bucket: one broadcast, the tensors' bytes in order
ROLLOUT_BUCKET = "rollout_bucket"  # ours: buckets of bucket_bytes in wire order, 64-byte aligned
# vLLM's packed broadcast (``update_info.packed``): the tensors' bytes in the call's order, no padding,
# cut into chunks greedily — a chunk ends with the tensor that takes it past bucket_bytes
PACKED = "packed"
LOAD_FORMATS = (DIRECT, FLATTENED, ROLLOUT_BUCKET, PACKED)
EXACT_FORMATS = (DIRECT, FLATTENED, PACKED)  # each tensor's own bytes, in the call's order
VLLM_PACKED_BUFFER_BYTES = 1 << 30  # vLLM's default packed_buffer_size_bytes
CANARY = 8  # bytes: a gloo receive is checked against what its call announced (receive_exact)


class WeightGroupError(RuntimeError):
    """A weight-update group failed (rendezvous or transfer); it has been torn down."""


def make_group(master_address: str, master_port: int, rank: int, world_size: int, backend: str,
               timeout_s: float, group_name: str, src: int = 0) -> WeightGroup:
    """Join (rank 0: host) the group's rendezvous and build its process group. ``src``: the rank
    that broadcasts the weights (the trainer: 0 for SGLang and vLLM clients, the last rank for TRL's).
    A receiving rank builds its gloo group under whichever layout the trainer used (SGLang's recipe
    or plain ``init_process_group``, ``weight_sync.process_group``)."""
    try:
        # NCCL's own watchdog may tear the whole process down on a timeout: give it twice ours,
        # so ``WeightGroup.wait`` times out first and aborts only this group.
        handle = new_process_group(master_address, master_port, rank, world_size, backend, timeout_s,
                                   group_name, nccl_timeout_factor=2.0, peer_rank=None if rank == src else src)
    except Exception as exc:  # noqa: BLE001 - re-raised with the group's name and stage
        raise WeightGroupError(f"weight update group {group_name!r}: rendezvous at {master_address}:{master_port} "
                               f"as rank {rank}/{world_size} failed within {timeout_s}s ({exc})") from exc
    return WeightGroup(handle.pg, handle.store, timeout_s, backend, src)


@dataclass
class WeightGroup:
    pg: dist.ProcessGroup
    store: dist.Store  # the rendezvous lives as long as the group
    timeout_s: float = 60.0
    backend: str = "gloo"
    src: int = 0  # the rank that broadcasts the weights

    def wait(self, work) -> None:
        """Wait for one operation within the group's timeout. Gloo enforces it itself; an NCCL
        wait only orders streams, so the host polls until the operation completes and, past the
        timeout, aborts the communicator (only this group) and raises."""
        if self.backend != "nccl":
            work.wait()
            return
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                abort = getattr(self.pg, "abort", None)
                if abort is not None:
                    abort()
                raise TimeoutError(f"no progress within {self.timeout_s}s")
            time.sleep(0.0005)
        work.wait()


def broadcast(group: WeightGroup, tensor: torch.Tensor, src: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.wait(group.pg.broadcast([tensor], opts))


def receive_buckets(group: WeightGroup, specs, bucket_bytes: int, device: torch.device, group_name: str,
                    on_bucket=None, pool: list | None = None, place=None, posted_first=None, on_raw=None,
                    window: int = 2, point_to_point: bool = False):
    """Receive every bucket the sender broadcasts for ``specs`` (``point_to_point``: sends to this rank alone,
    ``WeightUpdateSender.send(to=...)``, a catch-up push to one replica of several).

    With ``on_bucket``: each bucket lands in one of two reused buffers (``pool``, grown when
    needed), or where ``place(metas, total)`` says (a byte view, or None for the pool), and
    ``on_bucket(named, placed)`` gets its (name, view) pairs while the next bucket is already on
    the wire; pool views are only valid during the call. Returns None.
    Without: every bucket is kept, each in a fresh buffer of its own with every receive posted
    up front, and the (name, view) pairs are returned.
    Every wait has the group's timeout; a failure raises ``WeightGroupError`` naming the bucket.
    ``posted_first()``: work to do once the first receives are posted, while the first bytes travel.
    ``on_raw(i, slot, metas, more)`` instead of ``on_bucket``: bucket ``i``'s bytes and its tensors' metas,
    no views made (the same specs give the very same ``metas`` objects each call), and whether later
    buckets are still to come (on the wire: copy beside the transfer's threads, or with every core)."""
    buckets = _bucket_layouts(spec_tuple(specs), bucket_bytes)
    placed = [None] * len(buckets)
    kept = on_bucket is None and on_raw is None
    if kept:  # every bucket kept: its own buffer, all posted at once
        slots, window = [torch.empty(total, dtype=torch.uint8, device=device) for _, total in buckets], len(buckets)
    else:
        need = max((total for _, total in buckets), default=0)
        if pool is None:
            pool = []
        window = max(2, min(window, len(buckets)))
        if len(pool) < window or pool[0].numel() < need or pool[0].device != device:
            pool[:] = [torch.empty(need, dtype=torch.uint8, device=device) for _ in range(window)]
        if place is not None:
            placed = [place(metas, total) for metas, total in buckets]
        slots = [p if p is not None else pool[i % window][:total] for i, (p, (_, total)) in enumerate(zip(placed, buckets))]
    opts = dist.BroadcastOptions()
    opts.rootRank = group.src
    posted, staged = {}, []
    # gloo takes a shorter message than the buffer posted silently: each bucket's last CANARY bytes are marked
    # before its receive is posted, and a mark still there after it says fewer bytes arrived (by CANARY or more)
    marks = torch.randint(0, 256, (CANARY,), dtype=torch.uint8, device=device) if group.backend == "gloo" else None
    short = None  # the first bucket that came short: the rest are still drained, then the call fails

    def post(i: int) -> None:
        if marks is not None:
            _mark_end(slots[i], buckets[i][1], marks)
        try:
            posted[i] = group.pg.recv([slots[i]], group.src, 0) if point_to_point else group.pg.broadcast([slots[i]], opts)
        except Exception as exc:  # noqa: BLE001 - the group is broken
            raise WeightGroupError(f"weight update group {group_name!r}: posting bucket {i + 1}/{len(buckets)} "
                                   f"failed: {exc}") from exc

    for i in range(min(window, len(buckets))):
        post(i)
    if posted_first is not None:
        posted_first()
    for i, (metas, total) in enumerate(buckets):
        try:
            group.wait(posted.pop(i))
        except Exception as exc:  # noqa: BLE001 - re-raised with the group's name and stage
            raise WeightGroupError(f"weight update group {group_name!r}: bucket {i + 1}/{len(buckets)} "
                                   f"({total} bytes) failed: {exc}") from exc
        if short is None and marks is not None and _came_short(slots[i], total, marks):
            short = f"bucket {i + 1}/{len(buckets)} ({metas[0].name} ... {metas[-1].name}): fewer than its {total} bytes"
        if short is None:  # (after a short bucket the rest are only drained)
            if on_raw is not None:
                on_raw(i, slots[i], metas, i + 1 < len(buckets))  # overlaps the next bucket's transfer
            elif kept:
                staged.extend(views(slots[i], metas))
            else:
                on_bucket(views(slots[i], metas), placed[i] is not None)  # overlaps the next bucket's transfer
        if i + window < len(buckets):
            post(i + window)
    if short is not None:
        raise WeightSizeMismatch(f"weight update group {group_name!r}: {short} arrived: the sender sent less than "
                                 "the call announced (names, dtypes, shapes)")
    return staged if kept else None


def _mark_end(buf: torch.Tensor, n: int, mark: torch.Tensor) -> None:
    """Mark the last bytes of what a receive into ``buf`` should fill (its first ``n`` bytes) before posting it."""
    k = min(CANARY, n)
    buf[n - k:n] = mark[:k]


def _came_short(buf: torch.Tensor, n: int, mark: torch.Tensor) -> bool:
    """Whether the mark ``_mark_end`` left is still there: fewer than ``n`` bytes arrived (by ``CANARY`` or more;
    gloo takes a shorter message than the buffer posted silently)."""
    k = min(CANARY, n)
    return k > 0 and torch.equal(buf[n - k:n], mark[:k])


@functools.lru_cache(maxsize=8)
def _bucket_layouts(specs: tuple, bucket_bytes: int) -> tuple:
    """``bucket_layouts`` of one call's specs, kept: a trainer pushes the same list every step."""
    return tuple((tuple(metas), total) for metas, total in bucket_layouts(specs, bucket_bytes))


class WeightSizeMismatch(WeightGroupError):
    """A broadcast carried another number of bytes than its call announced (names, dtypes, shapes)."""


def exact_transfers(specs, load_format: str = DIRECT, chunk_bytes: int = VLLM_PACKED_BUFFER_BYTES
                    ) -> list[list[tuple[str, torch.dtype, tuple[int, ...], int, int]]]:
    """The layouts that send each tensor's own bytes in the call's order, no padding: ``direct``
    (one transfer per tensor), ``flattened_bucket`` (one transfer of them all) and vLLM's ``packed``
    (transfers of them back to back, each closed by the tensor that takes it past ``chunk_bytes``).
    Each entry: (name, dtype, shape, byte offset in its transfer, bytes)."""
    if load_format not in EXACT_FORMATS:
        raise ValueError(f"load_format={load_format!r}: not one of {EXACT_FORMATS}")
    out: list[list] = []
    offset, closed = 0, True
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        if closed or load_format == DIRECT:
            out.append([])
            offset, closed = 0, False
        out[-1].append((name, dtype, tuple(shape), offset, nbytes))
        offset += nbytes
        closed = load_format == PACKED and offset > chunk_bytes
    return out


def receive_exact(group: WeightGroup, specs, device: torch.device, group_name: str, on_transfer,
                  load_format: str = DIRECT, pool: list | None = None,
                  chunk_bytes: int = VLLM_PACKED_BUFFER_BYTES, posted_first=None) -> None:
    """Receive a call sent SGLang's or vLLM's way (``exact_transfers``) and hand each transfer's
    (name, view) pairs to ``on_transfer`` while the next is on the wire (two reused buffers, ``pool``).

    On gloo every transfer is checked against what the call announced: the buffer posted is twice
    the announced bytes plus ``CANARY`` (gloo accepts a shorter message silently and aborts the
    process on a longer one than the buffer; ``posted_first`` as for ``receive_buckets``), with random
    marks at the end of the announced bytes
    and just past them; a mark left in place (fewer bytes arrived, by ``CANARY`` or more) or
    overwritten (more arrived) raises ``WeightSizeMismatch`` naming the tensor, what was announced
    and what differed. A sender that sends more than twice what it announced takes gloo's own
    check, which ends the process. NCCL posts exactly the announced bytes (counts must match)."""
    transfers = exact_transfers(specs, load_format, chunk_bytes)
    checked = group.backend == "gloo"
    sizes = [sum(e[4] for e in t) for t in transfers]
    room = [2 * n + CANARY if checked else n for n in sizes]
    if pool is None:
        pool = []
    need = max(room, default=0)
    if len(pool) < 2 or pool[0].numel() < need or pool[0].device != device:
        pool[:] = [torch.empty(need, dtype=torch.uint8, device=device) for _ in range(2)]
    opts = dist.BroadcastOptions()
    opts.rootRank = group.src
    marks = torch.randint(0, 256, (2, CANARY), dtype=torch.uint8, device=device) if checked else None
    posted: dict = {}

    def what(i: int) -> str:
        names = [e[0] for e in transfers[i]]
        head = names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]} ({len(names)} tensors, {load_format})"
        return f"{head}: announced {sizes[i]} bytes ({', '.join(f'{e[1]} {list(e[2])}' for e in transfers[i][:3])})"

    def post(i: int) -> None:
        buf = pool[i % 2][:room[i]]
        if checked:
            _mark_end(buf, sizes[i], marks[0])
            buf[sizes[i]:sizes[i] + CANARY] = marks[1]
        try:
            posted[i] = group.pg.broadcast([buf], opts)
        except Exception as exc:  # noqa: BLE001 - the group is broken
            raise WeightGroupError(f"weight update group {group_name!r}: posting {what(i)} failed: {exc}") from exc

    for i in range(min(2, len(transfers))):
        post(i)
    if posted_first is not None:
        posted_first()
    mismatch = None  # the first transfer of another size than announced; the rest is still drained
    for i, entries in enumerate(transfers):
        try:
            group.wait(posted.pop(i))
        except Exception as exc:  # noqa: BLE001 - re-raised with the group's name and stage
            raise WeightGroupError(f"weight update group {group_name!r}: receiving {what(i)} failed: {exc}") from exc
        buf, n = pool[i % 2], sizes[i]
        if checked and mismatch is None:
            if _came_short(buf, n, marks[0]):
                mismatch = f"{what(i)}, but fewer bytes arrived"
            elif not torch.equal(buf[n:n + CANARY], marks[1]):
                mismatch = f"{what(i)}, but more bytes arrived"
        if mismatch is None:
            on_transfer([(name, _typed(buf[off:off + nb], dtype, shape)) for name, dtype, shape, off, nb in entries])
        if i + 2 < len(transfers):
            post(i + 2)
    if mismatch is not None:
        raise WeightSizeMismatch(f"weight update group {group_name!r}: {mismatch}: the sender broadcast another "
                                 "dtype or shape than it announced")


def _typed(raw: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """Bytes as a tensor of ``dtype``; a flattened call mixing dtypes may leave one unaligned (copied)."""
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).view(shape)


@contextlib.contextmanager
def one_cpu_thread(device: torch.device):
    """Copy on one thread on CPU while a transfer runs: the broadcast's own threads keep the cores
    busy copying through the socket, and an OpenMP team on top of them oversubscribes the cores,
    so its barriers stall (SmolLM2, 32 MiB buckets, 2 cores: a receive took 0.14-0.19 s with two
    pack threads on the sender, 0.10-0.11 s with one; a bare broadcast 0.08-0.12 s)."""
    if device.type != "cpu":
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class WeightUpdateSender:
    """The trainer side (rank 0 of the group): hosts the rendezvous and broadcasts buckets.

    Typical use::

        sender = WeightUpdateSender("127.0.0.1", port, world_size=1 + engine_tp, group_name="g")
        # concurrently, the engine: engine.init_weights_update_group("127.0.0.1", port, 1, 1 + engine_tp, "g")
        names, dtypes, shapes = sender.describe(named_tensors)
        # concurrently: engine.update_weights_from_distributed(names, dtypes, shapes, "g", ...)
        sender.send(named_tensors)
    """

    def __init__(self, master_address: str, master_port: int, world_size: int, group_name: str,
                 backend: str = "gloo", timeout_s: float = 60.0):
        self.group_name = group_name
        self.group = make_group(master_address, master_port, 0, world_size, backend, timeout_s, group_name)
        self._buffers: list[torch.Tensor] | None = None

    @staticmethod
    def describe(named_tensors: list[tuple[str, torch.Tensor]]):
        return ([n for n, _ in named_tensors], [dtype_name(t.dtype) for _, t in named_tensors],
                [list(t.shape) for _, t in named_tensors])

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
             load_format: str = ROLLOUT_BUCKET, to: Optional[Sequence[int]] = None) -> int:
        """Broadcast the tensors: in our buckets (``rollout_bucket``, the engine's call must say the
        same ``bucket_bytes``), SGLang's way — one broadcast per tensor (``direct``) or all of
        them flattened into one (``flattened_bucket``) — or vLLM's ``packed`` chunks of
        ``bucket_bytes``.

        A bucket whose tensors already lie in one buffer in bucket layout (views of a
        ``FlattenedTensorBucket`` holding the model) goes out from that memory, with no copy.
        Otherwise it is packed into one of two buffers, allocated once and reused: bucket i+1 is
        packed while bucket i is on the wire (broadcasts run asynchronously).

        ``to``: these ranks alone, each bucket sent to each of them point to point (our buckets only; their
        calls say ``point_to_point``), where the others of the group must not take this push."""
        named = list(named_tensors)
        if to is not None and load_format != ROLLOUT_BUCKET:
            raise ValueError("a push to some ranks alone goes in our buckets (load_format='rollout_bucket')")
        if load_format in EXACT_FORMATS:
            return self._send_exact(named, load_format, bucket_bytes)
        if load_format != ROLLOUT_BUCKET:
            raise ValueError(f"load_format={load_format!r}: use one of {LOAD_FORMATS}")
        specs = tuple((n, t.dtype, tuple(t.shape)) for n, t in named)
        tensors = dict(named)
        buckets = _bucket_layouts(specs, bucket_bytes)
        if not buckets:
            return 0
        plan = [(metas, total, contiguous_run([tensors[m.name] for m in metas], metas, total))
                for metas, total in buckets]
        need = max((total for _, total, flat in plan if flat is None), default=0)
        device = named[0][1].device
        if need and (self._buffers is None or self._buffers[0].numel() < need or self._buffers[0].device != device):
            self._buffers = [torch.empty(need, dtype=torch.uint8, device=device) for _ in range(2)]
        opts = dist.BroadcastOptions()
        opts.rootRank = 0

        def post(flat: torch.Tensor) -> list:
            if to is None:
                return [self.group.pg.broadcast([flat], opts)]
            return [self.group.pg.send([flat], rank, 0) for rank in to]

        in_flight: list = [[], []]  # the last sends out of each pack buffer
        works: list = []
        next_buf, sent, current = 0, 0, 0
        try:
            for metas, total, flat in plan:
                current += 1
                if flat is None:
                    b, next_buf = next_buf, next_buf ^ 1
                    for work in in_flight[b]:
                        self.group.wait(work)  # this buffer is free again once its bucket is out
                    flat = self._buffers[b][:total]
                    with one_cpu_thread(device):
                        pack(flat, metas, [(m.name, tensors[m.name]) for m in metas])
                    in_flight[b] = posted = post(flat)
                else:
                    posted = post(flat)
                works.append(posted)
                sent += total
            current = 0
            for posted in works:
                current += 1
                for work in posted:
                    self.group.wait(work)
        except Exception as exc:  # noqa: BLE001
            raise WeightGroupError(f"weight update group {self.group_name!r}: sending bucket {current}/"
                                   f"{len(buckets)} failed: {exc}") from exc
        return sent

    def _send_exact(self, named: list[tuple[str, torch.Tensor]], load_format: str, chunk_bytes: int) -> int:
        """SGLang's and vLLM's layouts: each tensor's own bytes in order, per broadcast, concatenated
        into one, or packed into chunks (``exact_transfers``)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        tensors = dict(named)
        transfers = exact_transfers([(n, t.dtype, tuple(t.shape)) for n, t in named], load_format, chunk_bytes)
        payloads = []
        for entries in transfers:
            if len(entries) == 1:
                payloads.append(tensors[entries[0][0]].detach().contiguous())
            else:
                payloads.append(torch.cat([tensors[e[0]].detach().contiguous().reshape(-1).view(torch.uint8)
                                           for e in entries]))
        try:
            works = [self.group.pg.broadcast([p], opts) for p in payloads]
            for work in works:
                self.group.wait(work)
        except Exception as exc:  # noqa: BLE001
            raise WeightGroupError(f"weight update group {self.group_name!r}: sending failed: {exc}") from exc
        return sum(p.numel() * p.element_size() for p in payloads)

    def close(self) -> None:
        self.group = None
        self._buffers = None
