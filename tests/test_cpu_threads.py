"""Forwards on all threads alone, on one while another process computes on the same cores
(``rollout.executor.cpu_threads``): the policy on given readings, then a real engine beside a real
busy process."""

import os
import threading
import time

import pytest
import torch

from rollout import SamplingParams
from rollout.executor.cpu_threads import ThreadGovernor, process_run_times


class _Cores:
    """Readings as the kernel would give them: runnable time split into on-core and waiting."""

    def __init__(self):
        self.now = 0.0
        self.on_cpu = self.waiting = 0.0
        self.threads: list[int] = []

    def run(self, seconds: float, waiting_share: float):
        self.now += seconds
        self.on_cpu += seconds * (1 - waiting_share)
        self.waiting += seconds * waiting_share

    def governor(self, **kw):
        return ThreadGovernor(2, read=lambda: (self.on_cpu, self.waiting), clock=lambda: self.now,
                              set_threads=self.threads.append, get_threads=self.count, **kw)

    def count(self) -> int:  # what torch would say: the last count set, else the process's 2
        return self.threads[-1] if self.threads else 2


def test_the_policy_drops_to_one_thread_holds_and_backs_off_while_the_cores_stay_shared():
    cores = _Cores()
    gov = cores.governor(window_s=0.25, hold_s=1.0, max_hold_s=4.0)
    for _ in range(5):  # alone: a little waiting (a wake-up now and then) never drops
        cores.run(0.3, 0.02)
        gov.before_forward()
    assert gov.current == 2 and cores.threads == []
    cores.run(0.1, 0.9)  # less than a window of runnable time: nothing decided yet
    gov.before_forward()
    assert gov.current == 2
    cores.run(0.3, 0.4)  # a neighbour computes: the first whole window above the bound drops
    gov.before_forward()
    assert gov.current == 1 and cores.threads == [1] and gov.num_drops == 1
    cores.run(0.5, 0.0)  # within the hold nothing is read or decided, however quiet it looks
    gov.before_forward()
    assert gov.current == 1
    cores.run(0.6, 0.0)  # after the hold, quiet: all threads again
    gov.before_forward()
    assert gov.current == 2 and cores.threads == [1, 2]
    holds = []
    for _ in range(4):  # the neighbour is still there: each quick return doubles the hold, up to the cap
        cores.run(0.4, 0.4)
        gov.before_forward()
        assert gov.current == 1
        holds.append(gov.hold_s)
        cores.run(gov.hold_s + 0.01, 0.0)
        gov.before_forward()
        assert gov.current == 2
    assert holds == [2.0, 4.0, 4.0, 4.0]
    cores.run(30.0, 0.0)  # a long quiet spell: the next neighbour starts from the first hold again
    gov.before_forward()
    cores.run(0.4, 0.5)
    gov.before_forward()
    assert gov.current == 1 and gov.hold_s == 1.0 and gov.num_drops == 6
    assert gov.stats() == {"cpu_threads": 1, "cpu_thread_drops": 6, "cpu_waiting_share": 0.5}


def test_one_thread_or_no_run_delay_reported_leaves_the_thread_count_alone():
    cores = _Cores()
    single = ThreadGovernor(1, read=lambda: (cores.on_cpu, cores.waiting), clock=lambda: cores.now,
                            set_threads=cores.threads.append, get_threads=cores.count)
    blind = ThreadGovernor(2, read=lambda: None, clock=lambda: cores.now, set_threads=cores.threads.append,
                           get_threads=cores.count)
    for _ in range(5):
        cores.run(1.0, 0.9)
        single.before_forward()
        blind.before_forward()
    assert not single.enabled and not blind.enabled and cores.threads == []


def test_this_process_run_times_come_from_the_kernel():
    times = process_run_times()
    if times is None:
        pytest.skip("needs a Linux kernel with schedstat (/proc/self/task/*/schedstat)")
    start = time.process_time()
    while time.process_time() - start < 0.05:  # this thread on a core for 50 ms
        sum(range(1000))
    later = process_run_times()
    assert later[0] - times[0] >= 0.04 and later[1] >= times[1] >= 0


