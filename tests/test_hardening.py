"""Odd inputs and misordered calls: each case answers with a clear error (or a defined result),
and the engine keeps serving exactly what it served before. Numbers refer to the hardening issue."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest
import torch
from helpers import random_prompts
from safetensors.torch import load_file

from rollout import RolloutEngine, SamplingParams

GREEDY = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = random_prompts(300, [9, 5], seed=70)


@pytest.fixture(scope="module")
def model(model_dir):
    path = model_dir("hard-llama", "llama", seed=3, max_position_embeddings=4096)
    return path, list(load_file(os.path.join(path, "model.safetensors")).items())


@pytest.fixture(scope="module")
def ref(model):
    with RolloutEngine(model[0], dtype="float32", kv_cache_tokens=2048) as e:
        return [o.output_token_ids for o in e.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def engine(request, model):
    with RolloutEngine(model[0], dtype="float32", kv_cache_tokens=2048, tp_size=request.param,
                       tp_timeout_s=30) as e:
        yield e


def serves(engine, ref) -> bool:
    return [o.output_token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == ref


def write_folder(folder, header=None, index=None, data=b""):
    os.makedirs(folder, exist_ok=True)
    for f in os.listdir(folder):
        os.unlink(os.path.join(folder, f))
    if header is not None:
        raw = json.dumps(header).encode()
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw + data)
    if index is not None:
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            f.write(json.dumps(index))
    return str(folder)


# ---------------------------------------------------------------------------------------------
# 1, 2: weight calls after a release, and failed calls on TP ranks


def test_1_weight_calls_after_releasing_weights_fail_cleanly(engine, model, ref, tmp_path):
    path, tensors = model
    engine.release_memory_occupation(["weights"])
    with pytest.raises(ValueError, match="released"):
        engine.get_weights_by_name("model.norm.weight", 4)
    with pytest.raises(ValueError, match="released"):
        engine.get_weights_checksum()
    for call in (lambda: engine.update_weights_from_tensor(tensors),
                 lambda: engine.update_weights_from_tensor(tensors[:2], partial=True),
                 lambda: engine.update_weights_from_disk(path)):
        result = call()
        assert not result.success and "released" in result.message
    assert engine.begin_weight_update("t").success
    assert engine.update_weights_from_tensor(tensors, transaction=True).success
    result = engine.commit_weight_update()
    assert not result.success and "released" in result.message
    with pytest.raises(RuntimeError, match="resume_memory_occupation"):
        engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    engine.resume_memory_occupation(["weights"])
    assert engine.update_weights_from_tensor(tensors, weight_version="back").success
    assert serves(engine, ref)


def test_2_a_failed_call_on_a_rank_leaves_every_rank_serving(engine, model, ref, tmp_path):
    with pytest.raises(ValueError, match="unknown weight name 'model.layers.0.nope'"):
        engine.get_weights_by_name("model.layers.0.nope")
    bad = write_folder(tmp_path / "bad", header={"w": {"dtype": "F32", "shape": ["3"], "data_offsets": [0, 12]}},
                       data=b"\0" * 12)
    result = engine.update_weights_from_disk(bad)
    assert not result.success and "shape must be a list" in result.message
    result = engine.update_weights_from_tensor({"kind": "shared_memory", "name": "no-such-segment", "metadata": []})
    assert not result.success and "cannot read" in result.message
    result = engine.update_weights_from_tensor([("model.norm.weight", "not a tensor")], partial=True)
    assert not result.success and "not a (name, tensor) pair" in result.message
    assert engine.get_weights_by_name("model.norm.weight", 3) == model[1][[n for n, _ in model[1]].index(
        "model.norm.weight")][1][:3].tolist()
    assert serves(engine, ref)


# ---------------------------------------------------------------------------------------------
# 3, 5, 6, 10: request values


def test_3_a_bad_request_fails_alone_naming_the_field(engine, ref):
    long = SamplingParams(max_new_tokens=300, temperature=0, ignore_eos=True)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", engine.generate(input_ids=PROMPTS[0],
                                                                             sampling_params=long)))
    t.start()
    try:
        with pytest.raises(ValueError, match="temperature"):
            engine.generate(input_ids=PROMPTS[1], sampling_params={"temperature": 10**400})
        with pytest.raises(ValueError, match="temperature"):
            engine.generate(input_ids=PROMPTS[1], sampling_params={"temperature": float("inf")})
        # a top_k past the vocabulary (even past int64) keeps every token: defined, not refused
        huge = engine.generate(input_ids=PROMPTS, sampling_params=SamplingParams(
            max_new_tokens=6, temperature=0.8, top_k=2**63, seed=3, ignore_eos=True))
        off = engine.generate(input_ids=PROMPTS, sampling_params=SamplingParams(
            max_new_tokens=6, temperature=0.8, top_k=-1, seed=3, ignore_eos=True))
        assert [o.output_token_ids for o in huge] == [o.output_token_ids for o in off]
    finally:
        t.join(120)
    out = box["out"][0]
    assert out.finish_reason == "length" and out.output_token_ids[:6] == ref[0]


def test_5_float32_edge_values_are_defined(engine, ref):
    for temperature in (1e-300, 1e-40, 1e-6):  # 0 or subnormal in float32: greedy
        outs = engine.generate(input_ids=PROMPTS, sampling_params=SamplingParams(
            max_new_tokens=6, temperature=temperature, ignore_eos=True))
        assert [o.output_token_ids for o in outs] == ref
        assert all(all(lp == lp and lp <= 0 for lp in o.output_logprobs) for o in outs)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=SamplingParams(
        max_new_tokens=6, temperature=1.0, top_p=1e-300, seed=1, ignore_eos=True))
    assert [o.output_token_ids for o in outs] == ref  # the most likely token always survives top-p
    assert all(lp == 0.0 for o in outs for lp in o.output_logprobs)
    allowed = [5, 17, 250]
    outs = engine.generate(input_ids=PROMPTS, sampling_params=SamplingParams(
        max_new_tokens=6, temperature=3e38, allowed_token_ids=allowed, seed=2, ignore_eos=True))
    assert all(t in allowed for o in outs for t in o.output_token_ids)
    assert all(lp == lp for o in outs for lp in o.output_logprobs)


@pytest.mark.parametrize("bias", [float("nan"), float("inf"), -float("inf"), 1e300])
def test_6_non_finite_logit_bias_is_refused(engine, bias):
    with pytest.raises(ValueError, match="logit_bias"):
        engine.generate(input_ids=PROMPTS[0], sampling_params={"logit_bias": {5: bias}, "max_new_tokens": 2})


def test_6_a_min_tokens_mask_that_bans_every_allowed_token_is_refused(engine):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        engine.generate(input_ids=PROMPTS[0], sampling_params=SamplingParams(
            max_new_tokens=4, min_new_tokens=2, allowed_token_ids=[7], stop_token_ids=[7]))


def test_10_array_input_ids(engine, ref):
    assert [o.output_token_ids for o in engine.generate(input_ids=np.array(PROMPTS[0]), sampling_params=GREEDY)] == \
        ref[:1]
    assert [o.output_token_ids for o in engine.generate(input_ids=[np.array(p, dtype=np.int32) for p in PROMPTS],
                                                        sampling_params=GREEDY)] == ref
    batch = torch.tensor([PROMPTS[1], PROMPTS[1]])
    assert [o.output_token_ids for o in engine.generate(input_ids=batch, sampling_params=GREEDY)] == [ref[1]] * 2
    with pytest.raises(ValueError, match="float"):
        engine.generate(input_ids=np.array(PROMPTS[0], dtype=np.float32), sampling_params=GREEDY)
    with pytest.raises(ValueError, match="1-D .* or 2-D"):
        engine.generate(input_ids=torch.zeros(1, 2, 3, dtype=torch.long), sampling_params=GREEDY)
    with pytest.raises(ValueError, match="bool"):
        engine.generate(input_ids=[[1, True, 3]], sampling_params=GREEDY)


# ---------------------------------------------------------------------------------------------
# 4, 9: memory released under live or admitted requests


def _run_in_thread(engine, sp, prompt):
    box = {}

    def run():
        try:
            box["out"] = engine.generate(input_ids=prompt, sampling_params=sp)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t, box


def test_4_pause_in_place_then_release_kv_retracts_and_stays_exact(engine, model):
    sp = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)
    full = engine.generate(input_ids=PROMPTS[0], sampling_params=sp)[0].output_token_ids
    started = engine.get_stats()["num_decode_tokens"]
    t, box = _run_in_thread(engine, sp, PROMPTS[0])
    while engine.get_stats()["num_decode_tokens"] < started + 5:
        time.sleep(0.01)
    engine.pause_generation("in_place")
    engine.release_memory_occupation(["kv_cache"])
    engine.resume_memory_occupation(["kv_cache"])
    engine.continue_generation()
    t.join(120)
    out = box["out"][0]
    assert out.finish_reason == "length" and out.output_token_ids == full and out.num_preemptions == 1


def test_4_pause_in_place_then_weights_released_without_backup_fails_clearly(engine, model, ref):
    sp = SamplingParams(max_new_tokens=300, temperature=0, ignore_eos=True)
    started = engine.get_stats()["num_decode_tokens"]
    t, box = _run_in_thread(engine, sp, PROMPTS[0])
    while engine.get_stats()["num_decode_tokens"] < started + 5:
        time.sleep(0.01)
    engine.pause_generation("in_place")
    engine.release_memory_occupation(["weights"])
    engine.resume_memory_occupation(["weights"])
    engine.continue_generation()  # no full update pushed: the paused request must not run on zeros
    t.join(120)
    assert "out" not in box and "full weight update" in str(box["error"])
    assert engine.update_weights_from_tensor(model[1]).success
    assert serves(engine, ref)


def test_9_requests_admitted_before_a_release_fail_with_the_release_error(engine, model, ref):
    engine.pause_generation("abort")
    t, box = _run_in_thread(engine, GREEDY, PROMPTS[0])  # admitted while memory is still there
    time.sleep(0.3)
    engine.release_memory_occupation(["weights", "kv_cache"], backup_weights=True)
    engine.continue_generation()
    t.join(60)
    assert "memory is released" in str(box["error"])
    engine.resume_memory_occupation()
    assert serves(engine, ref)


# ---------------------------------------------------------------------------------------------
# 7, 11a: malformed and hostile checkpoint folders


@pytest.mark.parametrize("header, index, why", [
    ({"w": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}}, None, "shape must be a list"),
    ({"w": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, None, "unsupported dtype"),
    ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, None, "non-negative"),
    ({"w": [1, 2]}, None, "expected an object"),
    ([1, 2, 3], None, "header must be a JSON object"),
    ({}, {"metadata": {}}, "weight_map"),
    ({}, {"weight_map": {"w": ["model.safetensors"]}}, "file names"),
    ({}, {"weight_map": {"w": "../hard-outside/model.safetensors"}}, "outside the model folder"),
])
def test_7_11_malformed_or_hostile_folders_are_refused_with_the_reason(engine, ref, tmp_path, header, index, why):
    write_folder(tmp_path / "hard-outside", header={})
    folder = write_folder(tmp_path / "ckpt", header=header, index=index, data=b"\0" * 8)
    checksum = engine.get_weights_checksum()
    result = engine.update_weights_from_disk(folder, weight_version="never")
    assert not result.success and why in result.message
    assert engine.get_weight_version() != "never" and engine.get_weights_checksum() == checksum


def test_11_symlinked_weight_files_outside_the_folder_are_refused(engine, model, tmp_path):
    folder = tmp_path / "linked"
    folder.mkdir()
    os.symlink(os.path.join(model[0], "model.safetensors"), folder / "model.safetensors")
    result = engine.update_weights_from_disk(str(folder))
    assert not result.success and "outside the model folder" in result.message


# ---------------------------------------------------------------------------------------------
# 8: request ids


def test_8_duplicate_request_ids_are_refused(engine, ref):
    with pytest.raises(ValueError, match="unique"):
        engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, rid=["same", "same"])
    sp = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)
    started = engine.get_stats()["num_decode_tokens"]
    t = threading.Thread(target=lambda: engine.generate(input_ids=PROMPTS[0], sampling_params=sp, rid="mine"))
    t.start()
    while engine.get_stats()["num_decode_tokens"] < started + 3:
        time.sleep(0.01)
    with pytest.raises(ValueError, match="already in flight"):
        engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, rid="mine")
    t.join(60)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, rid=["req-0", "req-1"])
    assert [o.rid for o in outs] == ["req-0", "req-1"] and [o.output_token_ids for o in outs] == ref
    generated = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert len({o.rid for o in generated}) == 2 and not {o.rid for o in generated} & {"req-0", "req-1"}


# ---------------------------------------------------------------------------------------------
# 11b: nothing listens on the network


def test_11_groups_listen_on_loopback_only(engine):
    from weight_sync.distributed import WeightUpdateSender
    from weight_sync.process_group import free_port

    port = free_port()
    box = {}
    sender = threading.Thread(target=lambda: box.setdefault("s", WeightUpdateSender(
        "127.0.0.1", port, 1 + engine.tp_size, "probe-listen", timeout_s=20)))
    sender.start()
    assert engine.init_weights_update_group("127.0.0.1", port, 1, 1 + engine.tp_size, "probe-listen",
                                            timeout_s=20).success
    sender.join(30)
    try:
        procs = [psutil.Process()] + [psutil.Process(pid) for pid in engine.worker_pids()]
        listening = [c.laddr for p in procs for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        assert listening and all(addr.ip in ("127.0.0.1", "::1") for addr in listening), listening
    finally:
        assert engine.destroy_weights_update_group("probe-listen").success
        box["s"].close()


# ---------------------------------------------------------------------------------------------
# 12: a TP script without the __main__ guard


def test_12_missing_main_guard_says_what_to_do(model, tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(f"""
        from rollout import RolloutEngine
        engine = RolloutEngine({model[0]!r}, dtype="float32", kv_cache_tokens=256, tp_size=2, tp_timeout_s=20)
        engine.shutdown()
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert 'if __name__ == "__main__":' in proc.stderr and "spawn" in proc.stderr
