"""``rollout serve`` in a child process: started on a free loopback port, waited for, stopped.

What the examples, the benchmarks and the tests each did by hand (a ``Popen`` of the CLI, a poll of
``/health``, terminate-then-kill), done once. ``ServerProcess`` owns the child; ``wait_ready``
fails at once, with the tail of the server's log, when the child exits instead of answering (a
bad flag, a model folder that does not load), rather than polling until its timeout.

    with launch_server(path, "--dtype", "float32", num_threads=1) as server:
        client = server.client()
        client.generate(input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 4})

The child's OpenMP and allocator settings come from ``rollout.openmp.child_env`` (bounded spin;
``num_threads`` sets ``OMP_NUM_THREADS`` where cores are shared).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Mapping
from typing import IO, Optional

from rollout.server.client import RolloutClient


class ServerProcess:
    """One ``rollout serve`` child on ``host:port`` (a free loopback port unless given)."""

    def __init__(self, model_path: str, *args: str, port: Optional[int] = None, host: str = "127.0.0.1",
                 num_threads: Optional[int] = None, env: Optional[Mapping[str, str]] = None,
                 log_path: Optional[str] = None, log_level: str = "WARNING"):
        from rollout.openmp import child_env
        from weight_sync.process_group import free_port

        self.port = port if port is not None else free_port()
        self.host = host
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "rollout.cli", "--log-level", log_level, "serve", "--model-path", model_path,
               "--host", host, "--port", str(self.port), *args]
        self._log: Optional[IO[str]] = open(log_path, "w") if log_path else None  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, env=child_env(num_threads, env), stdout=self._log,
                                     stderr=subprocess.STDOUT if self._log else None, text=True)

    def client(self, **kw) -> RolloutClient:
        """A new client of this server (``api_key``, ``admin_api_key``, ``timeout_s`` as RolloutClient's)."""
        return RolloutClient(self.url, **kw)

    def log_tail(self, chars: int = 4000) -> str:
        if not self.log_path:
            return "(the server's output went to this process's terminal)"
        if self._log is not None:
            self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def wait_ready(self, timeout_s: float = 120.0) -> ServerProcess:
        """Return once ``/health`` answers 200; raise if the child exits or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        with RolloutClient(self.url, timeout_s=5.0) as probe:
            while not probe.health():
                code = self.proc.poll()
                if code is not None:
                    raise RuntimeError(f"rollout serve exited with code {code} before it answered at {self.url}:\n"
                                       f"{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rollout serve did not answer at {self.url} within {timeout_s:.0f} s:\n"
                                       f"{self.log_tail()}")
                time.sleep(0.2)
        return self

    def kill(self) -> None:
        """End the child at once (SIGKILL), as a crash would."""
        self.proc.kill()
        self.proc.wait(30)

    def stop(self, timeout_s: float = 30.0) -> Optional[int]:
        """Terminate the child (SIGTERM: the server shuts its engine down), killing it after ``timeout_s``."""
        stop_child(self.proc, timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_child(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if the child has not exited within ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)


def launch_server(model_path: str, *args: str, ready_timeout_s: Optional[float] = 120.0, **kw) -> ServerProcess:
    """Start ``rollout serve --model-path model_path *args`` (``kw`` as ``ServerProcess``'s) and wait
    until it answers (``ready_timeout_s=None``: return at once; call ``wait_ready`` later). A child
    that fails to come up is stopped before the error is raised."""
    server = ServerProcess(model_path, *args, **kw)
    if ready_timeout_s is not None:
        try:
            server.wait_ready(ready_timeout_s)
        except BaseException:
            server.stop()
            raise
    return server

