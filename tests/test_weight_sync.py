"""Weight updates: disk, in-process tensors, shared memory from another process; TP=1 and TP=2.
All-or-nothing, versioned, and the prefix cache never serves KV from older weights."""

import multiprocessing as mp
import os
import shutil
import threading
import time

import pytest
import torch
from helpers import random_prompts
from safetensors.torch import load_file

from rollout import RolloutEngine, SamplingParams
from rollout.tools.hf import hf_parameter_order
from weight_sync import SharedMemoryBucket, checksum_named_tensors

SP = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
SP_SAMPLED = SamplingParams(max_new_tokens=8, temperature=0.9, seed=4, ignore_eos=True)
PROMPTS = random_prompts(300, [37, 6], seed=50)


@pytest.fixture(scope="module")
def weights(model_dir):
    a = model_dir("sync-a", "llama", seed=1)
    b = model_dir("sync-b", "llama", seed=2)
    return a, b, list(load_file(os.path.join(b, "model.safetensors")).items())


@pytest.fixture(scope="module")
def fresh_b(weights):
    with RolloutEngine(weights[1], dtype="float32", kv_cache_tokens=512) as e:
        return (e.generate(input_ids=PROMPTS, sampling_params=SP),
                e.generate(input_ids=PROMPTS, sampling_params=SP_SAMPLED), e.get_weights_checksum())


def _sender(handle_q, done_q, tensors):
    bucket = SharedMemoryBucket()
    handle_q.put(bucket.write(tensors))
    done_q.get(timeout=120)  # keep the segment alive until the engine has loaded it
    bucket.close()


def _update(engine, path, weights, b_path):
    if path == "disk":
        return engine.update_weights_from_disk(b_path, weight_version="v1")
    if path == "tensor":
        return engine.update_weights_from_tensor(weights, weight_version="v1")
    ctx = mp.get_context("spawn")
    handle_q, done_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_sender, args=(handle_q, done_q, weights))
    proc.start()
    try:
        return engine.update_weights_from_tensor(handle_q.get(timeout=120), weight_version="v1")
    finally:
        done_q.put("done")
        proc.join(60)


@pytest.mark.parametrize("tp", [1, 2])
def test_update_paths_match_fresh_engine(weights, fresh_b, tp, make_engine):
    a, b, tensors = weights
    greedy_b, sampled_b, checksum_b = fresh_b
    engine = make_engine(a, kv_cache_tokens=512, tp_size=tp)
    old = engine.generate(input_ids=PROMPTS, sampling_params=SP)
    assert old[0].num_cached_tokens == 0 and old[0].weight_version == "default"
    for i, path in enumerate(("disk", "tensor", "shm")):
        if i:  # back to A first, so every path really changes the weights
            assert engine.update_weights_from_disk(a, weight_version="v0").success
            assert engine.generate(input_ids=PROMPTS, sampling_params=SP)[0].output_token_ids == \
                old[0].output_token_ids
        result = _update(engine, path, tensors, b)
        assert result.success, result.message
        assert result.weight_version == engine.get_weight_version() == "v1"
        greedy = engine.generate(input_ids=PROMPTS, sampling_params=SP)
        sampled = engine.generate(input_ids=PROMPTS, sampling_params=SP_SAMPLED)
        assert [o.output_token_ids for o in greedy] == [o.output_token_ids for o in greedy_b], path
        assert [o.output_token_ids for o in sampled] == [o.output_token_ids for o in sampled_b], path
        for x, y in zip(sampled, sampled_b):
            assert x.output_logprobs == pytest.approx(y.output_logprobs, abs=1e-5)
        # the cached 37-token prompt was recomputed under the new weights, not served from old KV
        assert greedy[0].num_cached_tokens == 0 and greedy[0].weight_version == "v1"
        name = "model.layers.1.self_attn.k_proj.weight"
        assert engine.get_weights_by_name(name, 10) == pytest.approx(dict(tensors)[name].flatten()[:10].tolist())
        assert engine.get_weights_checksum() == checksum_b == checksum_named_tensors(tensors, torch.float32)