def test_run_times_keep_the_time_of_threads_that_have_ended():
    """The kernel forgets a thread's run times when it ends; the process's sums must not fall."""
    if process_run_times() is None:
        pytest.skip("needs a Linux kernel with schedstat (/proc/self/task/*/schedstat)")
    burned, done = threading.Event(), threading.Event()

    def burn():
        start = time.thread_time()
        while time.thread_time() - start < 0.05:
            sum(range(1000))
        burned.set()
        done.wait(10)

    worker = threading.Thread(target=burn)
    worker.start()
    assert burned.wait(10)
    during = process_run_times()
    done.set()
    worker.join(10)
    after = process_run_times()
    assert after[0] >= during[0] and after[1] >= during[1]


def test_an_engine_beside_a_busy_process_computes_on_one_thread_and_returns_when_it_stops(make_engine, llama_path):
    """A real neighbour (``rollout bench limits --busy-neighbour``'s: matmuls on two threads of its
    own) on this machine's cores: the engine's forwards drop to one thread while it computes, and go
    back to all of them once it has stopped; tokens are the same on either count."""
    from rollout.bench.limits import busy_neighbour

    cores = len(os.sched_getaffinity(0))
    if cores != 2 or torch.get_num_threads() != 2:
        pytest.skip(f"needs 2 cores and 2 torch threads (this machine's kind; here {cores} cores, "
                    f"{torch.get_num_threads()} threads), so a 2-thread neighbour shares every core")
    engine = make_engine(llama_path, dtype="float32", kv_cache_tokens=4096, max_num_seqs=16, kernel_adapt_threads=True)
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, n=8)
    prompts = [[5 + i, 9, 13, 2 + i] for i in range(2)]
    alone = engine.generate(input_ids=prompts, sampling_params=sp)
    assert engine.get_stats()["cpu_threads"] == 2
    neighbour = busy_neighbour(2)
    try:
        for _ in range(200):  # a window of runnable time is 0.3 s: a few generate calls decide
            beside = engine.generate(input_ids=prompts, sampling_params=sp)
            if engine.get_stats()["cpu_thread_drops"] >= 1:
                break
        stats = engine.get_stats()
        assert stats["cpu_thread_drops"] >= 1 and stats["cpu_threads"] == 1, stats
        # the window that dropped waited more than 0.15 of its runnable time; a later window of the same call may be
        # the last one read, and while forwards stay on one thread it waited at least the return threshold (0.05)
        assert stats["cpu_waiting_share"] >= 0.05, stats
        assert [o.output_token_ids for o in beside] == [o.output_token_ids for o in alone]
    finally:
        neighbour.terminate()
        neighbour.wait(30)
    deadline = time.monotonic() + 120  # the hold (1-30 s) and a quiet window, however slow this machine
    while engine.get_stats()["cpu_threads"] != 2 and time.monotonic() < deadline:
        engine.generate(input_ids=prompts, sampling_params=sp)
    assert engine.get_stats()["cpu_threads"] == 2, engine.get_stats()
    again = engine.generate(input_ids=prompts, sampling_params=sp)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in alone]


def test_the_governor_is_on_by_default_for_bf16_engines_only_outside_the_batch_invariant_mode(make_engine, llama_path):
    """``kernels.adapt_threads=None`` (the default): a bf16 engine's forwards follow the governor (its tokens and
    logprobs are the same bits on one thread as on two); an fp32 engine's (logprobs move in their last
    bits with the thread count) and the batch-invariant mode's do not; an explicit value decides for either."""
    def governed(**kw) -> bool:
        engine = make_engine(llama_path, kv_cache_tokens=1024, **kw)
        return "cpu_threads" in engine.get_stats()

    assert governed(dtype="bfloat16")
    assert not governed(dtype="float32")
    assert not governed(dtype="bfloat16", deterministic=True)
    assert governed(dtype="float32", kernel_adapt_threads=True)
    assert not governed(dtype="bfloat16", kernel_adapt_threads=False)
