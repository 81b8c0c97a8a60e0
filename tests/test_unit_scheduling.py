"""Block accounting and scheduling without an engine: a fake worker stands in for the model (it
returns a fixed next token per row); everything else is the real scheduler and block manager."""

from __future__ import annotations

import pytest
from fakes import FakeWorker

from rollout.config import EngineConfig
from rollout.sampling_params import SamplingParams
from rollout.scheduler.block_manager import BlockManager
from rollout.scheduler.request import Request, SeqStatus
from rollout.scheduler.scheduler import Scheduler

# ---------------------------------------------------------------------------------------------
# block manager


def test_allocate_share_free_keep_reference_counts():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = bm.allocate(2)
    assert bm.num_free_blocks == 2 and all(bm.ref_counts[b] == 1 for b in a)
    bm.share(a)
    assert [bm.ref_counts[b] for b in a] == [2, 2]
    bm.free(a)
    assert bm.num_free_blocks == 2  # still held by the sharer
    bm.free(a)
    assert bm.num_free_blocks == 4
    assert bm.allocate(5) is None  # more than exist: nothing is taken
    assert bm.num_free_blocks == 4
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(a)


def test_prefix_hits_only_under_the_same_weight_version():
    bm = BlockManager(num_blocks=8, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    blocks = bm.allocate(3)
    for b, h in zip(blocks, bm.block_hashes(tokens, 2, "v1#0")):
        bm.register(b, h)
    assert bm.match_prefix(tokens, 4, "v1#0") == blocks[:2]
    assert bm.stats.num_hit_tokens == 4
    assert bm.match_prefix(tokens, 4, "v2#1") == []  # other weights: never matched
    assert bm.match_prefix([1, 2, 9, 9], 4, "v1#0") == blocks[:1]  # the shared first block only
    assert bm.match_prefix(tokens, 1, "v1#0") == []  # max_tokens caps the match below a block


def test_cached_blocks_are_evicted_least_recently_freed_first_and_flush_forgets():
    bm = BlockManager(num_blocks=3, block_size=1)
    blocks = bm.allocate(3)
    hashes = bm.block_hashes([10, 11, 12], 3, "v")
    for b, h in zip(blocks, hashes):
        bm.register(b, h)
    bm.free(blocks)  # tail first: blocks[2] is the first to be evicted
    assert bm.num_free_blocks == 3 and len(bm.cached) == 3
    taken = bm.allocate(1)
    assert taken == [blocks[2]] and hashes[2] not in bm.cached and hashes[0] in bm.cached
    bm.flush()
    assert bm.cached == {} and bm.num_free_blocks == 2
    assert bm.match_prefix([10, 11], 2, "v") == []


def test_disabled_prefix_cache_never_registers():
    bm = BlockManager(num_blocks=2, block_size=1, enable_prefix_caching=False)
    b = bm.allocate(1)
    bm.register(b[0], 123)
    assert bm.cached == {} and bm.match_prefix([5], 1, "v") == []


# ---------------------------------------------------------------------------------------------
# scheduler with a fake worker


def make(num_blocks=64, block_size=4, **kw):
    cfg = EngineConfig(model_path="unused", block_size=block_size, **kw)
    worker = FakeWorker(num_blocks)
    return Scheduler(cfg, worker, eos_ids=(0,)), worker


_rid = iter(range(10**6))


def request(prompt, n=1, max_new_tokens=3, **kw) -> Request:
    sp = SamplingParams(n=n, max_new_tokens=max_new_tokens, temperature=0, **kw)
    k = next(_rid)
    return Request(f"r{k}", 0, list(prompt), sp.resolved({}), seed=1, seq_ids=[1000 * k + i for i in range(n)],
                   return_logprob=True, top_logprobs_num=0, logprob_start_len=-1)


def run(sched, limit=100):
    for _ in range(limit):
        if not sched.has_work():
            return
        sched.step()
    raise AssertionError("scheduler did not finish")


def test_token_budget_chunks_long_prompts():
    sched, worker = make(max_num_batched_tokens=8)
    req = request(range(1, 21), max_new_tokens=2)
    sched.add_request(req)
    run(sched)
    assert [len(b.input_ids) for b in worker.batches] == [8, 8, 4, 1]  # 20-token prompt in chunks, then decode
    assert all(len(b.input_ids) <= 8 for b in worker.batches)
    assert req.seqs[0].output_ids == [7, 7] and req.seqs[0].finish_reason == "length"
    assert sched.block_manager.num_free_blocks == 64  # everything freed (prefix blocks stay matchable)


def test_max_num_seqs_caps_a_batch():
    sched, worker = make(max_num_seqs=2)
    reqs = [request([i + 1, i + 2]) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    run(sched)
    assert max(len(b.ctx_lens) for b in worker.batches) == 2
    assert all(r.seqs[0].finish_reason == "length" for r in reqs)


def test_n_samples_fork_off_one_prefill():
    sched, worker = make(block_size=4)
    req = request(range(1, 7), n=3, max_new_tokens=1)  # 6 tokens: one full block and a partial one
    sched.add_request(req)
    sched.step()
    first = worker.batches[0]
    assert len(first.input_ids) == 6  # the prompt ran once
    assert len(first.sample_logits_idx) == 3 and len(set(first.sample_logits_idx)) == 1  # one logits row, 3 draws
    assert len(first.block_copies) == 2  # each follower copies the partial block
    assert sched.stats.num_forked_samples == 2 and sched.stats.num_shared_prefill_tokens == 12
    assert all(s.finish_reason == "length" for s in req.seqs)
    assert sched.block_manager.num_free_blocks == 64


def test_every_sample_counts_against_max_num_seqs_followers_wait_their_turn():
    """n samples past ``max_num_seqs``: as many fork off the prefill as fit, the others wait at the front of the
    queue (ahead of later requests) and run as sequences finish — never more sequences in a step than the
    limit; every sample finishes, sharing the prompt's cached blocks."""
    sched, worker = make(max_num_seqs=4, block_size=4)
    req = request(range(1, 9), n=8, max_new_tokens=3)  # 8 tokens: two full blocks
    later = request([20, 21, 22], max_new_tokens=2)
    sched.add_request(req)
    sched.step()  # the prompt's prefill: the leader and as many forks as fit
    sched.add_request(later)
    most = len(sched.running)
    for _ in range(200):
        if not sched.has_work():
            break
        sched.step()
        most = max(most, len(sched.running))
        assert len(worker.batches[-1].ctx_lens) <= 4
    assert most == 4 and sched.stats.num_forked_samples == 3  # the leader and three forks filled the limit
    assert all(s.finish_reason == "length" and s.output_ids == [7, 7, 7] for s in req.seqs)
    assert later.seqs[0].finish_reason == "length"
    assert later.seqs[0].first_token_time > max(s.first_token_time for s in req.seqs)  # the followers went first
    assert req.done.is_set() and sched.block_manager.num_free_blocks == 64


def test_preemption_when_blocks_run_out_then_recompute():
    sched, worker = make(num_blocks=6, block_size=2, enable_prefix_caching=False, decode_reserve_ratio=0)
    reqs = [request([1, 2, 3], max_new_tokens=4), request([4, 5, 6], max_new_tokens=4),
            request([7, 8, 9], max_new_tokens=4)]
    for r in reqs:
        sched.add_request(r)
    run(sched)
    assert sched.stats.num_preemptions >= 1
    assert reqs[0].seqs[0].num_preemptions == 0  # the oldest keeps running: the newest are the victims
    assert reqs[2].seqs[0].num_preemptions >= 1
    assert all(r.seqs[0].output_ids == [7, 7, 7, 7] for r in reqs)
    assert sched.block_manager.num_free_blocks == 6


def test_stop_checks_eos_stop_ids_min_tokens_and_ignore_eos():
    sched, worker = make()
    worker.next_token = 0  # the EOS id
    eos = request([1, 2], max_new_tokens=5)
    min_tokens = request([1, 2], max_new_tokens=5, min_new_tokens=3)
    ignore = request([1, 2], max_new_tokens=4, ignore_eos=True)
    for r in (eos, min_tokens, ignore):
        sched.add_request(r)
    run(sched)
    assert eos.seqs[0].output_ids == [0] and eos.seqs[0].finish_reason == "stop"
    assert len(min_tokens.seqs[0].output_ids) == 3 and min_tokens.seqs[0].finish_reason == "stop"
    assert len(ignore.seqs[0].output_ids) == 4 and ignore.seqs[0].finish_reason == "length"
    sched2, worker2 = make()
    worker2.next_token = 9
    stop = request([1, 2], max_new_tokens=5, stop_token_ids=[9])
    sched2.add_request(stop)
    run(sched2)
    assert stop.seqs[0].output_ids == [9] and stop.seqs[0].matched_stop == 9


def test_abort_finishes_running_and_waiting_and_frees_blocks():
    sched, worker = make(max_num_seqs=1)
    a, b = request([1, 2], max_new_tokens=50), request([3, 4], max_new_tokens=50)
    sched.add_request(a)
    sched.add_request(b)
    sched.step()
    assert sched.abort(None) == 2
    assert a.seqs[0].finish_reason == b.seqs[0].finish_reason == "abort"
    assert a.done.is_set() and b.done.is_set() and not sched.has_work()
    assert sched.block_manager.num_free_blocks == 64


def test_publish_weights_rekeys_the_prefix_cache_and_stamps_new_tokens():
    sched, worker = make(block_size=2)
    first = request([1, 2, 3, 4, 5], max_new_tokens=1)
    sched.add_request(first)
    run(sched)
    again = request([1, 2, 3, 4, 5], max_new_tokens=1)
    sched.add_request(again)
    run(sched)
    assert again.seqs[0].num_cached_tokens == 4  # same weights: the prompt's full blocks are reused
    sched.publish_weights("v2", flush_cache=False)
    after = request([1, 2, 3, 4, 5], max_new_tokens=1)
    sched.add_request(after)
    run(sched)
    assert after.seqs[0].num_cached_tokens == 0  # KV from the old weights is never matched
    assert after.seqs[0].output_versions == ["v2"] and first.seqs[0].output_versions == ["default"]
    again = request([1, 2, 3, 4, 5], max_new_tokens=1)
    sched.add_request(again)
    run(sched)
    assert again.seqs[0].num_cached_tokens == 4
    sched.publish_weights(None, flush_cache=False)  # new weights under the same version name
    same_name = request([1, 2, 3, 4, 5], max_new_tokens=1)
    sched.add_request(same_name)
    run(sched)
    assert same_name.seqs[0].num_cached_tokens == 0 and same_name.seqs[0].output_versions == ["v2"]
    sched.publish_weights(None, flush_cache=True)
    assert sched.weight_version == "v2" and sched.block_manager.cached == {}


def test_retract_all_sends_running_sequences_back_with_their_kv_dropped():
    sched, worker = make()
    req = request([1, 2, 3], max_new_tokens=10)
    sched.add_request(req)
    sched.step()
    sched.retract_all()
    seq = req.seqs[0]
    assert seq.status == SeqStatus.WAITING and seq.block_table == [] and seq.num_computed_tokens == 0
    run(sched)
    assert seq.output_ids == [7] * 10


# ---------------------------------------------------------------------------------------------
# sessions: the scheduler's SessionKv collaborator


def _turn(sched, session: str, prompt, max_new_tokens=3) -> Request:
    req = request(prompt, max_new_tokens=max_new_tokens)
    req.session_id = session
    sched.add_request(req)
    run(sched)
    return req


def test_a_session_keeps_its_history_and_kv_between_turns_and_gives_the_kv_up_as_told():
    from rollout.scheduler.sessions import SessionError

    sched, _ = make(num_blocks=16, block_size=4)
    sessions, bm = sched.sessions, sched.block_manager
    sid = sessions.open("s1")
    _turn(sched, sid, [1, 2, 3, 4, 5])
    s = sessions.table.get(sid)
    assert s.token_ids == [1, 2, 3, 4, 5, 7, 7, 7] and s.num_turns == 1 and s.block_table  # KV held for the history
    second = _turn(sched, sid, [9, 9])
    assert second.prompt_ids == [1, 2, 3, 4, 5, 7, 7, 7, 9, 9]
    assert second.seqs[0].num_cached_tokens >= 7  # adopted: only what the turn appends is prefilled
    sched.publish_weights("v2")  # new weights: the history's KV is never reused
    third = _turn(sched, sid, [8])
    assert third.seqs[0].num_cached_tokens == 0 and sessions.info(sid)["num_turns"] == 3
    # memory pressure: an idle session's KV goes (history kept), then there is none left to give
    assert sessions.release_one() and not s.block_table and len(s.token_ids) == 17
    assert not sessions.release_one()
    # a session idle past its timeout is closed at the next look
    quiet = sessions.open("s2", timeout_s=5)
    sessions.table.get(quiet).last_used -= 10
    sessions._checked -= 2
    sessions.expire()
    with pytest.raises(SessionError, match="no open session"):
        sessions.info(quiet)
    # a turn too long for the context ends the episode (refused, the history as it was)
    long = request([1] * 1000)
    long.session_id = sid
    with pytest.raises(SessionError, match="context limit"):
        sessions.begin_turn(long)
    assert sessions.info(sid)["num_tokens"] == 17 and not sessions.info(sid)["busy"]
    _turn(sched, sid, [6])
    assert s.block_table and bm.num_free_blocks < 16
    sessions.close(sid)  # its KV freed with it
    assert bm.num_free_blocks == 16 and not sessions
