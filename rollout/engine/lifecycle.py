"""The RL weight-update lifecycle, owned by one object: ``WeightUpdateLifecycle``.

A multi-call update (a transaction) stages what its calls send; nothing serves from it until it is
published, on every rank or none. Who opened it is an ``Opener`` — the engine's own API, a route family's
start call (SGLang's and miles' ``/begin_weight_update``, vLLM's ``/start_weight_update`` with SkyRL's and
TRL-async's use of it, TRL's ``/update_named_param/``), or a paused engine opening one for the update calls
it receives (slime, AReaL: pause -> buckets -> continue). The states and their legal moves:

- ``IDLE`` -> ``OPEN`` by ``begin`` (a start call), or by an update call while generation is paused;
- ``OPEN`` -> ``OPEN`` by each update call that stages into it: its own opener's calls (and the API's
  ``transaction=True`` calls); a call that fails marks the transaction failed (its publish then fails
  naming that call, and nothing of it is published);
- ``OPEN`` -> ``PUBLISHING`` -> ``IDLE`` by ``commit``: published on every rank or none; either way the
  transaction is gone and, on failure, the old weights keep serving under the old version;
- ``OPEN`` -> ``IDLE`` by ``abort`` (discards what was staged), by an update call of another protocol that
  has no start call of its own (the transaction it finds was left by a client that gave up: aborted and
  logged), or by the idle timeout (``EngineConfig.weight_update_timeout_s``, checked at every lifecycle
  call): the opener's later calls are told it expired instead of applying anything.

What is refused, answered as a failure naming what is open (the server's 400): a second start while one is
open (nothing is aborted: abort it, finish it, or let it time out), a publish by an opener that does not
own the open transaction, a publish with nothing open. A publish never aborts anything it was not asked to;
a continue publishes only what the paused engine opened itself.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Optional

from rollout.outputs import WeightResult
from rollout.worker.messages import AbortTransaction, BeginTransaction

logger = logging.getLogger(__name__)


class Opener(enum.Enum):
    """Who opened a weight-update transaction (its value names it in messages)."""

    PAUSED = "the update calls of a paused engine"  # published by continue_generation
    API = "begin_weight_update()"  # the engine's own API, in process
    SGLANG = "/begin_weight_update"  # SGLang's and miles' bracket (published by /commit_ or /end_weight_update)
    VLLM = "/start_weight_update"  # vLLM's phased API (prime-rl, SkyRL's collective_rpc verbs, TRL async)
    TRL = "TRL's /update_named_param/"  # TRL's vllm-serve protocol, published at /reset_prefix_cache/


class State(enum.Enum):
    IDLE = "idle"
    OPEN = "open"
    PUBLISHING = "publishing"


@dataclass(frozen=True)
class Transaction:
    """The open transaction: who opened it, the version it publishes under (None: the next one), when it
    opened and was last called (``time.monotonic``), how many calls staged into it, its first failure."""

    opener: Opener
    version: Optional[str]
    opened_at: float
    last_call_at: float
    calls: int = 0
    error: Optional[str] = None

    def describe(self, now: float) -> str:
        failed = f"; failed: {self.error}" if self.error else ""
        return (f"the weight update opened by {self.opener.value} {now - self.opened_at:.0f} s ago "
                f"({self.calls} update calls staged{failed})")


class WeightUpdateLifecycle:
    """The one owner of the transaction state. ``run(msg)`` runs a weight message on every rank;
    ``paused()`` says whether generation is paused. Every method holds the lifecycle's lock for its whole
    transition (rank calls included), so in-process callers on several threads see one state at a time."""

    def __init__(self, run: Callable[..., WeightResult], paused: Callable[[], bool], stage_paused_updates: bool,
                 timeout_s: Optional[float], clock: Callable[[], float] = time.monotonic):
        self.run = run
        self.paused = paused
        self.stage_paused_updates = stage_paused_updates
        self.timeout_s = timeout_s
        self.clock = clock
        self.open: Optional[Transaction] = None
        self._publishing = False
        self.expired: Optional[Transaction] = None  # the last transaction the idle timeout aborted
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ reading

    @property
    def state(self) -> State:
        return State.PUBLISHING if self._publishing else State.OPEN if self.open is not None else State.IDLE

    def current(self) -> Optional[Transaction]:
        with self._lock:
            self._expire()
            return self.open

    def opener(self) -> Optional[Opener]:
        current = self.current()
        return None if current is None else current.opener

    def busy_message(self) -> str:
        """What is open, and how to end it (for a refusal)."""
        with self._lock:
            if self.open is None:
                return "no weight update is open"
            timeout = f", or it is aborted after {self.timeout_s:g} s idle" if self.timeout_s else ""
            return (f"{self.open.describe(self.clock())} is still open: finish it with its own publish call or "
                    f"/abort_weight_update it{timeout}")

    # ------------------------------------------------------------------ moves

    def begin(self, by: Opener, version: Optional[str] = None) -> WeightResult:
        """IDLE -> OPEN. Refused while a transaction is open (nothing aborted) or publishing."""
        with self._lock:
            self._expire()
            if self.open is not None:
                return WeightResult.fail(f"cannot start a weight update: {self.busy_message()}")
            result = self.run(BeginTransaction())
            if result.success:
                now = self.clock()
                self.open, self.expired = Transaction(by, version, now, now), None
            return result

    def claim(self, by: Opener) -> bool:
        """Whether an update call of route family ``by`` stages into the open transaction: only into one
        ``by`` opened. One another family opened and left is aborted here (logged); this call's own
        sequence then decides. Raises ``TransactionError`` where ``by``'s own transaction expired."""
        with self._lock:
            self._expire()
            if self.open is None:
                self._refuse_expired(by)
                return False
            if self.open.opener is by:
                return True
            if self.open.opener is not Opener.PAUSED:
                logger.warning("an update call of %s aborts %s, never finished", by.value,
                               self.open.describe(self.clock()))
                self._discard()
            return False

    def stages(self, asked: bool, version: Optional[str] = None) -> bool:
        """Whether an update call stages instead of applying: asked for (``transaction=True``), or the open
        transaction is the paused engine's, or generation is paused (one is opened here, published at
        continue). A plain call while an explicit transaction is open applies (the API's rule: it voids
        what that transaction received into the shadow). The call's version, if any, becomes the
        transaction's."""
        with self._lock:
            self._expire()
            if self.open is None and (asked or (self.stage_paused_updates and self.paused())):
                if not asked:
                    opened = self.begin(Opener.PAUSED)
                    if not opened.success:
                        raise TransactionError(opened.message)
                elif self.expired is not None:
                    self._refuse_expired(self.expired.opener)
            if not asked and (self.open is None or self.open.opener is not Opener.PAUSED):
                return False
            if self.open is not None:
                self.open = replace(self.open, last_call_at=self.clock(), calls=self.open.calls + 1,
                                    version=version if version is not None else self.open.version)
            return True

    def staged(self, result: WeightResult) -> WeightResult:
        """Record a staging call's outcome: its first failure marks the transaction failed."""
        with self._lock:
            if self.open is not None and not result.success and self.open.error is None:
                self.open = replace(self.open, error=result.message)
            return result

    def commit(self, publish: Callable[[Optional[str]], WeightResult], by: Optional[Opener] = None,
               version: Optional[str] = None) -> WeightResult:
        """OPEN -> PUBLISHING -> IDLE: ``publish(version)`` runs the commit on the ranks (under ``version``,
        else the one the transaction's calls named). ``by``: only a transaction that opener owns (None:
        whatever is open). Refused, aborting nothing, with nothing open or another opener's open."""
        with self._lock:
            self._expire()
            if self.open is None:
                if by is not None:
                    self._refuse_expired(by)
                return WeightResult.fail("no weight update to finish: none is open (start one first; one left open "
                                         "is aborted by another protocol's update calls)")
            if by is not None and self.open.opener is not by:
                return WeightResult.fail(f"{by.value} cannot publish {self.open.describe(self.clock())}: "
                                         f"nothing was aborted")
            txn, self._publishing = self.open, True
            try:
                return publish(version if version is not None else txn.version)
            finally:  # published or not, the ranks dropped it
                self.open, self._publishing = None, False

    def abort(self, by: Optional[Opener] = None) -> WeightResult:
        """OPEN -> IDLE, discarding what was staged (``by``: only a transaction that opener owns)."""
        with self._lock:
            if self.open is not None and by is not None and self.open.opener is not by:
                return WeightResult.fail(f"{by.value} cannot abort {self.open.describe(self.clock())}")
            had = self.open
            result = self._discard()
            return result if had is not None else WeightResult.ok("no weight update was open; nothing to abort")

    # ------------------------------------------------------------------ internals

    def _discard(self) -> WeightResult:
        self.open = None
        return self.run(AbortTransaction())

    def _expire(self) -> None:
        """Abort the open transaction if it has been idle past the timeout (a client that went away)."""
        txn = self.open
        if txn is None or not self.timeout_s or self._publishing:
            return
        if self.clock() - txn.last_call_at > self.timeout_s:
            logger.warning("%s was idle past %g s: aborted", txn.describe(self.clock()), self.timeout_s)
            self._discard()
            self.expired = txn

    def _refuse_expired(self, by: Opener) -> None:
        expired = self.expired
        if expired is not None and expired.opener is by:
            self.expired = None  # said once: the opener's next start begins afresh
            raise TransactionError(f"{expired.describe(self.clock())} was idle past {self.timeout_s:g} s and was "
                                   f"aborted; nothing of it was published: start the update again")


class TransactionError(ValueError):
    """A lifecycle call that does not fit the state (the server's 400), nothing changed by it."""
