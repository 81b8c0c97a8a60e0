"""The engine loop without an engine: the real ``EngineLoop`` and ``Scheduler`` over ``FakeWorker``.
Calls that need a quiet point wait for one, aborts never wait, commands behind a waiting call keep
their order, and a failed step fails its requests while the loop keeps serving."""

from __future__ import annotations

import threading
import time

import pytest
from fakes import FakeWorker

from rollout.config import EngineConfig
from rollout.engine.loop import EngineDeadError, EngineLoop
from rollout.sampling_params import SamplingParams
from rollout.scheduler.request import Request
from rollout.scheduler.scheduler import Scheduler

_rid = iter(range(10**6))


def _loop(step_s: float = 0.002) -> tuple[EngineLoop, FakeWorker]:
    worker = FakeWorker(256, step_s=step_s)
    return EngineLoop(Scheduler(EngineConfig(model_path="unused", block_size=4), worker, eos_ids=(0,))), worker


def _request(max_new_tokens: int) -> Request:
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    k = next(_rid)
    return Request(f"loop-{k}", 0, [1, 2, 3], sp.resolved({}), seed=1, seq_ids=[k], return_logprob=True,
                   top_logprobs_num=0, logprob_start_len=-1)


def test_a_quiet_call_waits_for_running_requests_an_abort_does_not_and_later_calls_keep_their_order():
    loop, worker = _loop()
    req = _request(800)
    loop.submit(req)
    while len(worker.batches) < 3:
        time.sleep(0.001)
    order: list[str] = []
    quiet = threading.Thread(target=lambda: loop.call(lambda: order.append("quiet"), quiet=True))
    quiet.start()
    time.sleep(0.05)
    later = threading.Thread(target=lambda: loop.call(lambda: order.append("later")))  # held behind it
    later.start()
    time.sleep(0.05)
    assert order == [] and not req.done.is_set()  # the request runs; both calls wait
    loop.abort(req.rid)  # never held: it makes the quiet point
    quiet.join(10)
    later.join(10)
    assert order == ["quiet", "later"]
    assert req.seqs[0].finish_reason == "abort" and len(req.seqs[0].output_ids) < 800
    assert loop.call(lambda: loop.scheduler.block_manager.num_free_blocks) == 256
    loop.stop()


def test_a_failed_step_fails_its_requests_and_the_loop_keeps_serving():
    loop, worker = _loop(step_s=0.0)
    worker.fail_steps = 1
    failed = _request(4)
    loop.submit(failed)
    assert failed.done.wait(10) and isinstance(failed.error, RuntimeError)
    ok = _request(4)
    loop.submit(ok)
    assert ok.done.wait(10) and ok.error is None and ok.seqs[0].output_ids == [7, 7, 7, 7]
    loop.check_alive()
    loop.stop()
    with pytest.raises(EngineDeadError):
        loop.check_alive()


def test_a_posted_quiet_call_is_an_event_to_await_and_can_be_withdrawn_until_it_starts():
    """``post``: a call queued without blocking (vLLM's pause?mode=wait waits on its ``done`` event instead of
    polling). Withdrawn while requests still run, it never runs — not even once they finish; one left in place
    runs at the quiet point; withdrawing one that ran says so."""
    loop, worker = _loop()
    req = _request(400)
    loop.submit(req)
    while len(worker.batches) < 3:
        time.sleep(0.001)
    ran: list[str] = []
    withdrawn = loop.post(lambda: ran.append("withdrawn"), quiet=True)
    assert not withdrawn.done.wait(0.05)  # requests run: it waits
    assert withdrawn.cancel() and withdrawn.done.is_set()
    kept = loop.post(lambda: ran.append("kept") or "paused", quiet=True)
    assert kept.done.wait(30) and kept.outcome() == "paused"
    assert req.done.is_set() and ran == ["kept"]  # the withdrawn call never ran
    assert not kept.cancel()  # it ran: nothing to withdraw
    failing = loop.post(lambda: 1 / 0)
    assert failing.done.wait(5)
    with pytest.raises(ZeroDivisionError):
        failing.outcome()
    loop.stop()
