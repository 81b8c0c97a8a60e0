"""Memory release/resume for colocated training, and no memory growth over many updates."""

import gc
import os

import psutil
import pytest
from helpers import random_prompts
from safetensors.torch import load_file

from rollout import RolloutEngine, SamplingParams

SP = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = random_prompts(300, [9, 20], seed=60)


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


@pytest.fixture(scope="module")
def big(model_dir):
    path = model_dir("mem-model", "llama", hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=8,
                     num_kv_heads=2, embed_std=0.05, head_std=0.05)
    return path, list(load_file(os.path.join(path, "model.safetensors")).items())


def test_release_frees_memory_and_resume_restores(big):
    path, tensors = big
    with RolloutEngine(path, dtype="float32", kv_cache_tokens=16384) as e:
        ref = e.generate(input_ids=PROMPTS, sampling_params=SP)
        owned = sum(e.memory_nbytes().values())
        before = rss()
        out = e.release_memory_occupation()
        assert out["freed_bytes"] == owned
        assert before - rss() >= 0.8 * owned, "released memory was not returned to the OS"
        with pytest.raises(RuntimeError, match="resume_memory_occupation"):
            e.generate(input_ids=PROMPTS, sampling_params=SP)
        e.resume_memory_occupation()
        with pytest.raises(RuntimeError, match="full weight update"):
            e.generate(input_ids=PROMPTS, sampling_params=SP)
        assert e.update_weights_from_tensor(tensors[:3], partial=True, weight_version="p").success
        with pytest.raises(RuntimeError, match="full weight update"):  # a partial update is not enough
            e.generate(input_ids=PROMPTS, sampling_params=SP)
        assert e.update_weights_from_tensor(tensors, weight_version="step-1").success
        outs = e.generate(input_ids=PROMPTS, sampling_params=SP)
        assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in ref]
        # with a host backup, resume alone restores the weights
        e.release_memory_occupation(["weights", "kv_cache"], backup_weights=True)
        e.resume_memory_occupation(["weights", "kv_cache"])
        assert [o.output_token_ids for o in e.generate(input_ids=PROMPTS, sampling_params=SP)] == \
            [o.output_token_ids for o in ref]
        with pytest.raises(ValueError, match="unknown memory tags"):
            e.release_memory_occupation(["gpu"])


def test_no_growth_over_updates_and_cycles(big):
    path, tensors = big
    with RolloutEngine(path, dtype="float32", kv_cache_tokens=4096) as e:
        marks = {}
        for i in range(200):
            assert e.update_weights_from_tensor(tensors, weight_version=str(i)).success
            if i in (19, 199):
                marks[i] = rss()
        assert marks[199] < marks[19] * 1.05
        for i in range(50):
            e.release_memory_occupation()
            e.resume_memory_occupation()
            assert e.update_weights_from_tensor(tensors).success
            if i in (19, 49):
                marks[f"c{i}"] = rss()
        assert marks["c49"] < marks["c19"] * 1.05
        assert e.generate(input_ids=PROMPTS, sampling_params=SP)[0].finish_reason == "length"


def _shm_sender(handle_q, ack_q, tensors, rounds):
    from weight_sync import SharedMemoryBucket

    bucket = SharedMemoryBucket()
    for _ in range(rounds):
        handle_q.put(bucket.write(tensors))
        ack_q.get(timeout=60)
    bucket.close()


def _group_sender(port, tensors, rounds):
    from weight_sync.distributed import WeightUpdateSender

    sender = WeightUpdateSender("127.0.0.1", port, 2, "m", timeout_s=30)
    for _ in range(rounds):
        sender.send(tensors, bucket_bytes=4 << 20)


def test_no_growth_over_cross_process_updates(big):
    """Shared-memory handles: one segment, reused, gone after the sender closes; process-group
    updates: the shadow and receive buffers are allocated once. RSS flat between the 20th and last."""
    import multiprocessing as mp

    from weight_sync.distributed import WeightUpdateSender
    from weight_sync.process_group import free_port

    path, tensors = big
    ctx = mp.get_context("spawn")
    segments = lambda: {f for f in os.listdir("/dev/shm") if f.startswith("rollout-weights")}  # noqa: E731
    before = segments()
    with RolloutEngine(path, dtype="float32", kv_cache_tokens=1024) as e:
        handle_q, ack_q = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=_shm_sender, args=(handle_q, ack_q, tensors, 60))
        proc.start()
        names, marks = set(), {}
        for i in range(60):
            handle = handle_q.get(timeout=60)
            names.add(handle["shm_name"])
            assert e.update_weights_from_tensor(handle).success
            ack_q.put(1)
            if i in (19, 59):
                marks[i] = rss()
        proc.join(60)
        assert len(names) == 1 and marks[59] < marks[19] * 1.05
        assert segments() == before  # the sender's segment is gone; the engine kept no mapping
        port = free_port()
        proc = ctx.Process(target=_group_sender, args=(port, tensors, 40))
        proc.start()
        assert e.init_weights_update_group("127.0.0.1", port, 1, 2, "m", timeout_s=30)["success"]
        n, d, s = WeightUpdateSender.describe(tensors)
        for i in range(40):
            assert e.update_weights_from_distributed(n, d, s, "m", bucket_bytes=4 << 20,
                                                     load_format="rollout_bucket").success
            if i in (19, 39):
                marks[f"d{i}"] = rss()
        proc.join(60)
        assert marks["d39"] < marks["d19"] * 1.05
        assert e.generate(input_ids=PROMPTS, sampling_params=SP)[0].finish_reason == "length"
