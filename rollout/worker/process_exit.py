"""Ending a process of ours once its work is done, without the interpreter's teardown."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import NoReturn


def exit_process(code: int = 0) -> NoReturn:
    """Exit with ``code`` as a normal exit would — the ``atexit`` handlers run (``multiprocessing``'s among them:
    children joined or stopped), logging is shut down, the standard streams flushed — but skip the interpreter's
    teardown of every module, which with torch, ``torch._dynamo`` and ``transformers`` loaded takes 0.3-0.8 s of
    one core freeing objects the OS takes back at once anyway (a server's restart, a TP rank's stop, a benchmark's
    subprocess each paid it). Where a thread other than a daemon is still running, a normal ``sys.exit`` instead
    (it waits for that thread, as Python would)."""
    main = threading.main_thread()
    if threading.current_thread() is not main or any(
            t is not main and not t.daemon and t.is_alive() for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):  # closed or gone: nothing left to flush
                stream.flush()
    os._exit(code)
