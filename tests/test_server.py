"""The rollout server, started for real (``rollout serve`` in a subprocess on a free loopback port)
with a tiny model: every route, SGLang and OpenAI clients, weight refreshes, keys, bad bodies, and
a bounded load test with refreshes running."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest
from helpers import assert_left_request_was_aborted, random_prompts
from safetensors.torch import load_file

from rollout import RolloutEngine, SamplingParams
from rollout.server import RolloutServerError

GEN_KEY, ADMIN_KEY = "gen-key", "admin-key"
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PROMPTS = random_prompts(300, [6, 11, 4], seed=120)


@pytest.fixture(scope="module")
def models(model_dir, tmp_path_factory):
    """Weights A (served) and B, B inside the allowed folder."""
    allowed = tmp_path_factory.mktemp("allowed")
    a = model_dir("srv-a", "llama", seed=11, max_position_embeddings=1024)
    b_src = model_dir("srv-b", "llama", seed=12, max_position_embeddings=1024)
    b = str(allowed / "srv-b")
    shutil.copytree(b_src, b)
    return a, b, str(allowed)


@pytest.fixture(scope="module")
def refs(models):
    """Greedy and sampled outputs of the in-process engine on A and on B."""
    out = {}
    for name, path in (("a", models[0]), ("b", models[1])):
        with RolloutEngine(path, dtype="float32", kv_cache_tokens=4096) as e:
            out[name] = e.generate(input_ids=PROMPTS, sampling_params=SamplingParams(**GREEDY))
            out[name + "-n"] = e.generate(input_ids=PROMPTS, sampling_params=SamplingParams(
                n=3, max_new_tokens=6, temperature=0.9, seed=5, ignore_eos=True), top_logprobs_num=2)
    return out


@pytest.fixture(scope="module")
def server(models, module_servers):
    proc = module_servers(models[0], "--dtype", "float32", "--kv-cache-tokens", "8192", "--api-key", GEN_KEY,
                          "--admin-api-key", ADMIN_KEY, "--allowed-weight-dirs", models[2], "--max-body-mb", "1",
                          "--served-model-name", "tiny")
    with proc.client(api_key=GEN_KEY, admin_api_key=ADMIN_KEY) as client:
        yield proc.url, client


def _a_copy(models) -> str:
    """A's weights inside the allowed folder (the server reads only there)."""
    dst = os.path.join(models[2], "srv-a")
    if not os.path.isdir(dst):
        shutil.copytree(models[0], dst)
    return dst


# ---------------------------------------------------------------------------------------------
# keys


def test_keys_guard_every_route_but_health(server):
    url, _ = server
    assert httpx.get(f"{url}/health").status_code == 200
    body = {"input_ids": PROMPTS[0], "sampling_params": GREEDY}
    assert httpx.post(f"{url}/generate", json=body).status_code == 401
    assert httpx.post(f"{url}/generate", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{url}/metrics").status_code == 401
    gen = {"Authorization": f"Bearer {GEN_KEY}"}
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.post(f"{url}/generate", json=body, headers=gen).status_code == 200
    assert httpx.post(f"{url}/generate", json=body, headers=admin).status_code == 200
    for route in ("/flush_cache", "/continue_generation"):
        assert httpx.post(f"{url}{route}", headers=gen).status_code == 403  # a generation key is not enough
        assert httpx.post(f"{url}{route}").status_code == 401
        assert httpx.post(f"{url}{route}", headers=admin).status_code == 200
    r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": "/tmp"}, headers=gen)
    assert r.status_code == 403 and "admin" in r.json()["detail"]


# ---------------------------------------------------------------------------------------------
# generation


def test_generate_equals_the_in_process_engine(server, refs):
    _, client = server
    outs = client.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in refs["a"]]
    assert [o.output_logprobs for o in outs] == [o.output_logprobs for o in refs["a"]]
    sampled = client.generate(input_ids=PROMPTS, sampling_params={"n": 3, "max_new_tokens": 6, "temperature": 0.9,
                                                                 "seed": 5, "ignore_eos": True}, top_logprobs_num=2)
    assert [(o.prompt_index, o.sample_index) for o in sampled] == [(o.prompt_index, o.sample_index)
                                                                   for o in refs["a-n"]]
    for x, y in zip(sampled, refs["a-n"]):
        assert x.output_token_ids == y.output_token_ids and x.output_logprobs == y.output_logprobs
        assert x.output_top_logprobs == [[tuple(p) for p in top] for top in y.output_top_logprobs]
        assert x.output_weight_versions == ["default"] * len(x.output_token_ids)


