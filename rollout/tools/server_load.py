"""A load driver for the rollout server: many concurrent ``/generate`` requests from one asyncio
client (loopback only, bounded in count and time), optionally while a trainer-like thread refreshes
the weights every few seconds; the same workload through the in-process engine for comparison.
Used by ``rollout bench server-load`` and the server's load test."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from typing import Optional

import httpx


def summarize(latencies: list[float], tokens: int, wall_s: float) -> dict:
    lat = sorted(latencies)
    pick = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]) if lat else (lambda q: None)
    return {"requests": len(lat), "wall_s": wall_s, "requests_per_s": len(lat) / wall_s if wall_s else 0.0,
            "tokens_per_s": tokens / wall_s if wall_s else 0.0, "p50_s": pick(0.5), "p99_s": pick(0.99),
            "mean_s": statistics.fmean(lat) if lat else None}


async def _drive(base_url: str, prompts: list[list[int]], sampling: dict, api_key: Optional[str],
                 timeout_s: float, spread_s: float) -> tuple[list[dict], list[float], list[str], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    results: list[Optional[dict]] = [None] * len(prompts)
    latencies: list[float] = []
    errors: list[str] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits, headers=headers) as http:
        async def one(i: int) -> None:
            await asyncio.sleep(spread_s * i / len(prompts))  # arrivals spread out: updates land between them
            t0 = time.perf_counter()
            try:
                r = await http.post("/generate", json={"input_ids": prompts[i], "sampling_params": sampling,
                                                       "return_logprob": True})
            except httpx.HTTPError as exc:
                errors.append(f"request {i}: {type(exc).__name__}: {exc}")
                return
            if r.status_code != 200:
                errors.append(f"request {i}: HTTP {r.status_code}: {r.text[:200]}")
                return
            latencies.append(time.perf_counter() - t0)
            results[i] = r.json()

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        wall = time.perf_counter() - t0
    return results, latencies, errors, wall


def run_server_load(base_url: str, prompts: list[list[int]], sampling: dict, api_key: Optional[str] = None,
                    timeout_s: float = 120.0, refresh=None, refresh_every_s: float = 2.0, spread_s: float = 0.0) -> dict:
    """Send every prompt as its own concurrent request (request i starts ``spread_s * i / n`` in).
    ``refresh(k)`` (if given) runs in a thread every ``refresh_every_s`` while the load lasts (a
    trainer pushing weights). Returns the raw items, the errors, the refresh results and a summary."""
    stop = threading.Event()
    refreshes: list = []

    def refresher():
        k = 0
        while not stop.wait(refresh_every_s):
            k += 1
            refreshes.append(refresh(k))

    thread = threading.Thread(target=refresher, daemon=True) if refresh is not None else None
    if thread is not None:
        thread.start()
    try:
        items, latencies, errors, wall = asyncio.run(_drive(base_url, prompts, sampling, api_key, timeout_s,
                                                            spread_s))
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout_s)
    tokens = sum(len(it["output_ids"]) for it in items if it is not None)
    return {"items": items, "errors": errors, "refreshes": refreshes, "summary": summarize(latencies, tokens, wall)}


def run_in_process_load(engine, prompts: list[list[int]], sampling: dict) -> dict:
    """The same workload through the engine itself: every prompt its own concurrent ``async_generate``."""
    async def drive():
        latencies: list[float] = []

        async def one(p):
            t0 = time.perf_counter()
            outs = await engine.async_generate(input_ids=[p], sampling_params=dict(sampling))
            latencies.append(time.perf_counter() - t0)
            return outs

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(p) for p in prompts))
        return outs, latencies, time.perf_counter() - t0

    outs, latencies, wall = asyncio.run(drive())
    tokens = sum(len(o.output_token_ids) for group in outs for o in group)
    return {"outputs": outs, "summary": summarize(latencies, tokens, wall)}
