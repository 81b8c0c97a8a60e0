"""Tensor parallelism across processes (gloo on CPU): same tokens as TP=1, clear failures, no orphans."""

import os
import signal
import threading
import time

import psutil
import pytest
from helpers import MIN_MARGIN, hf_greedy, random_prompts

from rollout import RolloutEngine, SamplingParams

NEW = 10


def clear_model(model_dir, name, prompts, **spec):
    for seed in range(8):
        path = model_dir(f"{name}-s{seed}", seed=seed, **spec)
        if min(hf_greedy(path, p, NEW)[1] for p in prompts) >= MIN_MARGIN:
            return path
    pytest.fail("no seed with clear greedy margins")


@pytest.mark.parametrize("name, spec", [
    ("odd-vocab-one-kv-head", dict(arch="llama", num_heads=4, num_kv_heads=1, vocab_size=321)),
    ("all-divides", dict(arch="qwen2", num_heads=4, num_kv_heads=2, vocab_size=320)),
])
def test_tp2_matches_tp1(model_dir, name, spec):
    prompts = random_prompts(300, [4, 13, 21], seed=30)
    path = clear_model(model_dir, name, prompts, **spec)
    greedy = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=NEW, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True, n=2)
    runs = []
    for tp in (1, 2):
        with RolloutEngine(path, dtype="float32", kv_cache_tokens=512, tp_size=tp, max_num_batched_tokens=16) as e:
            runs.append((e.generate(input_ids=prompts, sampling_params=greedy),
                         e.generate(input_ids=prompts, sampling_params=sampled, logprob_start_len=0)))
    for tp1, tp2 in zip(runs[0], runs[1]):
        assert [o.output_token_ids for o in tp1] == [o.output_token_ids for o in tp2]
        for a, b in zip(tp1, tp2):
            assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
            assert a.input_logprobs[1:] == pytest.approx(b.input_logprobs[1:], abs=1e-5)


def test_impossible_split_is_refused(model_dir):
    path = model_dir("nine-heads", "llama", hidden_size=72, num_heads=9, num_kv_heads=3, intermediate_size=144)
    with pytest.raises(ValueError, match=r"valid TP sizes: \[1, 3, 9\]"):
        RolloutEngine(path, tp_size=2)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_killed_worker_fails_fast_and_leaves_no_orphans(model_dir):
    path = model_dir("tp-long", "llama", max_position_embeddings=4096)
    engine = RolloutEngine(path, dtype="float32", kv_cache_tokens=4096, tp_size=2, tp_timeout_s=20)
    pids = engine.worker_pids()
    result = {}

    def run():
        try:
            engine.generate(input_ids=[5, 6, 7], sampling_params=SamplingParams(max_new_tokens=3000, temperature=0,
                                                                                 ignore_eos=True))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            result["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    while engine.get_stats()["num_decode_tokens"] < 20:
        time.sleep(0.05)
    start = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    t.join(60)
    assert not t.is_alive() and time.monotonic() - start < 60
    assert "TP worker" in str(result["error"]) and "rank 1" in str(result["error"])
    with pytest.raises(Exception, match="engine stopped"):
        engine.generate(input_ids=[5, 6], sampling_params=SamplingParams(max_new_tokens=2))
    engine.shutdown()
    assert not any(_alive(pid) for pid in pids)


def test_two_engines_side_by_side(llama_path):
    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    prompts = random_prompts(300, [5, 9], seed=31)
    with RolloutEngine(llama_path, dtype="float32", kv_cache_tokens=256, tp_size=2) as a, \
            RolloutEngine(llama_path, dtype="float32", kv_cache_tokens=256, tp_size=2) as b:
        outs = {}
        threads = [threading.Thread(target=lambda k=k, e=e: outs.__setitem__(k, e.generate(input_ids=prompts,
                                                                                             sampling_params=sp)))
                   for k, e in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        pids = a.worker_pids() + b.worker_pids()
    assert [o.output_token_ids for o in outs["a"]] == [o.output_token_ids for o in outs["b"]]
    assert not any(_alive(pid) for pid in pids)


def test_external_launch_under_torchrun(llama_path, model_dir, tmp_path):
    import json
    import subprocess
    import sys

    from weight_sync.process_group import free_port

    prompts = random_prompts(300, [5, 9], seed=32)
    out = tmp_path / "rec"
    script = os.path.join(os.path.dirname(__file__), "external_tp_script.py")
    other = model_dir("external-b", "llama", seed=2)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), script, llama_path, str(out), json.dumps(prompts), other],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.load(open(f"{out}.{r}")) for r in (0, 1)]
    # the engine's shutdown joined the threads of the groups it made: none is left for interpreter teardown
    assert all(r["threads"][1] <= r["threads"][0] for r in recs), [r["threads"] for r in recs]
    assert recs[0]["greedy"] == recs[1]["greedy"] and recs[0]["sampled"] == recs[1]["sampled"]
    assert recs[0]["rejected"] and recs[1]["rejected"]  # the over-long prompt raised on both ranks
    with RolloutEngine(llama_path, dtype="float32", kv_cache_tokens=512, tp_size=2) as spawned:
        greedy = spawned.generate(input_ids=prompts, sampling_params=SamplingParams(
            max_new_tokens=8, temperature=0, ignore_eos=True))
        sampled = spawned.generate(input_ids=prompts, sampling_params=SamplingParams(
            max_new_tokens=8, temperature=0.8, seed=3, n=2, ignore_eos=True))
    assert recs[0]["greedy"] == [o.output_token_ids for o in greedy]
    assert recs[0]["sampled"] == [o.output_token_ids for o in sampled]
    assert recs[0]["again"] == greedy[0].output_token_ids[:4]
    for a, b in zip(recs[0]["logprobs"], greedy):
        assert a == pytest.approx(b.output_logprobs, abs=1e-5)
    # weight updates: both ranks commit together; when only rank 1's part is bad, both discard
    with RolloutEngine(other, dtype="float32", kv_cache_tokens=512) as fresh:
        expected = fresh.generate(input_ids=prompts[:1], sampling_params=SamplingParams(
            max_new_tokens=8, temperature=0, ignore_eos=True))[0].output_token_ids
    for rec in recs:
        up = rec["update"]
        assert up["ok"] and not up["bad"] and up["version"] == "b" and up["checksum_kept"]
        assert up["after"] == expected
    assert "NaN" in recs[1]["update"]["bad_message"] and "another TP rank" in recs[0]["update"]["bad_message"]
