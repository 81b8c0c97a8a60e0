"""The HTTP protocol the server runs: uvicorn's h11 protocol with a deadline on reading each request.

uvicorn's settings bound an idle keep-alive connection (``timeout_keep_alive``, after a response) but
nothing bounds reading a request: a socket that sends nothing, half its headers or half its body
stays open for good, holding a connection. ``ReadDeadlineH11`` closes it when a request has not
arrived whole (headers and body) within ``read_timeout_s`` of its first byte (of the connection, for
the first request). Once a request is read, no deadline runs: a response may take as long as the
generation does (slime waits without a timeout, prime-rl up to 720 s), and ``--request-timeout-s``
bounds that instead.

It also lends each request its connection's transport (``scope["state"][TRANSPORT]``): a stream
reads how many bytes wait in it for a slow reader (``get_write_buffer_size``) and keeps that under
its cap (``rollout.server.service``). ASGI has no field for it; the scope's ``state`` (a copy of the
server's state per connection here) is the one a protocol may fill.

A subclass of uvicorn's protocol, not another server: the hooks it uses (``connection_made``,
``data_received``, ``connection_lost``, h11's ``their_state``) are the protocol's public asyncio and
h11 surface; pass it as ``uvicorn.run(..., http=read_deadline_protocol(30.0))``.
"""

from __future__ import annotations

import asyncio
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_READ = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR)  # their side has sent a whole request (or is gone)
TRANSPORT = "rollout.transport"  # the scope state's key for the connection's transport


class ReadDeadlineH11(H11Protocol):
    read_timeout_s: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.app_state = {**self.app_state, TRANSPORT: transport}  # this connection's requests see it
        self._read_deadline: Optional[asyncio.TimerHandle] = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        self._arm()  # a request's bytes are arriving (no-op while one is being read)
        super().data_received(data)
        if self.conn.their_state in _READ:
            self._disarm()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._read_deadline is None:
            self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.conn.their_state not in _READ and not self.transport.is_closing():
            self.logger.info("closed a connection whose request did not arrive within %.0f s", self.read_timeout_s)
            self.transport.close()


def read_deadline_protocol(read_timeout_s: float) -> type[ReadDeadlineH11]:
    """The protocol class for ``uvicorn.run(http=...)`` with this deadline."""
    if not read_timeout_s > 0:
        raise ValueError(f"--request-read-timeout-s must be > 0, got {read_timeout_s}")
    return type("ReadDeadlineH11", (ReadDeadlineH11,), {"read_timeout_s": float(read_timeout_s)})
