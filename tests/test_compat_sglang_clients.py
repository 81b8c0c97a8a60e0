"""The RL frameworks' own requests, replayed exactly as ``../shared/docs/CLIENTS.md`` records them from
their source, against a real ``rollout serve``: each test names the framework and the call, sends its
body as the framework does, and checks the value and type of every field that framework reads back.

Covered here: the generation bodies (slime, miles, AReaL, legacy SkyRL, veRL's adapter, the router's
additions), the control calls around a weight update (pause, flush polling, abort drains, version,
server info), and the refusals a drop-in owes its clients (pickled tensors, features we do not have)."""

from __future__ import annotations

import base64
import json
import threading
import time

import pytest
from helpers import random_prompts

KEY = "compat-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _post(http, path, body=None, **kw):
    r = http.post(path, json=body, **kw)
    assert r.status_code == 200, (path, r.status_code, r.text)
    return r


def _triples(entries, ids=None):
    """SGLang's logprob entries: [float, int, str|None] each (veRL unpacks exactly three)."""
    for entry in entries:
        assert isinstance(entry, list) and len(entry) == 3, entry
        assert isinstance(entry[0], float) and isinstance(entry[1], int) and entry[2] is None, entry
    if ids is not None:
        assert [e[1] for e in entries] == ids


PROMPTS = random_prompts(300, [7, 12], seed=3)


# ---------------------------------------------------------------------------------------------- slime


def test_slime_generate_body_and_what_it_reads(compat_srv):
    """slime's /generate (``sglang_rollout.generate``): explicit nulls, no_stop_trim, spaces_between_special_tokens,
    custom_params (top-p replay) and sampling_seed; it reads text, output_token_logprobs (item[0], item[1]),
    finish_reason.type, weight_version, cached_tokens and prompt_tokens."""
    body = {"input_ids": PROMPTS[0],
            "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 16, "stop": None,
                                "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
                                "spaces_between_special_tokens": False,
                                "custom_params": {"return_top_p_token_ids": True}, "sampling_seed": 1234},
            "return_logprob": True}
    out = _post(compat_srv, "/generate", body).json()
    meta = out["meta_info"]
    assert isinstance(out["text"], str)
    _triples(meta["output_token_logprobs"], out["output_ids"])
    assert meta["finish_reason"]["type"] in ("stop", "length")
    if meta["finish_reason"]["type"] == "length":
        assert meta["finish_reason"]["length"] == len(out["output_ids"]) == 16
    assert isinstance(meta["weight_version"], str) and isinstance(meta["cached_tokens"], int)
    assert meta["prompt_tokens"] == len(PROMPTS[0]) and meta["completion_tokens"] == len(out["output_ids"])
    # sampling_seed is SGLang's name for the seed: the same draw as our own name gives
    ours = {"temperature": 1.0, "max_new_tokens": 16, "seed": 1234, "skip_special_tokens": False}
    assert _post(compat_srv, "/generate", {"input_ids": PROMPTS[0], "sampling_params": ours}).json()["output_ids"] == \
        out["output_ids"]


