"""``EngineLoop``: the engine's background thread, the only one that touches the scheduler.

``generate`` and every control call are its clients: they put typed commands on a queue. A
request is added, an abort applied, at the next step boundary; a call (a function) runs there too,
or, when it asks for a quiet point (``quiet=True``: weight updates, memory release), once no
request runs or generation is paused. While a call waits for its quiet point, every later command
but aborts waits behind it (new requests queue behind an update; they never see half of it).

An external-launch follower has no thread: its calls run at once in the caller's thread (the
leader's loop decides when steps run).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from rollout.scheduler.request import Request
from rollout.scheduler.scheduler import Scheduler
from rollout.worker.tp_group import TpWorkerError

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop is not running (shut down, or a fatal error)."""


@dataclass
class _Add:
    req: Request


@dataclass
class _Abort:
    rid: Optional[str]  # None: every request
    prefix: bool = False  # every request whose id starts with rid


@dataclass
class _Call:
    """A function run on the loop thread; ``done`` is set once it ran, failed or was withdrawn."""

    fn: Callable[[], Any]
    quiet: bool
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: Optional[BaseException] = None
    started: bool = False
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def cancel(self) -> bool:
        """Withdraw the call if it has not started: True (it never runs), False (it ran or is running)."""
        with self.lock:
            if self.started:
                return False
            self.cancelled = True
        self.done.set()
        return True

    def outcome(self) -> Any:
        """Its result once done (its error raised)."""
        if self.error is not None:
            raise self.error
        return self.result


@dataclass
class _Stop:
    """Abort what runs, run what waits, end the thread."""


class EngineLoop:
    def __init__(self, scheduler: Scheduler, memory_error: Callable[[], Optional[str]] = lambda: None,
                 start: bool = True):
        self.scheduler = scheduler
        self.memory_error = memory_error  # why no forward can run now (memory released), or None
        self.paused = False  # set and read on the loop thread only
        self.fatal: Optional[BaseException] = None
        self._alive = True
        self._commands: queue.Queue = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        if start:
            self._thread = threading.Thread(target=self._run, name="rollout-engine-loop", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ clients

    def submit(self, req: Request) -> None:
        self._commands.put(_Add(req))

    def abort(self, rid: Optional[str], prefix: bool = False) -> None:
        self._commands.put(_Abort(rid, prefix))

    def call(self, fn: Callable[[], Any], timeout: Optional[float] = None, quiet: bool = False) -> Any:
        """Run ``fn`` on the loop thread at a step boundary (``quiet``: once no request runs, or
        generation is paused) and return its result (or raise its error)."""
        if self._thread is None:  # external-launch follower: no loop of its own
            self.check_alive()
            return fn()
        cmd = self.post(fn, quiet)
        if not cmd.done.wait(timeout):
            raise TimeoutError("the engine loop did not answer in time")
        return cmd.outcome()

    def post(self, fn: Callable[[], Any], quiet: bool = False) -> _Call:
        """Queue ``fn`` as ``call`` does and return at once: the caller waits on ``done`` (an event, set once
        it ran) or withdraws it with ``cancel()`` while it has not started."""
        self.check_alive()
        cmd = _Call(fn, quiet)
        if self._thread is None:
            self._execute(cmd)
        else:
            self._commands.put(cmd)
        return cmd

    def check_alive(self) -> None:
        if self.fatal is not None:
            raise EngineDeadError(f"the engine stopped: {self.fatal}")
        if not self._alive or (self._thread is not None and not self._thread.is_alive()):
            raise EngineDeadError("the engine is shut down; create a new RolloutEngine")

    def stop(self, timeout: float = 30) -> None:
        """Abort what runs, run what waits, and end the thread."""
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout=timeout)
        self._alive = False

    # ------------------------------------------------------------------ the thread

    def _is_quiet(self) -> bool:
        return self.paused or not self.scheduler.has_work()

    def _must_wait(self, cmd, held: deque) -> bool:
        if isinstance(cmd, _Abort):
            return False
        return bool(held) or (isinstance(cmd, _Call) and cmd.quiet and not self._is_quiet())

    def _run(self) -> None:
        sched = self.scheduler
        held: deque = deque()  # a call waiting for a quiet point, and every later command but aborts
        while True:
            try:
                block = self._is_quiet() and not (held and self._is_quiet())
                while True:
                    try:
                        cmd = self._commands.get(block=block)
                    except queue.Empty:
                        break
                    block = False
                    if isinstance(cmd, _Stop):
                        sched.abort(None)
                        for h in held:
                            self._execute(h)
                        sched.close()
                        return
                    if self._must_wait(cmd, held):
                        held.append(cmd)
                    else:
                        self._execute(cmd)
                while held and not (isinstance(held[0], _Call) and held[0].quiet and not self._is_quiet()):
                    self._execute(held.popleft())
                if sched.has_work() and not self.paused:
                    error = self.memory_error()
                    if error is not None:  # e.g. admitted just before a release: never run on freed storage
                        sched.fail_all(RuntimeError(error))
                    else:
                        sched.step()
            except TpWorkerError as exc:  # a rank is gone: fail everything and stop serving
                logger.error("%s", exc)
                self.fatal = exc
                sched.fail_all(exc)
                self._alive = False
                return
            except Exception as exc:  # a failed step fails its requests; the engine keeps serving
                logger.exception("engine step failed")
                sched.fail_all(exc)

    def _execute(self, cmd) -> None:
        if isinstance(cmd, _Add):
            self.scheduler.add_request(cmd.req)
        elif isinstance(cmd, _Abort):
            self.scheduler.abort(cmd.rid, cmd.prefix)
        elif isinstance(cmd, _Call):
            with cmd.lock:
                if cmd.cancelled:  # withdrawn while it waited: it never runs
                    return
                cmd.started = True
            try:
                self.scheduler.drain()
                cmd.result = cmd.fn()
            except BaseException as exc:  # handed to the caller, who re-raises it
                cmd.error = exc
            cmd.done.set()
