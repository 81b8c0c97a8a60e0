"""Sessions: conversations whose token history, and the KV computed for it, the engine keeps between
turns (SGLang's ``/open_session`` and ``session_params``; multi-turn agentic rollouts).

A turn appends tokens to the history and generates; its request's prompt is the whole history plus
the appended tokens. When the turn is admitted, the session hands its KV blocks to the turn's
sequence (the history's KV is not recomputed: the turn's prefill is the appended tokens and the
previous turn's last sampled token, whose KV was never computed); when the turn ends normally the
sequence hands them back with the longer history. Only the KV of a turn admitted and finished under
the same weights is kept: after a weight update the next turn recomputes the whole history under the
new weights (its ``num_cached_tokens`` says so), as for any cached prefix. An aborted turn leaves the
session as it was before the turn.

Held KV is released, history kept, when blocks run short (idle sessions, least recently used first,
before any running sequence is preempted); a session idle for its timeout is closed.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

from rollout.config import InputError

MAX_SESSION_ID_CHARS = 256


class SessionError(InputError):
    """A session call that cannot be done (unknown or busy session, a turn that does not fit)."""


def check_session_id(sid) -> None:
    """A session id is a short printable string (a client names it; the tables keep it)."""
    if not isinstance(sid, str) or not 0 < len(sid) <= MAX_SESSION_ID_CHARS or not sid.isprintable():
        raise SessionError(f"a session id is 1-{MAX_SESSION_ID_CHARS} printable characters")


@dataclass
class Session:
    sid: str
    timeout_s: Optional[float]
    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)  # KV held for token_ids[:num_computed]
    num_computed: int = 0
    cache_key: Optional[str] = None  # the weights' key the held KV was computed under
    busy_rid: Optional[str] = None  # the turn running now
    last_used: float = field(default_factory=time.monotonic)
    num_turns: int = 0

    @property
    def idle(self) -> bool:
        return self.busy_rid is None


class SessionTable:
    """Every open session; the scheduler holds one (touched on its thread only)."""

    def __init__(self, default_timeout_s: Optional[float] = None, max_sessions: int = 4096):
        self.default_timeout_s = default_timeout_s
        self.max_sessions = max_sessions
        self.sessions: dict[str, Session] = {}

    def open(self, sid: Optional[str] = None, timeout_s: Optional[float] = None) -> Session:
        sid = sid or f"session-{uuid.uuid4().hex}"
        check_session_id(sid)
        if sid in self.sessions:
            raise SessionError(f"session {sid!r} is already open")
        if len(self.sessions) >= self.max_sessions:
            raise SessionError(f"{len(self.sessions)} sessions are open (the engine's max_sessions): close some, or "
                               "let idle ones time out")
        s = self.sessions[sid] = Session(sid, timeout_s if timeout_s is not None else self.default_timeout_s)
        return s

    def get(self, sid: str) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            raise SessionError(f"no open session {sid!r} (closed, timed out, or never opened): open one first")
        return s

    def close(self, sid: str) -> Session:
        return self.sessions.pop(sid) if sid in self.sessions else self.get(sid)

    def expired(self, now: float) -> list[Session]:
        return [s for s in self.sessions.values()
                if s.idle and s.timeout_s is not None and now - s.last_used > s.timeout_s]

    def holding_kv(self) -> list[Session]:
        """Sessions that hold KV, idle ones first, least recently used first. A session whose turn is
        waiting holds KV too (it moves to the turn when the turn is admitted): under memory pressure
        it goes like any other, or waiting turns would each pin their history and none be admitted."""
        return sorted((s for s in self.sessions.values() if s.block_table), key=lambda s: (not s.idle, s.last_used))