def test_slime_streaming_is_cumulative(compat_srv):
    """slime's streaming rollout parses each chunk's text and output_token_logprobs as cumulative."""
    body = {"input_ids": PROMPTS[1], "stream": True, "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "stop": None, "no_stop_trim": True}}
    with compat_srv.stream("POST", "/generate", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    whole = _post(compat_srv, "/generate", {**body, "stream": False}).json()
    assert chunks[-1]["output_ids"] == whole["output_ids"] and chunks[-1]["text"] == whole["text"]
    lengths = [len(c["meta_info"]["output_token_logprobs"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 8  # each chunk holds everything so far
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_slime_teacher_logprobs_by_prefill(compat_srv):
    """slime's on-policy distillation: max_new_tokens 0, logprob_start_len 0; it reads
    input_token_logprobs[1:], item[0] of each (the first entry's logprob is null and dropped)."""
    seq = PROMPTS[0] + PROMPTS[1]
    body = {"input_ids": seq, "sampling_params": {"temperature": 1.0, "max_new_tokens": 0, "skip_special_tokens": False},
            "return_logprob": True, "logprob_start_len": 0}
    meta = _post(compat_srv, "/generate", body).json()["meta_info"]
    entries = meta["input_token_logprobs"]
    assert len(entries) == len(seq) and entries[0][0] is None and [e[1] for e in entries] == seq
    _triples(entries[1:])


def test_slime_abort_drain_through_v1_loads(compat_srv):
    """slime's end-of-step abort: POST /abort_request {"abort_all": true} (an empty body back), then
    GET /v1/loads?include=core until the request count is 0; the aborted request comes back with
    finish_reason.type "abort" and its partial output_token_logprobs."""
    box = {}
    body = {"input_ids": PROMPTS[0], "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 3000, "ignore_eos": True}}
    t = threading.Thread(target=lambda: box.setdefault("r", compat_srv.post("/generate", json=body)))
    t.start()
    deadline = time.monotonic() + 30
    while compat_srv.get("/v1/loads", params={"include": "core"}).json()["loads"][0]["num_total_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.2)
    r = compat_srv.post("/abort_request", json={"abort_all": True})
    assert r.status_code == 200 and r.content == b""
    while True:
        loads = compat_srv.get("/v1/loads", params={"include": "core"}).json()["loads"]
        if sum(x["num_running_reqs"] + x["num_waiting_reqs"] for x in loads) == 0:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t.join(30)
    out = box["r"].json()
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["finish_reason"]["message"]
    assert 0 < len(out["output_ids"]) < 3000
    _triples(meta["output_token_logprobs"], out["output_ids"])


def test_slime_update_bracket_controls(compat_srv):
    """slime's bracket around an update: pause {} (SGLang's default mode: abort), GET /flush_cache polled
    until 200 (400 while requests run, plain text), continue {}; every control answer is JSON."""
    box = {}
    body = {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    t = threading.Thread(target=lambda: box.setdefault("r", compat_srv.post("/generate", json=body)))
    t.start()
    while compat_srv.get("/v1/loads").json()["loads"][0]["num_running_reqs"] == 0:
        time.sleep(0.02)
    busy = compat_srv.get("/flush_cache")
    assert busy.status_code == 400 and "not flushed" in busy.text
    r = _post(compat_srv, "/pause_generation", {})
    assert isinstance(r.json(), dict)
    t.join(30)
    assert box["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"  # paused in abort mode
    for _ in range(60):
        r = compat_srv.get("/flush_cache")
        if r.status_code == 200:
            break
        time.sleep(0.1)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert isinstance(_post(compat_srv, "/continue_generation", {}).json(), dict)
    assert _post(compat_srv, "/generate", {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}).json()


def test_slime_external_engine_server_info(compat_srv):
    """slime's external-engine mode: GET /server_info (falling back to /get_server_info) and reads the
    parallel layout and the fields it compares with its launch arguments."""
    for path in ("/server_info", "/get_server_info"):
        info = compat_srv.get(path).json()
        assert info["tp_size"] == info["tensor_parallel_size"] == 1
        assert info["pp_size"] == 1 and info["ep_size"] == 1 and info["moe_dp_size"] == 1
        assert info["enable_memory_saver"] is False and info["disaggregation_mode"] == "null"
        assert info["dtype"] == "float32" and info["enable_return_routed_experts"] is False
        assert isinstance(info["num_gpus"], int)


def test_colocated_payloads_that_are_not_tensor_handles_are_refused(compat_srv):
    """slime, miles and veRL send base64 pickles (MultiprocessingSerializer) to /update_weights_from_tensor; they
    are read by an allowlist (tests/test_tensor_handles.py); bytes that are no pickle are a 400 naming it."""
    blob = base64.b64encode(b"\x80\x04not really a pickle").decode()
    for body in ({"serialized_named_tensors": [blob], "load_format": "flattened_bucket", "flush_cache": False,
                  "weight_version": "3"},
                 {"serialized_named_tensors": [blob], "load_format": None, "flush_cache": True}):
        r = compat_srv.post("/update_weights_from_tensor", json=body)
        assert r.status_code == 400 and "malformed tensor-handle payload" in r.text, r.text


# ---------------------------------------------------------------------------------------------- miles


def test_miles_generate_and_prefill_recompute(compat_srv):
    """miles always sends return_routed_experts: false and return_indexer_topk: false (an sglang-miles
    field); its logprob recompute is a batched prefill (input_ids a list of lists, logprob_start_len
    prompt_len - 1) that checks item[1] against the response tokens and that no item[0] is null."""
    body = {"input_ids": PROMPTS[0], "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "no_stop_trim": True,
                                                         "spaces_between_special_tokens": False, "stop": None,
                                                         "stop_token_ids": None, "skip_special_tokens": False,
                                                         "top_p": 1.0, "top_k": -1},
            "return_logprob": True, "return_routed_experts": False, "return_indexer_topk": False}
    out = _post(compat_srv, "/generate", body).json()
    response = out["output_ids"]
    seqs = [PROMPTS[0] + response, PROMPTS[0] + response]
    recompute = {"input_ids": seqs, "sampling_params": {"max_new_tokens": 0, "temperature": 0,
                                                        "skip_special_tokens": False},
                 "return_logprob": True, "logprob_start_len": len(PROMPTS[0]) - 1}
    items = _post(compat_srv, "/generate", recompute).json()
    assert isinstance(items, list) and len(items) == 2
    for item in items:
        tail = item["meta_info"]["input_token_logprobs"][-len(response):]
        assert [e[1] for e in tail] == response and all(e[0] is not None for e in tail)
        got = [e[0] for e in tail]
        want = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=2e-4)  # the recompute scores what generation drew


def test_miles_version_and_prefix_abort(compat_srv):
    """miles: /update_weight_version {"new_version", "abort_all_requests": false}; /model_info then
    /get_weight_version; the multi-LoRA abort {"rid": prefix, "prefix": true} aborts by id prefix."""
    r = _post(compat_srv, "/update_weight_version", {"new_version": "7", "abort_all_requests": False}).json()
    assert r["success"] is True and r["new_version"] == "7"
    assert compat_srv.get("/model_info").json()["weight_version"] == "7"
    assert compat_srv.get("/get_weight_version").json() == {"weight_version": "7"}
    box = {}
    long = {"sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    runs = [threading.Thread(target=lambda rid=rid: box.setdefault(rid, compat_srv.post(
        "/generate", json={"input_ids": PROMPTS[0], "rid": rid, **long}))) for rid in ("lora-a-1", "lora-a-2", "keep-1")]
    for t in runs:
        t.start()
    while compat_srv.get("/v1/loads").json()["loads"][0]["num_running_reqs"] < 3:
        time.sleep(0.02)
    assert compat_srv.post("/abort_request", json={"rid": "lora-a-", "prefix": True}).status_code == 200
    for t in runs[:2]:
        t.join(30)
    assert box["lora-a-1"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert box["lora-a-2"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert runs[2].is_alive()  # another prefix runs on
    assert compat_srv.post("/abort_request", json={"rid": "", "abort_all": False}).status_code == 200  # veRL: a no-op
    assert runs[2].is_alive()
    compat_srv.post("/abort_request", json={"rid": "keep-1"})
    runs[2].join(30)
    _post(compat_srv, "/update_weight_version", {"new_version": "default"})


# ---------------------------------------------------------------------------------------------- AReaL


def test_areal_generate_body(compat_srv, compat_tok):
    """AReaL's /generate: image_data [] (its default), top_k 1e8, stop_token_ids (eos + pad),
    frequency_penalty 0.0, stream false; it reads finish_reason.type and .message, output_token_logprobs,
    prompt_tokens and completion_tokens (text is not read)."""
    body = {"input_ids": PROMPTS[1], "image_data": [],
            "sampling_params": {"top_p": 1.0, "top_k": 100000000, "max_new_tokens": 10, "temperature": 0.0,
                                "stop_token_ids": [compat_tok.eos_token_id,
                                                   compat_tok.pad_token_id or compat_tok.eos_token_id],
                                "ignore_eos": False, "skip_special_tokens": True, "frequency_penalty": 0.0},
            "return_logprob": True, "stream": False}
    out = _post(compat_srv, "/generate", body).json()
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] in ("stop", "length") and isinstance(meta["finish_reason"].get("message", ""), str)
    _triples(meta["output_token_logprobs"], out["output_ids"])
    assert meta["prompt_tokens"] == len(PROMPTS[1]) and meta["completion_tokens"] == len(out["output_ids"])
    greedy = {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    assert _post(compat_srv, "/generate", greedy).json()["output_ids"][:len(out["output_ids"])] == out["output_ids"]


def test_areal_abort_before_prefill_says_so(compat_srv):
    """AReaL reads a finish_reason.message starting "Abort before prefill" as "no token was generated"."""
    _post(compat_srv, "/pause_generation", {"mode": "in_place"})
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", compat_srv.post("/generate", json={
        "input_ids": PROMPTS[0], "image_data": [], "sampling_params": {"max_new_tokens": 5}, "return_logprob": True})))
    t.start()
    while compat_srv.get("/v1/loads").json()["loads"][0]["num_waiting_reqs"] == 0:
        time.sleep(0.02)
    compat_srv.post("/abort_request", json={"abort_all": True})
    t.join(30)
    _post(compat_srv, "/continue_generation", {})
    meta = box["r"].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["finish_reason"]["message"].startswith("Abort before prefill")
    assert meta["output_token_logprobs"] == []


# ---------------------------------------------------------------------------------------------- SkyRL, veRL, router


def test_legacy_skyrl_batched_generate_is_a_list(compat_srv):
    """Legacy SkyRL: batched /generate without return_logprob; reads output_ids and finish_reason.type
    from a JSON list."""
    body = {"input_ids": PROMPTS, "sampling_params": {"skip_special_tokens": True, "no_stop_trim": True,
                                                      "max_new_tokens": 5, "temperature": 0.0, "top_p": 1.0,
                                                      "top_k": -1, "min_p": 0.0}}
    items = _post(compat_srv, "/generate", body).json()
    assert isinstance(items, list) and len(items) == 2
    assert all(isinstance(i["output_ids"], list) and i["meta_info"]["finish_reason"]["type"] for i in items)


def test_legacy_skyrl_one_tensor_updates_apply(compat_srv, compat_model, compat_model_b):
    """Legacy SkyRL's weight sync: /init_weights_update_group (override_existing), then one
    /update_weights_from_distributed {"name", "dtype", "shape"} per tensor (SGLang's older schema, each applied
    as it arrives) with its broadcast, then POST /flush_cache: model B serves. A malformed one-tensor body is a
    400 naming the fields."""
    url = str(compat_srv.base_url).rstrip("/")
    before = _greedy(compat_srv)
    out = _push(url, compat_model_b, "weight_update_group", one_tensor=True)
    assert all(status == 200 and r["success"] for status, r in out["buckets"]), out["buckets"]
    assert out["flush"] == 200
    assert compat_srv.post("/destroy_weights_update_group").status_code == 200  # its teardown: no body
    pushed = _greedy(compat_srv)
    assert pushed != before
    _post(compat_srv, "/update_weights_from_disk", {"model_path": compat_model_b, "weight_version": "b"})
    assert _greedy(compat_srv) == pushed
    _post(compat_srv, "/update_weights_from_disk", {"model_path": compat_model, "weight_version": "default"})
    r = compat_srv.post("/update_weights_from_distributed", json={"name": "lm_head.weight", "dtype": 5, "shape": 3})
    assert r.status_code == 400 and "one-tensor body" in r.text


def test_per_prompt_sampling_params_in_one_batch(compat_srv):
    """SGLang takes a list of sampling_params, one per prompt, in a batched /generate."""
    body = {"input_ids": PROMPTS, "sampling_params": [{"max_new_tokens": 2, "temperature": 0},
                                                      {"max_new_tokens": 5, "temperature": 0}]}
    items = _post(compat_srv, "/generate", body).json()
    assert [len(i["output_ids"]) for i in items] == [2, 5]


def test_what_the_router_adds_is_accepted(compat_srv, compat_tok):
    """sglang-router forwards /generate with model null, return_text_in_logprobs, return_hidden_states,
    return_entropy, return_bytes, log_metrics, no_logs and background; return_text_in_logprobs fills
    each entry's text as SGLang does (the token decoded alone)."""
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True,
            "top_logprobs_num": 2, "model": None, "return_text_in_logprobs": True, "return_hidden_states": False,
            "return_entropy": False, "return_bytes": False, "log_metrics": True, "no_logs": False, "background": False,
            "stream": False, "rid": None, "lora_path": None, "data_parallel_rank": None}
    out = _post(compat_srv, "/generate", body).json()
    for _lp, token, text in out["meta_info"]["output_token_logprobs"]:
        assert text == compat_tok.decode([token])
    for top in out["meta_info"]["output_top_logprobs"]:
        assert len(top) == 2 and all(text == compat_tok.decode([t]) for _, t, text in top)


@pytest.mark.parametrize("field, value, says", [
    ("image_data", ["data:image/png;base64,AAAA"], "multimodal"),
    ("return_hidden_states", True, "hidden states"),
    ("return_routed_experts", True, "routed experts"),
    ("lora_path", "adapter-v1", "no LoRA adapter of that name is loaded"),  # served once loaded (test_lora.py)
    ("lora_id", 3, "lora_path"),
    ("custom_logit_processor", "x", "custom logit processors"),
    ("session_params", {"id": "s", "rid": "turn-1"}, "linear"),
])
def test_features_we_do_not_have_are_refused_naming_them(compat_srv, field, value, says):
    r = compat_srv.post("/generate", json={"input_ids": PROMPTS[0], field: value})
    assert r.status_code == 400 and field in r.text and says in r.text


@pytest.mark.parametrize("sampling, says", [
    ({"regex": "a+"}, "constrained decoding"),
    ({"json_schema": "{}"}, "constrained decoding"),
    ({"stop_regex": "x"}, "stop regexes"),
    ({"made_up": 1}, "unknown sampling parameter"),
])
def test_sampling_fields_we_do_not_have_are_refused(compat_srv, sampling, says):
    r = compat_srv.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": sampling})
    assert r.status_code == 400 and says in r.text


# ---------------------------------------------------------------------------------------------- weight pushes


def _sglang_trainer(url: str, compat_model_b: str, port: int, group: str, plan: dict, q) -> None:
    """A trainer process that does what slime's (and AReaL's) does: forms the weight group with
    SGLang's ``init_custom_process_group`` recipe — torch's rendezvous, the store prefixed with the
    group's name, torch's own process-group helper — while the server joins over
    /init_weights_update_group, then pushes buckets with one broadcast per tensor in the body's order."""
    import datetime
    import threading as th

    import httpx as hx
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    torch.set_num_threads(1)
    out: dict = {}
    try:
        with hx.Client(base_url=url, headers=AUTH, timeout=120) as http:
            init = {"master_address": "127.0.0.1", "master_port": str(port), "rank_offset": 1, "world_size": 2,
                    "group_name": group, "backend": "gloo", "pp_rank": 0, "override_existing": False}
            t = th.Thread(target=lambda: out.setdefault("init", http.post("/init_weights_update_group", json=init)))
            t.start()
            timeout = datetime.timedelta(seconds=60)
            store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=timeout))
            store.set_timeout(timeout)
            pg, _ = _new_process_group_helper(2, 0, [], "gloo", PrefixStore(group, store), group_name=group,
                                              timeout=timeout)
            _world.pg_group_ranks[pg] = {0: 0, 1: 1}
            t.join()
            out["init_status"] = out.pop("init").status_code
            tensors = [(n, v.float()) for n, v in load_file(f"{compat_model_b}/model.safetensors").items()]
            if plan.get("pause"):
                out["pause"] = http.post("/pause_generation", json=plan.get("pause_body", {})).status_code
                for _ in range(60):
                    if http.get("/flush_cache").status_code == 200:
                        break
            if plan.get("miles"):  # miles' bracket (sglang-miles): begin, plain bucket calls, version, end
                out["begin"] = http.post("/begin_weight_update", json={"selector": "all"}).json()
            buckets = [tensors[i::3] for i in range(3)]  # slime's buckets, each a part of the model
            if plan.get("one_tensor"):  # legacy SkyRL: a request per tensor, SGLang's older one-tensor schema
                buckets = [[t] for t in tensors]
            out["buckets"] = []
            for bucket in buckets:
                body = {"names": [n for n, _ in bucket], "dtypes": ["float32"] * len(bucket),
                        "shapes": [list(v.shape) for _, v in bucket], "group_name": group, **plan.get("body", {})}
                if plan.get("one_tensor"):  # no group name: SGLang's default group
                    body = {"name": bucket[0][0], "dtype": "float32", "shape": list(bucket[0][1].shape)}
                box: dict = {}
                call = th.Thread(target=lambda b=body: box.setdefault("r", http.post(
                    "/update_weights_from_distributed", json=b)))
                call.start()
                for name, v in bucket:
                    wire = v.to(plan["wrong_dtype"]) if name == plan.get("wrong_name") else v
                    dist.broadcast(wire, src=0, group=pg)
                call.join()
                out["buckets"].append((box["r"].status_code, box["r"].json()))
            if plan.get("miles"):
                out["version"] = http.post("/update_weight_version", json={"new_version": "4",
                                                                           "abort_all_requests": False}).json()
                out["end"] = http.post("/end_weight_update", json={}).json()
            if plan.get("pause"):
                r = http.post("/continue_generation", json={})
                out["continue"] = (r.status_code, r.json())
            if plan.get("one_tensor"):
                out["flush"] = http.post("/flush_cache").status_code
        dist.destroy_process_group(pg)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["error"] = repr(exc)
    q.put(out)