@pytest.fixture(scope="module")
def engine_a(weights, module_engines):
    return module_engines(weights[0], kv_cache_tokens=512)


def _damage(tensors, kind):
    name = "model.layers.0.mlp.down_proj.weight"
    out = dict(tensors)
    if kind == "shape":
        out[name] = out[name][:, :-1]
    elif kind == "unknown":
        out["model.layers.7.mlp.down_proj.weight"] = out[name]
    elif kind == "missing":
        del out[name]
    elif kind == "dtype":
        out[name] = out[name].to(torch.bfloat16)
    elif kind == "nan":
        out[name] = out[name].clone()
        out[name][3, 3] = float("nan")
    return list(out.items())


def _bad_handle(kind):
    meta = [{"name": "model.norm.weight", "dtype": "float32", "shape": [64], "offset": 0}]
    if kind == "missing_segment":  # the sender closed its segment (or never made it)
        return {"kind": "shared_memory", "shm_name": "rollout-weights-gone", "nbytes": 256, "metadata": meta}
    if kind == "unknown_kind":
        return {"kind": "pickle", "metadata": meta}
    # a CUDA-IPC handle reaching an engine without CUDA
    return {"kind": "cuda_ipc", "owner": "x", "generation": 1, "nbytes": 256, "metadata": meta,
            "ipc": {"device": 0, "handle": "00", "size_bytes": 256, "offset_bytes": 0, "ref_counter_handle": "00",
                    "ref_counter_offset": 0, "event_handle": None, "event_sync_required": False}}


@pytest.mark.parametrize("kind, match", [("missing_segment", "does not exist"), ("unknown_kind", "unknown bucket"),
                                         ("cuda_ipc_on_cpu", "needs CUDA")])
def test_bad_bucket_handles_leave_weights(engine_a, kind, match):
    if kind == "cuda_ipc_on_cpu" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    checksum, version = engine_a.get_weights_checksum(), engine_a.get_weight_version()
    result = engine_a.update_weights_from_tensor(_bad_handle(kind), weight_version="bad", partial=True)
    assert not result.success and match in result.message
    assert engine_a.get_weights_checksum() == checksum and engine_a.get_weight_version() == version
    assert engine_a.generate(input_ids=PROMPTS[:1], sampling_params=SP)[0].finish_reason == "length"


@pytest.mark.parametrize("kind, match", [("shape", "shape"), ("unknown", "unknown weight name"),
                                         ("missing", "missing weights"), ("dtype", "dtype"), ("nan", "NaN")])
def test_bad_tensor_updates_leave_weights(engine_a, weights, kind, match):
    before = engine_a.generate(input_ids=PROMPTS, sampling_params=SP)
    checksum = engine_a.get_weights_checksum()
    version = engine_a.get_weight_version()
    result = engine_a.update_weights_from_tensor(_damage(weights[2], kind), weight_version="bad")
    assert not result.success and match in result.message
    assert engine_a.get_weight_version() == version == result.weight_version
    assert engine_a.get_weights_checksum() == checksum
    assert engine_a.generate(input_ids=PROMPTS, sampling_params=SP)[0].output_token_ids == before[0].output_token_ids


def test_finite_check_can_be_switched_off(model_dir, weights, make_engine):
    e = make_engine(weights[0], kv_cache_tokens=256)
    assert e.update_weights_from_tensor(_damage(weights[2], "nan"), check_finite=False).success


