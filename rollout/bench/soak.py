"""Soak: a server under a bounded, mixed, partly hostile load for ``--seconds``, on loopback.

    rollout bench soak --model tiny --seconds 300

What runs at once until the time is up (every loop bounded in count and time, nothing but
127.0.0.1): whole generations, streams read to the end, streams read slowly, streams whose reader
vanishes after one event, whole requests whose client leaves mid-answer, aborts of everything
running, and weight flips from disk between two copies of the weights. Throughout, ``/health`` and
``/abort_request`` are timed. Before and after: greedy outputs (after the last flip back to the
first weights), the server's RSS and open descriptors, once idle. The baseline is taken after a
warm-up of the same load (a fifth of the time, at most 30 s): the process keeps the heap its working
set needed (``rollout.openmp``'s allocator settings), so what the soak must show is no growth past it.
Writes JSON; ``passed`` says whether outputs match, memory and descriptors came back to the baseline
(within ``--rss-slack-mb``) and both timed routes stayed under a second throughout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import tempfile
import threading
import time

ADMIN = "soak-admin"
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


def _post_and_leave(host: str, port: int, body: bytes, after_s: float) -> None:
    """A whole request whose client leaves mid-answer."""
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(after_s)


def _workers(url: str, path_a: str, path_b: str, stop: threading.Event, stats: dict, seed: int):
    import httpx

    host, port = url.removeprefix("http://").split(":")
    admin = {"Authorization": f"Bearer {ADMIN}"}
    rng = random.Random(seed)

    def count(kind: str, ok: bool) -> None:
        stats.setdefault(kind, {"ok": 0, "failed": 0})["ok" if ok else "failed"] += 1

    def gen():
        while not stop.is_set():
            n = rng.randint(1, 4)
            r = httpx.post(f"{url}/generate", timeout=120, json={
                "input_ids": [rng.randrange(3, 200) for _ in range(rng.randint(4, 40))],
                "return_logprob": True, "sampling_params": {"n": n, "max_new_tokens": rng.randint(8, 96)}})
            count("generate", r.status_code == 200)

    def streams():
        while not stop.is_set():
            mode = rng.choice(["read", "slow", "vanish"])
            body = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 200}}
            try:
                with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as s:
                    for i, _ in enumerate(s.iter_lines()):
                        if mode == "vanish":
                            break
                        if mode == "slow" and i % 20 == 0:
                            time.sleep(0.05)
                count(f"stream_{mode}", True)
            except httpx.HTTPError:
                count(f"stream_{mode}", False)

    def leavers():
        while not stop.is_set():
            body = json.dumps({"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 400}}).encode()
            _post_and_leave(host, int(port), body, rng.uniform(0.05, 0.5))
            count("disconnect", True)

    def control():
        k = 0
        while not stop.wait(1.0):
            k += 1
            if k % 3 == 0:
                r = httpx.post(f"{url}/update_weights_from_disk", headers=admin, timeout=120,
                               json={"model_path": path_b if k % 2 else path_a, "weight_version": f"flip-{k}"})
                count("weight_flip", r.status_code == 200 and r.json()["success"])
            t0 = time.monotonic()
            r = httpx.post(f"{url}/abort_request", headers=admin, json={"abort_all": True}, timeout=10)
            stats["abort_s_max"] = max(stats.get("abort_s_max", 0.0), time.monotonic() - t0)
            count("abort_all", r.status_code == 200)

    def health():
        while not stop.wait(0.2):
            t0 = time.monotonic()
            r = httpx.get(f"{url}/health", timeout=10)
            stats["health_s_max"] = max(stats.get("health_s_max", 0.0), time.monotonic() - t0)
            count("health", r.status_code == 200)

    return [gen, gen, streams, leavers, control, health]


def _load(url: str, path_a: str, path_b: str, stats: dict, seed: int, seconds: float, proc) -> int:
    """Every worker for ``seconds``; the server's peak RSS meanwhile."""
    stop = threading.Event()
    threads = [threading.Thread(target=fn, daemon=True) for fn in _workers(url, path_a, path_b, stop, stats, seed)]
    for t in threads:
        t.start()
    peak = proc.memory_info().rss
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(180)
    return peak


def _settled(client, path_a: str, proc) -> dict:
    """Idle, back on the first weights; then the server's RSS and descriptors."""
    deadline = time.monotonic() + 60
    while client.get_server_info()["stats"]["num_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.update_weights_from_disk(path_a, weight_version="default").success
    time.sleep(2)  # closed sockets leave the server's table
    return {"rss": proc.memory_info().rss, "fds": proc.num_fds()}


def run(model: str = "tiny", seconds: float = 300.0, workdir: str = tempfile.gettempdir(), rss_slack_mb: float = 64.0,
        seed: int = 0) -> dict:
    import psutil

    from rollout.bench.common import build_model, machine
    from rollout.server import launch_server

    path_a = build_model(model, workdir)
    folder = tempfile.mkdtemp(prefix="rollout-soak-")
    path_b = os.path.join(folder, "b")
    shutil.copytree(path_a, path_b)
    path_a = shutil.copytree(path_a, os.path.join(folder, "a"))
    prompts = [[5, 6, 7], [11, 12, 13, 14], [20] * 9]
    result: dict = {"benchmark": "soak", "machine": machine(), "config": {"model": model, "seconds": seconds}}
    with launch_server(path_a, "--dtype", "float32", "--admin-api-key", ADMIN, "--allowed-weight-dirs", folder,
                       "--kv-cache-tokens", "16384", "--stream-stall-timeout-s", "5") as server:
        client = server.client(admin_api_key=ADMIN)
        proc = psutil.Process(server.proc.pid)
        before = [o.output_token_ids for o in client.generate(input_ids=prompts, sampling_params=GREEDY)]
        stats: dict = {}
        _load(server.url, path_a, path_b, stats, seed + 1, min(30.0, seconds / 5), proc)  # warm-up
        baseline = _settled(client, path_a, proc)
        stats = {}
        peak = _load(server.url, path_a, path_b, stats, seed, seconds, proc)
        final = _settled(client, path_a, proc)
        after = [o.output_token_ids for o in client.generate(input_ids=prompts, sampling_params=GREEDY)]
        client.close()
    shutil.rmtree(folder, ignore_errors=True)
    result.update(counts={k: v for k, v in stats.items() if isinstance(v, dict)},
                  health_s_max=stats.get("health_s_max"), abort_s_max=stats.get("abort_s_max"),
                  rss_mb={"baseline": baseline["rss"] / 2**20, "peak": peak / 2**20, "after": final["rss"] / 2**20},
                  fds={"baseline": baseline["fds"], "after": final["fds"]}, same_greedy_outputs=before == after)
    result["passed"] = bool(before == after and final["rss"] - baseline["rss"] < rss_slack_mb * 2**20
                            and final["fds"] <= baseline["fds"] + 2 and (result["health_s_max"] or 0) < 1.0
                            and (result["abort_s_max"] or 0) < 1.0)
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="rollout bench soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--rss-slack-mb", type=float, default=64.0)
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--workdir", default=tempfile.gettempdir())
    args = ap.parse_args(argv)
    result = run(args.model, args.seconds, args.workdir, args.rss_slack_mb)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"soak_{os.path.basename(args.model)}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    return result
