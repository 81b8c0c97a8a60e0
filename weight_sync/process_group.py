"""One recipe for a free-standing process group: a TCP rendezvous hosted by rank 0, the group's
name as the prefix of its keys, and a gloo or NCCL group with a timeout. The engine's TP group and
every weight-update group are built here; neither touches the default group, so two engines (or an
engine and the caller's own ``torch.distributed`` job) never collide.

The recipe is SGLang's ``init_custom_process_group``, which the RL frameworks' trainers run on their
side (slime, miles, AReaL, SkyRL): ranks other than 0 meet through torch's own ``rendezvous`` on
``tcp://host:port``, the store is prefixed with the group's name, and torch's process-group helper
(``_new_process_group_helper``) builds the backend over it, adding prefixes of its own that differ
between torch versions (2.13 adds the device type). We do not hard-code them: ``torch_store_prefix``
asks this torch — its helper builds a one-rank group over a store that records the keys it writes,
and the backend alone over another; the difference is the helper's prefix. Our groups are then built
with the public backend classes over exactly those keys: the helper itself registers each name once
per process, and a trainer and an engine in one process must both hold the group.
``tests/test_compat_sglang_clients.py`` forms groups with a trainer process running SGLang's recipe.

A trainer may also build its side with plain ``torch.distributed.init_process_group(backend,
init_method="tcp://host:port")`` (vLLM-side clients, TRL's protocol over gloo, any torch-only
trainer): its keys lie under ``default_pg`` and a per-process counter. On gloo the engine's side
does not need to be told which: every gloo rank writes its own key as soon as it builds its group,
so the engine waits for the trainer's key under each layout and builds under the one it finds
(``new_process_group(peer_rank=...)``). NCCL builds lazily (no key before the first collective), so
an NCCL group is SGLang's recipe.

Exposure: rank 0's rendezvous listens only on the address it was given (a socket bound here and
handed to the store; torch's own store would listen on every interface). A group whose address is
a loopback one is reachable from this machine alone, and its gloo transport binds loopback too. A
cross-host weight-update group listens on the given address, unauthenticated, for as long as the
group lives: give it an address on the cluster's private network.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def resolved_addresses(host: str) -> list[str]:
    """Every address ``host`` resolves to (IPv4 and IPv6; brackets and an IPv6 zone dropped); [] if none."""
    name = host.strip()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError, ValueError):
        return []
    return sorted({str(info[4][0]).split("%")[0] for info in infos})


def is_wildcard(host: str) -> bool:
    """Whether ``host`` names every interface, however it is spelled (``""``, ``"0"``, ``"0x0"``,
    ``"000.0.0.0"``, ``"::"``, ``"[0::0]"``...): compared by what it resolves to, never by its text."""
    if not host.strip():
        return True
    return any(ipaddress.ip_address(a).is_unspecified for a in resolved_addresses(host))


def concrete_host(host: str) -> str:
    """``host`` as one concrete IPv4 address to bind; ``ValueError`` for a wildcard or a name that does
    not resolve (nothing of ours ever listens on every interface)."""
    if is_wildcard(host):
        raise ValueError(f"host {host!r} names every interface: bind one address (127.0.0.1 for this host)")
    try:
        return socket.gethostbyname(host.strip())
    except (OSError, UnicodeError) as exc:
        raise ValueError(f"host {host!r} does not resolve to an IPv4 address: {exc}") from None


def listen_socket(host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket bound to ``host`` only (port 0: a free one, read back from it); never a
    wildcard (``concrete_host``)."""
    address = concrete_host(host)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, int(port)))
        sock.listen(256)
    except BaseException:
        sock.close()
        raise
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` now (for a trainer choosing its weight group's rendezvous)."""
    with listen_socket(host) as sock:
        return sock.getsockname()[1]


class _KeyRecorder(dist.Store):
    """An in-memory store that remembers the first key written to it."""

    def __init__(self):
        super().__init__()
        self.inner = dist.HashStore()
        self.first: Optional[str] = None

    def set(self, key, value):
        if self.first is None:
            self.first = key
        self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)

    def add(self, key, amount):
        return self.inner.add(key, amount)

    def check(self, keys):
        return self.inner.check(keys)

    def wait(self, keys, timeout=None):
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        self.inner.set_timeout(timeout)


_PREFIX_LOCK = threading.Lock()
# learned once per process: the helper's key prefix with _STORE for the caller's PrefixStore and
# _NAME for the group's name, and gloo's key for a rank with _RANK for the rank
_LEARNED: dict[str, str] = {}
_STORE = f"rollout-store-{uuid.uuid4().hex}"
_NAME = f"rollout-name-{uuid.uuid4().hex}"
# plain ``torch.distributed.init_process_group`` prefixes its store with this and names its group
# by a per-process counter ("0" for a trainer's first group)
DEFAULT_PG = "default_pg"
DEFAULT_PG_COUNTERS = 8  # counters tried when looking for a plain torch trainer's group


def _gloo_options(timeout: datetime.timedelta, loopback: bool):
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    # a local group's transport binds loopback too; otherwise gloo picks this host's address
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if loopback
                     else dist.ProcessGroupGloo.create_default_device()]
    return opts


def _learn() -> dict[str, str]:
    with _PREFIX_LOCK:
        if not _LEARNED:
            from torch.distributed.distributed_c10d import _new_process_group_helper, _world

            timeout = datetime.timedelta(seconds=30)
            via_helper = _KeyRecorder()
            pg, _ = _new_process_group_helper(1, 0, [], "gloo", dist.PrefixStore(_STORE, via_helper),
                                              group_name=_NAME, timeout=timeout)
            _world.pg_group_ranks[pg] = {0: 0}  # as SGLang's recipe records it; destroy reads it
            dist.destroy_process_group(pg)
            alone = _KeyRecorder()
            dist.ProcessGroupGloo(alone, 0, 1, _gloo_options(timeout, True))
            full, own = via_helper.first, alone.first
            if (full is None or own is None or not full.endswith(own) or _STORE not in full
                    or not own.endswith("/0")):
                raise RuntimeError(f"cannot learn torch's process-group key layout (helper wrote {full!r}, the "
                                   f"backend alone {own!r})")
            _LEARNED["prefix"] = full[:-len(own)]
            _LEARNED["rank_key"] = own[:-1]  # + the rank: the key a gloo rank writes first
    return _LEARNED


def torch_store_prefix(group_name: str, device_type: str, store_prefix: Optional[str] = None) -> str:
    """The prefix under which a backend's own keys lie when torch's process-group helper builds a
    group named ``group_name`` over ``PrefixStore(store_prefix, store)`` — SGLang's recipe passes its
    group name as both (the default); plain ``init_process_group`` passes ``"default_pg"`` and a
    counter — as this torch lays it out, learned from torch itself (module docstring)."""
    template = _learn()["prefix"]
    chain = template.replace(_STORE, group_name if store_prefix is None else store_prefix).replace(_NAME, group_name)
    if device_type != "cpu":  # the helper prefixes each device type's backend with the type's name
        chain = chain.replace("/cpu/", f"/{device_type}/")
    return chain[:-1]  # a PrefixStore adds the "/" itself


def trainer_layouts(group_name: str, device_type: str = "cpu") -> list[str]:
    """Where a trainer's backend keys may lie: SGLang's recipe for ``group_name`` first, then the
    default group of plain ``torch.distributed.init_process_group`` (its first few counters)."""
    return [torch_store_prefix(group_name, device_type)] + [
        torch_store_prefix(str(i), device_type, DEFAULT_PG) for i in range(DEFAULT_PG_COUNTERS)]


def _await_peer_layout(store: dist.Store, peer_rank: int, group_name: str, timeout_s: float) -> str:
    """The prefix under which gloo rank ``peer_rank`` (the trainer) has announced itself: it writes
    its key as soon as it builds its group, before it waits for anyone (``trainer_layouts``)."""
    candidates = trainer_layouts(group_name)
    key = _learn()["rank_key"] + str(peer_rank)
    deadline = time.monotonic() + timeout_s
    while True:
        for prefix in candidates:
            if store.check([f"{prefix}/{key}"]):
                return prefix
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {peer_rank} (the trainer) joined the rendezvous but built no gloo group within "
                               f"{timeout_s}s, neither as group {group_name!r} (SGLang's recipe) nor as a default "
                               "group (torch.distributed.init_process_group)")
        time.sleep(0.01)


@dataclass
class GroupHandle:
    pg: dist.ProcessGroup
    store: dist.Store  # the rendezvous must live as long as the group


def new_process_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
                      group_name: str, *, listening: socket.socket | None = None,
                      nccl_timeout_factor: float = 1.0, peer_rank: Optional[int] = None) -> GroupHandle:
    """Join (rank 0: host) the rendezvous at ``host:port`` and build the group named ``group_name``.

    ``listening``: rank 0's socket, already bound (see ``listen_socket``); rank 0 binds one itself
    when it is not given. The store takes the socket over (and closes it). ``nccl_timeout_factor``
    scales NCCL's own watchdog timeout (a caller that polls with ``timeout_s`` itself gives NCCL
    more, so its own wait fails first and aborts only this group).

    ``peer_rank`` (a gloo weight group's trainer rank): build the group under whichever layout the
    trainer used — SGLang's recipe named ``group_name``, or plain ``init_process_group`` — found by
    waiting for the trainer's first key (``trainer_layouts``). Without it: SGLang's recipe."""
    timeout = datetime.timedelta(seconds=timeout_s)
    deadline = time.monotonic() + timeout_s  # one deadline for every stage: connect, layout, the group

    def left() -> datetime.timedelta:
        return datetime.timedelta(seconds=max(0.05, deadline - time.monotonic()))

    if rank == 0:  # the store listens on the address given, not on every interface
        fd = (listening or listen_socket(host, port)).detach()
        store = dist.TCPStore(host, int(port), world_size, True, timeout=timeout, master_listen_fd=fd)
    else:
        # torch's own connect retries with backoff past its timeout (5 s asked: ~10 s): wait for the
        # listener ourselves, within the deadline, then connect to it at once
        await_listener(host, int(port), deadline)
        store, _, _ = next(dist.rendezvous(f"tcp://{host}:{int(port)}", rank, world_size, timeout=left()))
    store.set_timeout(left())
    if backend == "gloo" and peer_rank is not None and peer_rank != rank:
        prefix = _await_peer_layout(store, peer_rank, group_name, max(0.0, deadline - time.monotonic()))
    else:
        prefix = torch_store_prefix(group_name, "cuda" if backend == "nccl" else "cpu")
    prefixed = dist.PrefixStore(prefix, store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout * nccl_timeout_factor
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    elif backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, _gloo_options(timeout, is_loopback(host)))
    else:
        raise ValueError(f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (CUDA)")
    store.set_timeout(timeout)  # the group's later store operations: the whole timeout each
    return GroupHandle(pg, store)


def await_listener(host: str, port: int, deadline: float) -> None:
    """Until something accepts connections at ``host:port``; ``TimeoutError`` naming it at ``deadline``."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing accepted a connection at {host}:{port} before the group's timeout (the "
                                   f"trainer hosts the rendezvous there): {exc}") from None
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