@pytest.mark.parametrize("damage", ["header", "offsets", "truncated"])
def test_bad_safetensors_files_leave_weights(engine_a, weights, tmp_path, damage):
    path = tmp_path / "ckpt"
    shutil.copytree(weights[1], path)
    st = path / "model.safetensors"
    raw = bytearray(st.read_bytes())
    if damage == "header":
        raw[8:12] = b"\xff\xfe{["
    elif damage == "offsets":
        n = int.from_bytes(raw[:8], "little")
        header = raw[8:8 + n].decode()
        i = header.index('"data_offsets":[') + len('"data_offsets":[')
        raw[8 + i: 8 + i + 1] = b"9"
    else:
        raw = raw[: len(raw) - 1000]
    st.write_bytes(bytes(raw))
    checksum = engine_a.get_weights_checksum()
    result = engine_a.update_weights_from_disk(str(path), weight_version="bad")
    assert not result.success and "model.safetensors" in result.message
    assert engine_a.get_weights_checksum() == checksum


def test_update_waits_for_running_requests_or_aborts_them(model_dir, weights, make_engine):
    path = model_dir("sync-long", "llama", seed=1, max_position_embeddings=4096)
    sp = SamplingParams(max_new_tokens=1500, temperature=0, ignore_eos=True)
    e = make_engine(path, kv_cache_tokens=4096)
    for abort in (False, True):
        box = {}
        started = e.get_stats()["num_decode_tokens"]  # cumulative: wait for this request's own tokens
        t = threading.Thread(target=lambda: box.setdefault("out", e.generate(input_ids=[5, 6, 7], sampling_params=sp)))
        t.start()
        while e.get_stats()["num_decode_tokens"] < started + 5:
            time.sleep(0.01)
        version = f"after-{abort}"
        result = e.update_weights_from_tensor(weights[2], weight_version=version, abort_all_requests=abort)
        t.join(60)
        out = box["out"][0]
        assert result.success
        if abort:
            assert out.finish_reason == "abort" and len(out.output_token_ids) < 1500
        else:  # the update waited: every token of the running request came from the old weights
            assert out.finish_reason == "length" and set(out.output_weight_versions) == {"default"}
        assert e.generate(input_ids=[5, 6, 7], sampling_params=SP)[0].weight_version == version
        e.update_weights_from_disk(path, weight_version="default")


def test_pause_in_place_gives_per_token_versions(model_dir, weights, make_engine):
    path = model_dir("sync-long", "llama", seed=1, max_position_embeddings=4096)
    sp = SamplingParams(max_new_tokens=600, temperature=0, ignore_eos=True)
    e = make_engine(path, kv_cache_tokens=4096)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", e.generate(input_ids=[5, 6, 7], sampling_params=sp)))
    t.start()
    while e.get_stats()["num_decode_tokens"] < 5:
        time.sleep(0.01)
    e.pause_generation(mode="in_place")
    assert e.update_weights_from_tensor(weights[2], weight_version="v1").success
    e.continue_generation()
    t.join(60)
    out = box["out"][0]
    versions = out.output_weight_versions
    assert out.finish_reason == "length" and len(versions) == 600
    switch = versions.index("v1")
    assert 0 < switch and set(versions[:switch]) == {"default"} and set(versions[switch:]) == {"v1"}
    assert out.weight_version == "v1"


def test_pause_retract_and_abort(model_dir, make_engine):
    path = model_dir("sync-long", "llama", seed=1, max_position_embeddings=4096)
    sp = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
    e = make_engine(path, kv_cache_tokens=4096)
    ref = e.generate(input_ids=[5, 6, 7], sampling_params=sp)[0]
    for mode in ("retract", "abort"):
        box = {}
        started = e.get_stats()["num_decode_tokens"]  # cumulative: wait for this request's own tokens
        t = threading.Thread(target=lambda: box.setdefault("out", e.generate(input_ids=[5, 6, 7],
                                                                               sampling_params=sp)))
        t.start()
        while e.get_stats()["num_decode_tokens"] < started + 5:
            time.sleep(0.01)
        e.pause_generation(mode=mode)
        stats = e.get_stats()
        assert stats["num_free_blocks"] == stats["num_blocks"] or mode == "abort"
        e.continue_generation()
        t.join(60)
        out = box["out"][0]
        if mode == "retract":  # recomputed after the pause: the very same tokens
            assert out.output_token_ids == ref.output_token_ids and out.num_preemptions == 1
        else:
            assert out.finish_reason == "abort" and len(out.output_logprobs) == len(out.output_token_ids)


