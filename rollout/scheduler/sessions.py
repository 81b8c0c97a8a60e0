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

import dataclasses
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from rollout.config import InputError

if TYPE_CHECKING:
    from rollout.scheduler.block_manager import BlockManager
    from rollout.scheduler.request import Request, Sequence

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


class SessionKv:
    """The scheduler's sessions: the table and the KV each session holds between turns, on the scheduler's
    thread. A turn begins (its prompt becomes history + what it appends), adopts the session's KV when it is
    admitted under the same weights (else the history is recomputed), and ends handing its KV back (a normal
    end) or leaving the session as it was (an abort or error); held KV is released, idle and least recently
    used first, when blocks run short; an idle session past its timeout is closed."""

    def __init__(self, table: SessionTable, block_manager: BlockManager, max_req_len: Callable[[], int],
                 cache_key: Callable[[Request], str]):
        self.table = table
        self.block_manager = block_manager
        self.max_req_len = max_req_len  # the context, and what the KV pool can hold for one sequence
        self.cache_key = cache_key  # a request's prefix-cache key now (weights, adapter, salt)
        self._checked = time.monotonic()

    def __bool__(self) -> bool:
        return bool(self.table.sessions)

    def open(self, session_id: Optional[str] = None, timeout_s: Optional[float] = None) -> str:
        return self.table.open(session_id, timeout_s).sid

    def close(self, session_id: str) -> None:
        """Forget the session and free its KV; a turn still running finishes, and keeps nothing."""
        self.drop_kv(self.table.close(session_id))

    def info(self, session_id: str) -> dict:
        s = self.table.get(session_id)
        return {"session_id": s.sid, "num_tokens": len(s.token_ids), "num_turns": s.num_turns,
                "num_cached_tokens": s.num_computed if s.block_table else 0, "busy": not s.idle,
                "token_ids": list(s.token_ids)}

    def drop_all_kv(self) -> None:
        """Every session's KV freed (the KV cache is being released); histories are kept."""
        for s in list(self.table.sessions.values()):
            self.drop_kv(s)

    def drop_kv(self, s: Session) -> None:
        self.block_manager.free(s.block_table)
        s.block_table, s.num_computed, s.cache_key = [], 0, None

    def begin_turn(self, req: Request) -> None:
        """A session turn: its prompt becomes the session's history plus the tokens it appends."""
        s = self.table.get(req.session_id)
        if not s.idle:
            raise SessionError(f"session {s.sid!r} is running a turn ({s.busy_rid!r}); one turn at a time")
        history = s.token_ids
        total = len(history) + len(req.prompt_ids)
        limit = self.max_req_len()
        if total >= limit:
            raise SessionError(f"session {s.sid!r}: its {len(history)} tokens plus this turn's {len(req.prompt_ids)} "
                               f"reach the context limit ({limit} tokens): the episode is over")
        if total + req.params.max_new_tokens > limit:  # the turn ends with finish_reason "length" at the limit
            req.params = dataclasses.replace(req.params, max_new_tokens=limit - total)
        req.prompt_ids = history + req.prompt_ids
        seq = req.seqs[0]
        seq.token_ids = list(req.prompt_ids)
        seq.num_prompt_tokens = len(req.prompt_ids)
        req.logprob_start_len = req.next_input_logprob_pos = len(req.prompt_ids)  # no prompt logprobs in a turn
        req.input_logprobs, req.input_top_logprobs, req.input_ranks = [], [], []
        s.busy_rid = req.rid
        s.last_used = time.monotonic()

    def adopt(self, seq: Sequence, limit: int) -> bool:
        """Hand the session's KV to its turn if it was computed under the weights (and salt) the turn
        runs with; otherwise drop it (the history is recomputed). True if adopted."""
        s = self.table.sessions.get(seq.req.session_id)
        if s is None or not s.block_table:
            return False
        if s.cache_key != seq.kv_key:  # computed under other weights: never reused
            self.drop_kv(s)
            return False
        n = min(s.num_computed, limit)
        keep = self.block_manager.blocks_for(n)
        self.block_manager.free(s.block_table[keep:])
        seq.block_table, seq.num_computed_tokens = s.block_table[:keep], n
        seq.num_cached_tokens = n
        s.block_table, s.num_computed, s.cache_key = [], 0, None
        self.block_manager.stats.num_queries += len(seq.token_ids)
        self.block_manager.stats.num_hit_tokens += n
        return True

    def end_turn(self, seq: Sequence) -> None:
        """A turn ended: a normal end appends its tokens to the history and leaves its KV with the
        session (if computed under the current weights throughout); an abort or error keeps the
        history as it was, without KV."""
        req = seq.req
        s = self.table.sessions.get(req.session_id)
        if s is None or s.busy_rid != req.rid:
            return  # closed while the turn ran: the turn's blocks are freed as any request's
        s.busy_rid, s.last_used = None, time.monotonic()
        if seq.finish_reason not in ("stop", "length") or req.error is not None:
            return
        s.num_turns += 1
        s.token_ids = list(seq.token_ids)
        if seq.kv_key != self.cache_key(req) or not seq.block_table:
            return  # the weights changed during the turn: nothing kept; the next turn recomputes
        n = min(seq.num_computed_tokens, len(seq.token_ids))
        keep = self.block_manager.blocks_for(n)
        s.block_table, s.num_computed, s.cache_key = seq.block_table[:keep], n, seq.kv_key
        seq.block_table = seq.block_table[keep:]  # the rest is freed with the sequence

    def release_one(self) -> bool:
        """Free the KV of one session that holds some — idle ones first, least recently used first — (its
        history stays; its next turn recomputes it)."""
        holding = self.table.holding_kv()
        if not holding:
            return False
        self.drop_kv(holding[0])
        return True

    def expire(self) -> None:
        """Close the sessions idle past their timeout (looked at once a second at most)."""
        now = time.monotonic()
        if now - self._checked < 1.0:
            return
        self._checked = now
        for s in self.table.expired(now):
            self.close(s.sid)
