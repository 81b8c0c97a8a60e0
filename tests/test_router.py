"""The field's router (the real ``sglang-router`` and SMG binaries, a test extra) in front of two
``rollout serve`` replicas with an API key: /generate and the OpenAI routes through it give what each
replica gives directly; cache-aware routing brings a repeated prefix back to its replica's cache; slime's
abort drain through the router's /workers list; a weight push to every replica shows through the router."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from helpers import random_prompts

from rollout.server.router import launch_router, router_available

KEY = "router-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = random_prompts(300, [9, 14, 11, 7, 20, 5], seed=21)
KINDS = ["sglang-router", "smg"]


@pytest.fixture(scope="module")
def replicas(compat_model, module_servers):
    args = ("--dtype", "float32", "--kv-cache-tokens", "16384", "--api-key", KEY, "--served-model-name", "policy")
    return [module_servers(compat_model, *args), module_servers(compat_model, *args)]


@pytest.fixture(scope="module", params=KINDS)
def router(request, replicas, tmp_path_factory):
    if not router_available(request.param):
        pytest.fail(f"{request.param} is not installed: it is part of the test extra (pip install -e .[test])")
    log = tmp_path_factory.mktemp("router") / "router.log"
    r = launch_router([s.url for s in replicas], request.param, api_key=KEY, log_path=str(log))
    with httpx.Client(base_url=r.url, headers=AUTH, timeout=120) as http:
        yield http
    r.stop()


def _ok(r: httpx.Response) -> httpx.Response:
    assert r.status_code == 200, (r.request.url, r.status_code, r.text[:500])
    return r


def _generate(http, prompt, **extra):
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0}, **extra}
    out = _ok(http.post("/generate", json=body)).json()
    return out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]]


def test_generate_through_the_router_equals_each_replica(router, replicas):
    """Greedy tokens and logprobs through the router equal each replica's own, prompt by prompt (the
    router adds its fields to the body; we accept them)."""
    with httpx.Client(headers=AUTH, timeout=120) as direct:
        for p in PROMPTS:
            via = _generate(router, p)
            for s in replicas:
                ids, lps = _direct(direct, s.url, p)
                assert via[0] == ids
                assert via[1] == pytest.approx(lps, abs=1e-5)
    text = {"model": "policy", "prompt": "hello there", "max_tokens": 6, "temperature": 0}
    via = _ok(router.post("/v1/completions", json=text)).json()["choices"][0]["text"]
    assert via == _ok(httpx.post(replicas[0].url + "/v1/completions", json=text, headers=AUTH,
                                 timeout=60)).json()["choices"][0]["text"]
    chat = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    assert _ok(router.post("/v1/chat/completions", json=chat)).json()["choices"][0]["finish_reason"] in ("stop",
                                                                                                          "length")


def _direct(http, url, p):
    body = {"input_ids": p, "return_logprob": True, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    out = _ok(http.post(url + "/generate", json=body)).json()
    return out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]]


def test_cache_aware_routing_finds_the_cached_prefix(router):
    """A long shared prefix sent twice through the router (cache_aware policy) is served from the
    prefix cache the second time: the router sent it back to the replica that holds it."""
    prefix = random_prompts(300, [96], seed=77)[0]
    first = _ok(router.post("/generate", json={"input_ids": prefix + [5],
                                               "sampling_params": {"max_new_tokens": 1}})).json()
    second = _ok(router.post("/generate", json={"input_ids": prefix + [6],
                                                "sampling_params": {"max_new_tokens": 1}})).json()
    assert first["meta_info"]["cached_tokens"] == 0 or first["meta_info"]["cached_tokens"] < 96
    assert second["meta_info"]["cached_tokens"] >= 80


def test_slime_abort_drain_through_the_workers_list(router):
    """slime's abort: GET the router's /workers, then on each worker POST /abort_request {"abort_all": true}
    and poll GET /v1/loads?include=core until nothing runs; the long request that went through the router
    comes back with finish_reason abort and its partial output."""
    box: dict = {}

    def long_request():
        body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
        box["r"] = router.post("/generate", json=body)

    t = threading.Thread(target=long_request)
    t.start()
    urls = [w["url"] for w in _ok(router.get("/workers")).json()["workers"]]
    assert len(urls) == 2
    with httpx.Client(headers=AUTH, timeout=60) as http:
        deadline = time.monotonic() + 60
        while sum(http.get(u + "/v1/loads?include=core").json()["loads"][0]["num_running_reqs"] for u in urls) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for u in urls:
            _ok(http.post(u + "/abort_request", json={"abort_all": True}))
        for u in urls:
            while http.get(u + "/v1/loads?include=core").json()["loads"][0]["num_total_reqs"]:
                time.sleep(0.05)
    t.join(60)
    out = box["r"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < 3000


def test_router_polls_our_load(router, replicas):
    """The routers balance by SGLang's /get_load (they sum num_tokens)."""
    with httpx.Client(headers=AUTH, timeout=30) as http:
        load = _ok(http.get(replicas[0].url + "/get_load")).json()
    assert isinstance(load, list) and {"num_tokens", "num_reqs", "num_waiting_reqs"} <= set(load[0])


def test_a_push_to_every_replica_shows_through_the_router(router, replicas, compat_model, compat_model_b):
    """The scale-out recipe: the trainer updates every replica (here from disk), then rollouts through
    the router run on the new weights, whichever replica serves them."""
    before = [_generate(router, p)[0] for p in PROMPTS[:3]]
    with httpx.Client(headers=AUTH, timeout=120) as http:
        for s in replicas:
            _ok(http.post(s.url + "/update_weights_from_disk", json={"model_path": compat_model_b, "weight_version": "b"}))
        after = [_generate(router, p)[0] for p in PROMPTS[:3]]
        direct = [_direct(http, replicas[1].url, p)[0] for p in PROMPTS[:3]]
        for s in replicas:
            _ok(http.post(s.url + "/update_weights_from_disk", json={"model_path": compat_model, "weight_version": "a"}))
    assert after == direct and after != before