def _dist_sender(port, world, tensors, bucket_bytes, die_after_first_bucket, flat=False):
    import os as _os

    from weight_sync.bucket import FlattenedTensorBucket
    from weight_sync.distributed import WeightUpdateSender, broadcast
    from weight_sync.layout import bucket_specs, layout, views

    sender = WeightUpdateSender("127.0.0.1", port, world, "g", timeout_s=30)
    if not die_after_first_bucket:
        if flat:  # the model kept in one flat buffer goes out with no pack copy
            sender.send(FlattenedTensorBucket(tensors).named_tensors(), bucket_bytes=bucket_bytes)
            _os._exit(0 if sender._buffers is None else 3)
        sender.send(tensors, bucket_bytes=bucket_bytes)
        return
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in tensors]
    first = next(iter(bucket_specs(specs, bucket_bytes)))
    metas, total = layout(first)
    buf = torch.empty(total, dtype=torch.uint8)
    for (name, view) in views(buf, metas):
        view.copy_(dict(tensors)[name])
    broadcast(sender.group, buf)
    _os._exit(1)  # the trainer dies mid-transfer


@pytest.mark.parametrize("tp", [1, 2])
def test_distributed_update_with_separate_sender(weights, fresh_b, tp, make_engine):
    from weight_sync.distributed import WeightUpdateSender
    from weight_sync.process_group import free_port

    a, b, tensors = weights
    if tp == 1:  # a trainer's own order (named_parameters): buckets land in the engine's memory as they are
        by_name = dict(tensors)
        tensors = [(n, by_name[n]) for n in hf_parameter_order(b) if n in by_name]
    names, dtypes, shapes = WeightUpdateSender.describe(tensors)
    ctx = mp.get_context("spawn")
    engine = make_engine(a, kv_cache_tokens=512, tp_size=tp)
    before = engine.generate(input_ids=PROMPTS, sampling_params=SP)
    checksum_a = engine.get_weights_checksum()
    def update(die: bool):
        port = free_port()
        flat = tp == 2  # TP=1: the sender packs separate tensors; TP=2: it sends from a flat bucket
        proc = ctx.Process(target=_dist_sender, args=(port, 1 + tp, tensors, 64 << 10, die, flat))
        proc.start()
        assert engine.init_weights_update_group("127.0.0.1", port, 1, 1 + tp, "g", timeout_s=30)["success"]
        result = engine.update_weights_from_distributed(names, dtypes, shapes, "g", weight_version="v1",
                                                        load_format="rollout_bucket",
                                                        bucket_bytes=64 << 10)
        proc.join(30)
        assert die or proc.exitcode == 0
        return result

    # 1. a sender that dies after its first bucket: the update fails, A stays, the group is torn down
    result = update(die=True)
    assert not result.success and "'g'" in result.message and "bucket 2/" in result.message
    assert engine.get_weight_version() == "default" and engine.get_weights_checksum() == checksum_a
    assert engine.generate(input_ids=PROMPTS, sampling_params=SP)[0].output_token_ids == before[0].output_token_ids
    # 2. re-initialising the group works, and a complete transfer commits B
    result = update(die=False)
    assert result.success, result.message
    assert engine.get_weights_checksum() == fresh_b[2]
    if tp == 1:
        total = sum(t.numel() * t.element_size() for _, t in tensors)
        assert result.detail["received_in_place_bytes"] > 0.8 * total
    greedy = engine.generate(input_ids=PROMPTS, sampling_params=SP)
    assert [o.output_token_ids for o in greedy] == [o.output_token_ids for o in fresh_b[0]]
    sampled = engine.generate(input_ids=PROMPTS, sampling_params=SP_SAMPLED)
    for x, y in zip(sampled, fresh_b[1]):
        assert x.output_token_ids == y.output_token_ids
        assert x.output_logprobs == pytest.approx(y.output_logprobs, abs=1e-5)
    name = "model.embed_tokens.weight"
    assert engine.get_weights_by_name(name, 8) == pytest.approx(dict(tensors)[name].flatten()[:8].tolist())
    assert engine.destroy_weights_update_group("g")["success"]


