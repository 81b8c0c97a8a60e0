"""One recipe for a free-standing process group: a TCP rendezvous hosted by rank 0, a prefix for
its keys, and a gloo or NCCL group with a timeout. The engine's TP group and every weight-update
group are built here; neither touches the default group, so two engines (or an engine and the
caller's own ``torch.distributed`` job) never collide.

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
from dataclasses import dataclass

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


@dataclass
class GroupHandle:
    pg: dist.ProcessGroup
    store: dist.Store  # the rendezvous must live as long as the group


def new_process_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
                      prefix: str, *, listening: socket.socket | None = None,
                      nccl_timeout_factor: float = 1.0) -> GroupHandle:
    """Join (rank 0: host) the rendezvous at ``host:port`` and build the group.

    ``listening``: rank 0's socket, already bound (see ``listen_socket``); rank 0 binds one itself
    when it is not given. The store takes the socket over (and closes it). ``nccl_timeout_factor``
    scales NCCL's own watchdog timeout (a caller that polls with ``timeout_s`` itself gives NCCL
    more, so its own wait fails first and aborts only this group)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    fd = None
    if rank == 0:
        fd = (listening or listen_socket(host, port)).detach()
    store = dist.TCPStore(host, int(port), world_size, rank == 0, timeout=timeout, master_listen_fd=fd)
    prefixed = dist.PrefixStore(prefix, store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout * nccl_timeout_factor
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    elif backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        # a local group's transport binds loopback too; otherwise gloo picks this host's address
        device = (dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if is_loopback(host)
                  else dist.ProcessGroupGloo.create_default_device())
        opts._devices = [device]
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    else:
        raise ValueError(f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (CUDA)")
    return GroupHandle(pg, store)
