"""The field's router in front of ``rollout serve`` replicas: ``sglang-router`` or SMG (PyPI ``smg``),
both the same Rust gateway, started as a child process on a loopback port (the test extra installs
both; ``pip install sglang-router`` or ``pip install smg`` elsewhere). We never route ourselves here.
Every port the router opens is on loopback: its HTTP port and its Prometheus metrics (``metrics_url``;
the routers' own default is every interface, port 29000).

    router = launch_router([a.url, b.url], kind="sglang-router", api_key="KEY")
    httpx.post(router.url + "/generate", json=...)   # SGLang's routes, cache-aware by default
    router.stop()

Both packages install a console script named ``smg``; the router is run from its Python module
(``sglang_router.cli`` / ``smg.cli``), so either works whichever script won.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import IO, Optional

import httpx

MODULES = {"sglang-router": "sglang_router.cli", "smg": "smg.cli"}


def router_available(kind: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(MODULES[kind].split(".")[0]) is not None


class RouterProcess:
    def __init__(self, worker_urls: list[str], kind: str = "sglang-router", port: Optional[int] = None,
                 api_key: Optional[str] = None, policy: str = "cache_aware", log_path: Optional[str] = None,
                 extra_args: tuple[str, ...] = (), metrics_port: Optional[int] = None):
        from weight_sync.process_group import free_port

        if kind not in MODULES:
            raise ValueError(f"kind={kind!r}: use one of {sorted(MODULES)}")
        self.kind = kind
        self.port = port if port is not None else free_port()
        # the routers' Prometheus endpoint listens on 0.0.0.0:29000 by default, unauthenticated: here on
        # loopback, on a port of its own (two routers on one host must not collide)
        self.metrics_port = metrics_port if metrics_port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.api_key = api_key
        cmd = [sys.executable, "-c", f"import sys; from {MODULES[kind]} import main; sys.exit(main())", "launch",
               "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *worker_urls, "--policy", policy,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
               "--log-level", "warn", *(("--api-key", api_key) if api_key else ()),
               # SMG drains for 5 s after SIGTERM by default: a router in front of rollout replicas has nothing
               # of its own to finish (a stopped run's requests are over), so it takes one
               *(("--shutdown-grace-period-secs", "1") if kind == "smg" else ()), *extra_args]
        self._log: Optional[IO[str]] = open(log_path or "/dev/null", "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, text=True)

    def healthy_workers(self) -> int:
        """How many healthy workers the router lists (0 while it does not answer yet)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            listed = httpx.get(self.url + "/workers", headers=headers, timeout=2).json().get("workers", [])
        except (httpx.HTTPError, ValueError):
            return 0
        return sum(1 for w in listed if w.get("is_healthy", True))

    def wait_ready(self, workers: int, timeout_s: float = 60.0) -> RouterProcess:
        """Until the router answers and lists ``workers`` healthy workers."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"{self.kind} exited with code {code} before it was ready")
            if self.healthy_workers() >= workers:
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{self.kind} did not list {workers} healthy workers within {timeout_s}s")

    def stop(self, timeout_s: float = 10.0) -> None:
        from rollout.server.launch import stop_child

        stop_child(self.proc, timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_router(worker_urls: list[str], kind: str = "sglang-router", ready_timeout_s: float = 60.0,
                  **kw) -> RouterProcess:
    router = RouterProcess(worker_urls, kind, **kw)
    try:
        return router.wait_ready(len(worker_urls), ready_timeout_s)
    except BaseException:
        router.stop()
        raise
