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
import uuid
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def listen_socket(host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket bound to ``host`` only (port 0: a free one, read back from it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((socket.gethostbyname(host), int(port)))
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
_PREFIX_TEMPLATE: list[str] = []  # [template with _MARKER for the group name], learned once per process
_MARKER = f"rollout-probe-{uuid.uuid4().hex}"


def _gloo_options(timeout: datetime.timedelta, loopback: bool):
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    # a local group's transport binds loopback too; otherwise gloo picks this host's address
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if loopback
                     else dist.ProcessGroupGloo.create_default_device()]
    return opts


def torch_store_prefix(group_name: str, device_type: str) -> str:
    """The prefix under which a backend's own keys lie when a group named ``group_name`` is built
    SGLang's way (``PrefixStore(group_name, store)`` handed to torch's process-group helper), as
    this torch lays it out — learned from torch itself (module docstring)."""
    with _PREFIX_LOCK:
        if not _PREFIX_TEMPLATE:
            from torch.distributed.distributed_c10d import _new_process_group_helper, _world

            timeout = datetime.timedelta(seconds=30)
            via_helper = _KeyRecorder()
            pg, _ = _new_process_group_helper(1, 0, [], "gloo", dist.PrefixStore(_MARKER, via_helper),
                                              group_name=_MARKER, timeout=timeout)
            _world.pg_group_ranks[pg] = {0: 0}  # as SGLang's recipe records it; destroy reads it
            dist.destroy_process_group(pg)
            alone = _KeyRecorder()
            dist.ProcessGroupGloo(alone, 0, 1, _gloo_options(timeout, True))
            full, own = via_helper.first, alone.first
            if full is None or own is None or not full.endswith(own) or _MARKER not in full:
                raise RuntimeError(f"cannot learn torch's process-group key layout (helper wrote {full!r}, the "
                                   f"backend alone {own!r})")
            _PREFIX_TEMPLATE.append(full[:-len(own)])
    chain = _PREFIX_TEMPLATE[0].replace(_MARKER, group_name)
    if device_type != "cpu":  # the helper prefixes each device type's backend with the type's name
        chain = chain.replace("/cpu/", f"/{device_type}/")
    return chain[:-1]  # a PrefixStore adds the "/" itself


@dataclass
class GroupHandle:
    pg: dist.ProcessGroup
    store: dist.Store  # the rendezvous must live as long as the group


def new_process_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
                      group_name: str, *, listening: socket.socket | None = None,
                      nccl_timeout_factor: float = 1.0) -> GroupHandle:
    """Join (rank 0: host) the rendezvous at ``host:port`` and build the group named ``group_name``.

    ``listening``: rank 0's socket, already bound (see ``listen_socket``); rank 0 binds one itself
    when it is not given. The store takes the socket over (and closes it). ``nccl_timeout_factor``
    scales NCCL's own watchdog timeout (a caller that polls with ``timeout_s`` itself gives NCCL
    more, so its own wait fails first and aborts only this group)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:  # the store listens on the address given, not on every interface
        fd = (listening or listen_socket(host, port)).detach()
        store = dist.TCPStore(host, int(port), world_size, True, timeout=timeout, master_listen_fd=fd)
    else:
        store, _, _ = next(dist.rendezvous(f"tcp://{host}:{int(port)}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefixed = dist.PrefixStore(torch_store_prefix(group_name, "cuda" if backend == "nccl" else "cpu"), store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout * nccl_timeout_factor
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    elif backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, _gloo_options(timeout, is_loopback(host)))
    else:
        raise ValueError(f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (CUDA)")
    return GroupHandle(pg, store)