def _rounds_sender(port, world, rounds, bucket_bytes):
    from weight_sync.distributed import WeightUpdateSender

    sender = WeightUpdateSender("127.0.0.1", port, world, "r", timeout_s=30)
    for tensors in rounds:
        sender.send(tensors, bucket_bytes=bucket_bytes)


def test_distributed_rejections_drain_and_later_updates_land(weights, make_engine):
    """A rejected transfer (NaN; a wrong dtype) is still drained, so the group keeps working; a
    partial update changes only its tensors; full updates in a row (the shadow swaps back and
    forth) each land exactly."""
    from weight_sync.distributed import WeightUpdateSender
    from weight_sync.process_group import free_port

    a, b, tensors_b = weights
    tensors_a = list(load_file(os.path.join(a, "model.safetensors")).items())
    nan = _damage(tensors_b, "nan")
    part = [(n, t) for n, t in tensors_a if n.startswith("model.layers.0.")]
    wrong_dtype = [(n, t.to(torch.float64)) for n, t in tensors_b]
    half = len(tensors_a) // 2
    part_b = [(n, t) for n, t in tensors_b if n.startswith("model.layers.0.")]
    rounds = [nan, wrong_dtype, tensors_b, part, tensors_a, tensors_b, tensors_a[:half], tensors_a[half:], nan,
              part_b, tensors_b[:half], tensors_a]
    ctx = mp.get_context("spawn")
    port = free_port()
    proc = ctx.Process(target=_rounds_sender, args=(port, 3, rounds, 32 << 10))
    proc.start()
    engine = make_engine(a, kv_cache_tokens=512, tp_size=2)
    checksum_a = engine.get_weights_checksum()
    assert engine.init_weights_update_group("127.0.0.1", port, 1, 3, "r", timeout_s=30)["success"]

    def update(named, **kw):
        names, dtypes, shapes = WeightUpdateSender.describe(named)
        return engine.update_weights_from_distributed(names, dtypes, shapes, "r", bucket_bytes=32 << 10,
                                                      load_format="rollout_bucket", **kw)

    out = update(nan)
    assert not out.success and "NaN" in out.message and engine.get_weights_checksum() == checksum_a
    out = update(wrong_dtype)
    assert not out.success and "dtype" in out.message and engine.get_weights_checksum() == checksum_a
    assert update(tensors_b).success
    checksum_b = checksum_named_tensors(tensors_b, torch.float32)
    assert engine.get_weights_checksum() == checksum_b
    assert update(part, partial=True).success  # layer 0 from A, the rest stays B
    for name, src in (("model.layers.0.mlp.down_proj.weight", tensors_a),
                      ("model.layers.1.mlp.down_proj.weight", tensors_b)):
        assert engine.get_weights_by_name(name, 8) == pytest.approx(dict(src)[name].flatten()[:8].tolist())
    assert update(tensors_a).success and engine.get_weights_checksum() == checksum_a
    assert update(tensors_b).success and engine.get_weights_checksum() == checksum_b
    # the buffers that traded memory still release and resume like any other
    engine.release_memory_occupation(backup_weights=True)
    engine.resume_memory_occupation()
    assert engine.get_weights_checksum() == checksum_b
    # a transaction whose buckets arrive over the group in two calls: staged, then one commit
    assert engine.begin_weight_update(weight_version="ta")["success"]
    assert update(tensors_a[:half], transaction=True)["success"]
    assert engine.get_weights_checksum() == checksum_b  # staged only
    assert update(tensors_a[half:], transaction=True)["success"]
    result = engine.commit_weight_update()
    assert result.success and result.weight_version == "ta" and engine.get_weights_checksum() == checksum_a
    # a bucket with a NaN is refused as it arrives (checked while the sender gathers the next);
    # the transaction cannot commit
    assert engine.begin_weight_update(weight_version="bad")["success"]
    out = update(nan, transaction=True)
    assert not out.success and "NaN" in out.message
    assert not engine.commit_weight_update().success and engine.get_weights_checksum() == checksum_a
    # a partial transaction received into the shadow: only its tensors change
    assert engine.begin_weight_update(weight_version="tp")["success"]
    assert update(part_b, transaction=True)["success"]
    assert engine.commit_weight_update(partial=True).success
    for name, src in (("model.layers.0.mlp.down_proj.weight", tensors_b),
                      ("model.layers.1.mlp.down_proj.weight", tensors_a)):
        assert engine.get_weights_by_name(name, 8) == pytest.approx(dict(src)[name].flatten()[:8].tolist())
    # an update outside an open transaction takes the shadow: what the transaction received is void
    assert engine.begin_weight_update(weight_version="void")["success"]
    assert update(tensors_b[:half], transaction=True)["success"]
    assert update(tensors_a).success and engine.get_weights_checksum() == checksum_a
    out = engine.commit_weight_update()
    assert not out.success and "begin it again" in out.message and engine.get_weights_checksum() == checksum_a
    proc.join(30)
    assert proc.exitcode == 0