def test_generate_shapes_text_prompts_and_prompt_logprobs(server):
    url, client = server
    headers = {"Authorization": f"Bearer {GEN_KEY}"}
    one = httpx.post(f"{url}/generate", headers=headers, json={
        "text": "hello there", "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0}).json()
    assert isinstance(one, dict) and one["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    meta = one["meta_info"]
    assert meta["completion_tokens"] == 8 and len(meta["output_token_logprobs"]) == 8
    assert meta["input_token_logprobs"][0][0] is None and len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    many = httpx.post(f"{url}/generate", headers=headers, json={"text": ["a", "b"], "sampling_params": GREEDY}).json()
    assert isinstance(many, list) and len(many) == 2 and "output_token_logprobs" not in many[0]["meta_info"]


def test_streaming_sends_snapshots_then_done(server, refs):
    url, _ = server
    events = []
    with httpx.stream("POST", f"{url}/generate", headers={"Authorization": f"Bearer {GEN_KEY}"}, json={
            "input_ids": PROMPTS[1], "sampling_params": GREEDY, "stream": True, "return_logprob": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]" and len(events) >= 3
    last = json.loads(events[-2])
    assert last["output_ids"] == refs["a"][1].output_token_ids and last["meta_info"]["finish_reason"]
    first = json.loads(events[0])
    assert first["output_ids"] == last["output_ids"][: len(first["output_ids"])]


def test_openai_client_completions_chat_and_models(server, refs):
    import openai

    url, _ = server
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key=GEN_KEY)
    assert [m.id for m in oai.models.list().data] == ["tiny"]
    c = oai.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2,
                               extra_body={"ignore_eos": True})
    choice = c.choices[0]
    assert choice.finish_reason == "length" and c.usage.completion_tokens == 8
    # the reference ran batched, this request alone: fp32 GEMMs of other row counts round differently
    assert choice.logprobs.token_logprobs == pytest.approx(refs["a"][0].output_logprobs, abs=1e-5)
    assert len(choice.logprobs.top_logprobs) == 8
    n = oai.completions.create(model="tiny", prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=5, n=2, seed=3,
                               temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in n.choices) == [0, 1, 2, 3]
    chat = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       n=2, seed=1, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert len(chat.choices) == 2 and chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content) == 6 and len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
    stream = oai.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in stream) == choice.text
    chunks = list(oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=6, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"


def test_bad_bodies_are_refused_naming_the_field(server):
    url, _ = server
    h = {"Authorization": f"Bearer {GEN_KEY}"}
    r = httpx.post(f"{url}/generate", headers=h, json={"input_ids": PROMPTS[0], "return_logprob": "maybe"})
    assert r.status_code == 400 and "return_logprob" in r.text
    r = httpx.post(f"{url}/generate", headers=h, json={"input_ids": PROMPTS[0], "surprise": 1,
                                                      "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200  # an unknown top-level key is ignored, as SGLang ignores it
    r = httpx.post(f"{url}/generate", headers=h, json={"input_ids": PROMPTS[0], "sampling_params": {"tempurature": 1}})
    assert r.status_code == 400 and "tempurature" in r.text
    r = httpx.post(f"{url}/generate", headers=h, json={"input_ids": PROMPTS[0], "sampling_params": {"n": 10**6}})
    assert r.status_code == 400 and "n=" in r.text
    r = httpx.post(f"{url}/generate", headers=h, json={"input_ids": [5] * 5000})
    assert r.status_code == 400 and "limit" in r.text
    r = httpx.post(f"{url}/generate", headers=h, json={"input_ids": PROMPTS[0], "return_logprob": True,
                                                      "top_logprobs_num": 21})  # past the server's cap (20)
    assert r.status_code == 400 and "--max-top-logprobs-num" in r.text
    r = httpx.post(f"{url}/v1/completions", headers=h, json={"prompt": "x", "n": 10**6})
    error = r.json()["error"]  # OpenAI's error shape on the OpenAI routes
    assert r.status_code == 400 and error["code"] == 400 and error["type"] == "BadRequestError"
    assert error["param"] == "n" and "n:" in error["message"]
    import openai

    with pytest.raises(openai.BadRequestError, match="less than or equal to 256"):
        openai.OpenAI(base_url=f"{url}/v1", api_key=GEN_KEY).completions.create(model="m", prompt="x", n=10**6)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong").completions.create(model="m", prompt="x")
    r = httpx.post(f"{url}/generate", headers=h, content=b'{"text": "' + b"x" * (2 << 20) + b'"}',
                   timeout=30)
    assert r.status_code == 413
    r = httpx.post(f"{url}/update_weights_from_disk", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                   json={"model_path": 5, "weight_version": []})
    assert r.status_code == 400 and "model_path" in r.text


# ---------------------------------------------------------------------------------------------
# weights


def test_refresh_from_disk_changes_outputs_and_version(server, models, refs, tmp_path):
    _, client = server
    result = client.update_weights_from_disk(models[1], weight_version="b")
    assert result.success and result.weight_version == "b" and client.get_weight_version() == "b"
    outs = client.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in refs["b"]]
    assert all(o.output_weight_versions == ["b"] * 8 for o in outs)
    with pytest.raises(RolloutServerError) as info:  # outside --allowed-weight-dirs
        client.update_weights_from_disk(models[0])
    assert info.value.status == 403
    link = os.path.join(models[2], "sneaky")
    os.symlink(models[0], link)  # inside by name, outside once resolved
    with pytest.raises(RolloutServerError, match="allowed-weight-dirs"):
        client.update_weights_from_disk(link)
    os.unlink(link)
    assert client.update_weights_from_disk(_a_copy(models), weight_version="default").success
    assert [o.output_token_ids for o in client.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == \
        [o.output_token_ids for o in refs["a"]]


def _push_from_trainer(url: str, path: str, version: str, q) -> None:
    """A separate trainer process: the three-line push over the server's distributed route."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout.server import RolloutClient
    from trainer_bridge import push_weights
    from trainer_bridge.distributed_target import DistributedTarget

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    client = RolloutClient(url, api_key=GEN_KEY, admin_api_key=ADMIN_KEY)
    target = DistributedTarget(client, timeout_s=60)
    stats = push_weights(model, target, version=version, bucket_bytes=64 << 10)
    target.close()
    q.put((stats.result.success, stats.result.message, stats.num_buckets))


def test_refresh_from_a_separate_trainer_over_the_distributed_route(server, models, refs):
    url, client = server
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_push_from_trainer, args=(url, models[1], "pushed", q))
    proc.start()
    ok, message, buckets = q.get(timeout=180)
    proc.join(60)
    assert ok, message
    assert buckets > 1 and client.get_weight_version() == "pushed"
    outs = client.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in refs["b"]]
    assert client.update_weights_from_disk(_a_copy(models), weight_version="default").success


def test_weight_reads_and_failed_updates(server, models):
    _, client = server
    tensors = load_file(os.path.join(models[0], "model.safetensors"))
    assert client.get_weights_by_name("model.norm.weight", 4) == pytest.approx(
        tensors["model.norm.weight"][:4].tolist())
    with pytest.raises(RolloutServerError, match="unknown weight name"):
        client.get_weights_by_name("nope")
    bad = client.update_weights_from_tensor({"kind": "shared_memory", "name": "gone", "metadata": []})
    assert not bad.success and "cannot read" in bad.message
    missing = client.update_weights_from_disk(os.path.join(models[2], "does-not-exist"))
    assert not missing.success and "not a folder" in missing.message
    client.update_weight_version("renamed")
    assert client.get_weight_version() == "renamed"
    client.update_weight_version("default")


def test_update_from_a_shared_memory_handle(server, models, refs):
    from weight_sync import SharedMemoryBucket

    _, client = server
    bucket = SharedMemoryBucket()
    try:
        handle = bucket.write(list(load_file(os.path.join(models[1], "model.safetensors")).items()))
        assert client.update_weights_from_tensor(handle, weight_version="shm").success
        outs = client.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in refs["b"]]
    finally:
        bucket.close()
    assert client.update_weights_from_disk(_a_copy(models), weight_version="default").success


# ---------------------------------------------------------------------------------------------
# control, ops


def test_control_routes_round_trip(server, refs):
    _, client = server
    client.pause_generation("retract")
    client.continue_generation()
    assert client.flush_cache()
    client.abort_request(abort_all=True)
    assert client.release_memory_occupation(["kv_cache"]).detail["freed_bytes"] > 0
    with pytest.raises(RolloutServerError) as info:
        client.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert info.value.status == 503 and "released" in info.value.detail
    assert client.resume_memory_occupation(["kv_cache"]).success
    outs = client.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in refs["a"]]


def test_ops_routes(server):
    url, client = server
    h = {"Authorization": f"Bearer {GEN_KEY}"}
    assert httpx.get(f"{url}/health_generate", headers=h).json()["status"] == "ok"
    info = client.get_model_info()
    assert info["architecture"] == "LlamaForCausalLM" and info["served_model_name"] == "tiny"
    server_info = client.get_server_info()
    assert server_info["admin_auth"] and server_info["engine_config"]["kv_cache_tokens"] == 8192
    text = client.metrics()
    for name in ("rollout_requests_total", "rollout_generation_tokens_total", "rollout_prompt_tokens_total",
                 "rollout_kv_cache_usage", "rollout_num_running_seqs", "rollout_num_queued_seqs",
                 "rollout_prefix_cache_hit_rate", "rollout_step_forward_seconds", "rollout_weight_version_info",
                 "rollout_weight_updates_total", "rollout_weight_update_seconds", "rollout_num_preemptions",
                 "rollout_num_graph_replays", "rollout_num_eager_decode_steps", "rollout_num_graph_samples"):
        assert name in text, name
    client.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)
    stats = client.get_server_info()["stats"]  # on this CPU every decode step runs eagerly, none from a graph
    assert stats["num_eager_decode_steps"] > 0 and stats["num_graph_replays"] == stats["num_graph_samples"] == 0


def test_a_client_that_disconnects_aborts_its_request(server):
    """A streamed request asks for the most tokens its context allows and its client leaves after the
    first event: the request stops there (far fewer tokens decoded than it asked for, so it did not
    just finish) and its blocks come back."""
    url, client = server
    wanted = 1024 - len(PROMPTS[0])  # the model's whole context
    before = client.get_server_info()["stats"]
    with httpx.stream("POST", f"{url}/generate", headers={"Authorization": f"Bearer {GEN_KEY}"}, json={
            "input_ids": PROMPTS[0], "stream": True,
            "sampling_params": {"max_new_tokens": wanted, "temperature": 0, "ignore_eos": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first event
    assert_left_request_was_aborted(client, before, wanted)


# ---------------------------------------------------------------------------------------------
# load


def test_load_with_refreshes_every_few_seconds(server, models):
    """200 concurrent requests arriving over 6 s while weights flip A <-> B every 1.5 s: each
    completes, every output's tokens are the greedy tokens of the weights its versions name, and the
    server stays healthy."""
    from rollout.tools.server_load import run_server_load

    url, client = server
    prompts = random_prompts(300, [5 + i % 9 for i in range(200)], seed=130)
    sampling = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    expect = {}
    for name, path in (("A", _a_copy(models)), ("B", models[1])):
        with RolloutEngine(path, dtype="float32", kv_cache_tokens=8192) as e:
            expect[name] = [o.output_token_ids for o in e.generate(input_ids=prompts,
                                                                   sampling_params=SamplingParams(**sampling))]
    paths = {"A": _a_copy(models), "B": models[1]}

    def refresh(k: int):
        name = "B" if k % 2 else "A"
        return client.update_weights_from_disk(paths[name], weight_version=f"{name}-{k}")

    run = run_server_load(url, prompts, sampling, api_key=GEN_KEY, timeout_s=120, refresh=refresh,
                          refresh_every_s=1.5, spread_s=6.0)
    assert not run["errors"], run["errors"][:3]
    assert len(run["refreshes"]) >= 2 and all(r.success for r in run["refreshes"])
    seen = set()
    for i, item in enumerate(run["items"]):
        versions = set(item["meta_info"]["output_weight_versions"])
        assert len(versions) == 1, versions  # an update never lands under a running request
        version = versions.pop()
        seen.add(version.split("-")[0])
        assert item["output_ids"] == expect["A" if version in ("default",) or version.startswith("A") else "B"][i]
    assert {"A", "B"} <= seen or {"default", "B"} <= seen  # outputs under more than one set of weights
    assert run["summary"]["p99_s"] < 120  # no request waited past its timeout
    assert client.health() and client.update_weights_from_disk(paths["A"], weight_version="default").success
    print("load:", json.dumps(run["summary"]), "versions seen:", sorted(seen))


def test_weight_refresh_example_against_the_server(server, models):
    url, client = server
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                          "weight_refresh_client.py")
    for via in ("distributed", "disk"):
        proc = subprocess.run([sys.executable, script, "--url", url, "--api-key", GEN_KEY, "--admin-api-key",
                               ADMIN_KEY, "--weights", models[1], "--via", via, "--version", f"example-{via}"],
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        assert summary["version"] == f"example-{via}" and summary["after_version"] == f"example-{via}"
        assert summary["read_back_matches"]
    assert client.update_weights_from_disk(_a_copy(models), weight_version="default").success


def test_requests_behind_a_pause_are_aborted_at_their_timeout(models, make_server):
    """A short --request-timeout-s: requests queued while generation is paused (as behind an update's
    quiet point) are answered 504 in time, streamed or not, and leave nothing running."""
    proc = make_server(models[0], "--dtype", "float32", "--kv-cache-tokens", "2048", "--request-timeout-s", "2")
    with proc.client() as client:
        url = proc.url
        client.pause_generation("abort")
        t0 = time.monotonic()
        r = httpx.post(f"{url}/generate", json={"input_ids": PROMPTS[0], "sampling_params": GREEDY}, timeout=30)
        assert r.status_code == 504 and "did not finish within 2" in r.json()["detail"]
        assert time.monotonic() - t0 < 10
        with httpx.stream("POST", f"{url}/generate", json={"input_ids": PROMPTS[0], "sampling_params": GREEDY,
                                                          "stream": True}, timeout=30) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert "did not finish within 2" in events[0] and events[-1] == "data: [DONE]"
        client.continue_generation()
        stats = client.get_server_info()["stats"]
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        assert len(client.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == len(PROMPTS)


def test_a_partial_rollout_push_lands_mid_request(server, models):
    """DistributedTarget(partial_rollouts=True) pauses in place, commits and continues: a request that was
    running keeps going and its later tokens carry the new version."""
    import threading

    import torch
    from transformers import AutoModelForCausalLM

    from trainer_bridge import push_weights
    from trainer_bridge.distributed_target import DistributedTarget

    url, client = server
    box = {}
    long = {"max_new_tokens": 600, "temperature": 0, "ignore_eos": True}
    model = AutoModelForCausalLM.from_pretrained(models[1], dtype=torch.float32)
    started = client.get_server_info()["stats"]["num_decode_tokens"]
    t = threading.Thread(target=lambda: box.setdefault("out", client.generate(input_ids=PROMPTS[0],
                                                                              sampling_params=long)))
    t.start()
    while client.get_server_info()["stats"]["num_decode_tokens"] < started + 20:
        time.sleep(0.02)
    # Held mid-flight as the target itself holds it (a fast machine could otherwise finish the 600 tokens
    # before the push begins); the target's own in-place pause finds it paused, commits and continues.
    client.pause_generation("in_place")
    target = DistributedTarget(client, partial_rollouts=True, timeout_s=60)
    result = push_weights(model, target, version="mid").result
    target.close()
    t.join(120)
    assert result.success, result.message
    versions = box["out"][0].output_weight_versions
    assert versions[0] == "default" and versions[-1] == "mid" and len(versions) == 600
    switch = versions.index("mid")
    assert set(versions[:switch]) == {"default"} and set(versions[switch:]) == {"mid"}
    assert client.update_weights_from_disk(_a_copy(models), weight_version="default").success