def _push(url, compat_model_b, group, **plan):
    import multiprocessing as mp

    from weight_sync.process_group import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_sglang_trainer, args=(url, compat_model_b, free_port(), group, plan, q))
    proc.start()
    out = q.get(timeout=180)
    proc.join(30)
    assert "error" not in out, out
    return out


def _greedy(http):
    body = {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    return [i["output_ids"] for i in _post(http, "/generate", body).json()]


def test_slime_and_areal_push_into_a_group_formed_their_way(compat_srv, compat_model, compat_model_b):
    """slime's update: pause {}, GET /flush_cache until 200, three bucket calls each carrying a part of
    the model (flush_cache false, weight_version "3") with one broadcast per tensor, continue {}: the
    calls are staged while paused and published together at continue — model B's greedy tokens under
    version "3". AReaL's (abort_all_requests, no version) then lands under the server's next version."""
    url = str(compat_srv.base_url).rstrip("/")
    before = _greedy(compat_srv)
    out = _push(url, compat_model_b, "slime-pp_0", pause=True,
                body={"flush_cache": False, "weight_version": "3"})
    assert out["init_status"] == 200 and out["pause"] == 200
    assert all(status == 200 and r["success"] for status, r in out["buckets"]), out["buckets"]
    assert out["continue"][0] == 200 and out["continue"][1]["weight_version"] == "3"
    pushed = _greedy(compat_srv)
    assert pushed != before and compat_srv.get("/get_weight_version").json()["weight_version"] == "3"
    _post(compat_srv, "/update_weights_from_disk", {"model_path": compat_model_b, "weight_version": "b-from-disk"})
    assert _greedy(compat_srv) == pushed  # the push delivered model B exactly
    _post(compat_srv, "/update_weights_from_disk", {"model_path": compat_model, "weight_version": "default"})
    assert _greedy(compat_srv) == before
    out = _push(url, compat_model_b, "update_weight_group", pause=True, body={"abort_all_requests": True})
    assert all(status == 200 for status, _ in out["buckets"]) and out["continue"][0] == 200
    assert _greedy(compat_srv) == pushed
    _post(compat_srv, "/update_weights_from_disk", {"model_path": compat_model, "weight_version": "default"})


def test_slime_and_miles_weights_checker(compat_srv, compat_model, compat_model_b):
    """/weights_checker (check mode): snapshot, compare equal; after a push of other weights compare answers 400
    with success false; back on the snapshot's weights it matches again. reset_tensors is refused, saying why."""
    assert _post(compat_srv, "/weights_checker", {"action": "snapshot"}).json()["success"] is True
    r = _post(compat_srv, "/weights_checker", {"action": "compare", "allow_quant_error": False, "selector": "all",
                                        "skip_tensor_list": []}).json()
    assert r["success"] is True
    _post(compat_srv, "/update_weights_from_disk", {"model_path": compat_model_b})
    r = compat_srv.post("/weights_checker", json={"action": "compare"})
    assert r.status_code == 400 and r.json()["success"] is False
    _post(compat_srv, "/update_weights_from_disk", {"model_path": compat_model, "weight_version": "default"})
    assert _post(compat_srv, "/weights_checker", {"action": "compare"}).json()["success"] is True
    r = compat_srv.post("/weights_checker", json={"action": "reset_tensors"})
    assert r.status_code == 400 and "snapshot" in r.text


def test_miles_bracket_stages_until_end_weight_update(compat_srv, compat_model, compat_model_b):
    """miles: pause {"mode": "retract"}, GET /flush_cache, /begin_weight_update {"selector": "all"}, bucket
    calls with "selector" (plain: no transaction flag), /update_weight_version {"new_version"}, /end_weight_update,
    continue: the buckets stage inside the bracket and land together at its end."""
    url = str(compat_srv.base_url).rstrip("/")
    before = _greedy(compat_srv)
    out = _push(url, compat_model_b, "miles-g", pause=True, pause_body={"mode": "retract"}, miles=True,
                body={"flush_cache": False, "weight_version": "4", "selector": "all"})
    assert out["begin"]["success"] and out["end"]["success"], out
    assert all(status == 200 and r["success"] for status, r in out["buckets"]), out["buckets"]
    assert out["version"]["new_version"] == "4" and out["continue"][0] == 200
    assert _greedy(compat_srv) != before and compat_srv.get("/get_weight_version").json()["weight_version"] == "4"
    _post(compat_srv, "/update_weights_from_disk", {"model_path": compat_model, "weight_version": "default"})


def test_a_broadcast_of_another_dtype_than_announced_fails_and_says_which(compat_srv, compat_model, compat_model_b):
    """A sender that announces float32 but broadcasts one tensor in bfloat16 (half the bytes) or in
    float64 (twice): the update fails naming the tensor and what differed, the rest of the push is still
    drained (the sender completes), and the old weights keep serving."""
    url = str(compat_srv.base_url).rstrip("/")
    before = _greedy(compat_srv)
    name = "model.layers.0.mlp.up_proj.weight"
    for wrong, says in ((torch_dtype("bfloat16"), "fewer bytes"), (torch_dtype("float64"), "more bytes")):
        out = _push(url, compat_model_b, f"bad-{says[:4]}", pause=False, wrong_name=name, wrong_dtype=wrong,
                    body={"partial": True})
        failed = [r for status, r in out["buckets"] if status != 200]
        assert len(failed) == 1 and not failed[0]["success"], out["buckets"]
        assert name in failed[0]["message"] and says in failed[0]["message"]
        _post(compat_srv, "/update_weights_from_disk", {"model_path": compat_model, "weight_version": "default"})
        assert _greedy(compat_srv) == before


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def test_a_transaction_left_open_never_swallows_a_later_push(compat_srv, compat_model, compat_model_b):
    """A vLLM-style /start_weight_update whose client gave up, then slime's sequence (pause, bucket calls with
    their broadcasts, continue): slime's push is published (model B, its version) — the stale transaction was
    aborted by its first bucket call, and its owner's late /finish_weight_update is a 400, not a publish.
    A miles bracket left open (/begin_weight_update, same protocol family): slime's calls stage into it, and
    /continue_generation answers 400 naming it instead of success (nothing published), until it is aborted."""
    url = str(compat_srv.base_url).rstrip("/")
    before = _greedy(compat_srv)
    assert _post(compat_srv, "/start_weight_update", {"is_checkpoint_format": True}).status_code == 200
    out = _push(url, compat_model_b, "stale-1", pause=True, body={"flush_cache": False, "weight_version": "s1"})
    assert all(status == 200 for status, _ in out["buckets"]), out["buckets"]
    assert out["continue"][0] == 200 and out["continue"][1]["weight_version"] == "s1", out["continue"]
    pushed = _greedy(compat_srv)
    assert pushed != before and compat_srv.get("/get_weight_version").json()["weight_version"] == "s1"
    late = compat_srv.post("/finish_weight_update", json={"weight_version": "stale"})
    assert late.status_code == 400 and "no weight update to finish" in late.text
    _post(compat_srv, "/update_weights_from_disk", {"model_path": compat_model, "weight_version": "default"})
    assert _post(compat_srv, "/begin_weight_update", {"selector": "all"}).status_code == 200
    out = _push(url, compat_model_b, "stale-2", pause=True, body={"flush_cache": False, "weight_version": "s2"})
    status, answer = out["continue"]
    assert status == 400 and "begin_weight_update" in answer["message"] and "still open" in answer["message"], answer
    assert _greedy(compat_srv) == before  # nothing published, generation continued
    assert compat_srv.get("/get_weight_version").json()["weight_version"] == "default"
    assert _post(compat_srv, "/abort_weight_update", {}).status_code == 200
    ok = compat_srv.post("/continue_generation", json={})
    assert ok.status_code == 200 and ok.json()["success"] is True


def test_transaction_calls_run_in_the_order_they_arrive(compat_srv, compat_model):
    """A /start_weight_update queued in the engine behind an update waiting for its quiet point (a long
    generation running), and a /finish_weight_update sent after it: the finish runs after the start (200,
    published), not before it (it used to answer "nothing to finish" and leave the transaction open)."""
    import threading

    box: dict = {}
    long = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 1500, "temperature": 1.0,
                                                          "ignore_eos": True}}
    calls = [("gen", "/generate", long),
             ("disk", "/update_weights_from_disk", {"model_path": compat_model, "weight_version": "default"}),
             ("start", "/start_weight_update", {"is_checkpoint_format": True})]
    threads = []
    for key, path, body in calls:
        threads.append(threading.Thread(target=lambda k=key, p=path, b=body: box.setdefault(k, compat_srv.post(
            p, json=b))))
        threads[-1].start()
        time.sleep(0.3)
    finish = compat_srv.post("/finish_weight_update", json={"weight_version": "ordered"})
    for t in threads:
        t.join()
    assert all(box[k].status_code == 200 for k in box), {k: r.text[:200] for k, r in box.items()}
    assert finish.status_code == 200, finish.text
    assert compat_srv.get("/get_weight_version").json()["weight_version"] == "ordered"
    assert compat_srv.post("/finish_weight_update", json={}).status_code == 400  # nothing left open
    _post(compat_srv, "/update_weight_version", {"new_version": "default", "abort_all_requests": False})