def test_rendezvous_nobody_joins_fails_within_timeout(engine_a):
    from weight_sync.process_group import free_port

    """Nobody joins: the call fails within its timeout (it reaches torch's store connect, which alone took
    ~2x), reporting the real time; the engine generates all the while (the join runs off its loop)."""
    box: dict = {}
    start = time.monotonic()
    t = threading.Thread(target=lambda: box.setdefault("out", engine_a.init_weights_update_group(
        "127.0.0.1", free_port(), 1, 2, "lonely", timeout_s=3)))
    t.start()
    time.sleep(0.3)
    # generation goes on while the join waits (it used to hold the engine loop for the whole timeout)
    assert engine_a.generate(input_ids=PROMPTS[:1], sampling_params=SP)[0].finish_reason == "length"
    assert t.is_alive()
    t.join()
    out = box["out"]
    assert not out.success and "'lonely'" in out.message and "rendezvous" in out.message
    assert 3 <= out.seconds < 6 and time.monotonic() - start < 6


def test_reload_weights_reads_the_start_folder_as_the_first_load_did(weights, make_engine, tmp_path):
    """An engine started from a folder whose files link elsewhere (a Hugging Face cache snapshot): after a push
    of other weights, ``reload_weights`` reads that folder again (links followed, as at the start, while a
    disk update refuses them), restoring the starting weights and version label."""
    a, b, tensors_b = weights
    linked = tmp_path / "snapshot"
    linked.mkdir()
    for name in os.listdir(a):
        os.symlink(os.path.join(a, name), linked / name)
    engine = make_engine(str(linked), kv_cache_tokens=512, weight_version="base")
    checksum_a = engine.get_weights_checksum()
    assert engine.update_weights_from_tensor(tensors_b, weight_version="pushed").success
    assert engine.get_weights_checksum() != checksum_a
    refused = engine.update_weights_from_disk(str(linked))
    assert not refused.success and "symbolic link" in refused.message
    result = engine.reload_weights()
    assert result.success and result.weight_version == "base", result.message
    assert engine.get_weights_checksum() == checksum_a and engine.get_weight_version() == "base"


def test_an_update_announcing_more_than_any_model_update_is_refused_unreceived(weights, make_engine):
    """A call announcing a [1e6, 1e6] fp32 tensor over a live group (8 TB: a refused call is drained, and a
    drain posts buffers of the announced size): refused at once, naming the bound, nothing allocated; the
    group is torn down (it cannot stay in step with such a sender) and a new one carries the next push."""
    from trainer_bridge.distributed_target import _Call
    from weight_sync.distributed import WeightUpdateSender
    from weight_sync.process_group import free_port

    a, b, tensors_b = weights
    engine = make_engine(a, kv_cache_tokens=512)
    checksum_a = engine.get_weights_checksum()
    for attempt in range(2):
        port = free_port()
        join = _Call("join", engine.init_weights_update_group, "127.0.0.1", port, 1, 2, "huge", "gloo", 30)
        sender = WeightUpdateSender("127.0.0.1", port, 2, "huge", timeout_s=30)
        assert join.get(40).success
        if attempt == 0:
            t0 = time.monotonic()
            out = engine.update_weights_from_distributed(["model.embed_tokens.weight"], ["float32"],
                                                         [[1_000_000, 1_000_000]], "huge")
            assert not out.success and "announces" in out.message and "torn down" in out.message, out.message
            assert time.monotonic() - t0 < 5 and engine.get_weights_checksum() == checksum_a
            assert not engine.destroy_weights_update_group("huge").success  # already gone
            sender.close()
            continue
        names, dtypes, shapes = WeightUpdateSender.describe(tensors_b)
        call = _Call("push", engine.update_weights_from_distributed, names, dtypes, shapes, "huge",
                     load_format="rollout_bucket")
        sender.send(tensors_b)
        assert call.get(60).success
        assert engine.get_weights_checksum() == checksum_named_tensors(tensors_b, torch.float32)
        engine.destroy_weights_update_group("huge")
        sender.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_multi_call_transaction(weights, fresh_b, tp, make_engine):
    a, b, tensors = weights
    third = len(tensors) // 3
    buckets = [tensors[:third], tensors[third: 2 * third], tensors[2 * third:]]
    engine = make_engine(a, kv_cache_tokens=512, tp_size=tp)
    old = engine.generate(input_ids=PROMPTS, sampling_params=SP)
    checksum_a = engine.get_weights_checksum()
    assert engine.begin_weight_update(weight_version="t1")["success"]
    for bucket in buckets:
        assert engine.update_weights_from_tensor(bucket, transaction=True)["success"]
        # staged only: the engine keeps serving the old weights under the old version
        out = engine.generate(input_ids=PROMPTS[:1], sampling_params=SP)[0]
        assert out.output_token_ids == old[0].output_token_ids and out.weight_version == "default"
    result = engine.commit_weight_update()
    assert result.success and result.weight_version == "t1"
    assert engine.get_weights_checksum() == fresh_b[2]
    assert [o.output_token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=SP)] == \
        [o.output_token_ids for o in fresh_b[0]]
    # a bad bucket poisons the transaction; an incomplete one is refused; both leave the weights
    assert engine.update_weights_from_disk(a, weight_version="a").success
    engine.begin_weight_update(weight_version="t2")
    assert engine.update_weights_from_tensor(buckets[0], transaction=True)["success"]
    name, tensor = buckets[1][0]
    bad = engine.update_weights_from_tensor([(name, tensor[:1])], transaction=True)  # wrong shape
    assert not bad["success"]
    result = engine.commit_weight_update()
    assert not result.success and "transaction discarded" in result.message and result.weight_version == "a"
    engine.begin_weight_update(weight_version="t3")
    engine.update_weights_from_tensor(buckets[0], transaction=True)
    result = engine.commit_weight_update()
    assert not result.success and "missing weights" in result.message
    assert engine.get_weights_checksum() == checksum_a and engine.get_weight_version() == "a"
