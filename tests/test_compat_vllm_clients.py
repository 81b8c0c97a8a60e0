"""The vLLM-side frameworks' requests (prime-rl, SkyRL, TRL's async GRPO and ``trl vllm-serve``, AReaL's
vLLM backend), replayed as ``../shared/docs/CLIENTS.md`` records them against a real ``rollout serve``,
checking every field each one reads back; and their weight pushes from a trainer process that builds its
side of the group with plain ``torch.distributed`` (vLLM's own trainer side and TRL's need vLLM's
PyNccl: the protocol is the same, over gloo)."""

from __future__ import annotations

import math
import multiprocessing as mp
import time

import httpx
import pytest
from helpers import random_prompts

KEY = "vllm-compat-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = random_prompts(300, [9, 14, 11, 7], seed=11)


def _ok(r: httpx.Response) -> httpx.Response:
    assert r.status_code == 200, (r.request.url, r.status_code, r.text)
    return r


def _tokens(http, ids, cache_salt=None, **sampling):
    body = {"model": "m", "token_ids": ids, "sampling_params": {"max_tokens": 8, "temperature": 0.0, **sampling},
            "cache_salt": cache_salt}
    return _ok(http.post("/inference/v1/generate", json=body)).json()


def _greedy(http):
    return [_tokens(http, p)["choices"][0]["token_ids"] for p in PROMPTS]


def _restore(http, compat_model):
    _ok(http.post("/update_weights_from_disk", json={"model_path": compat_model, "weight_version": "default"}))


# ---------------------------------------------------------------------------------------------- generation


def test_skyrl_inference_generate_reads_token_ids_finish_reason_and_logprobs(compat_srv):
    """SkyRL's /inference/v1/generate (vLLM keys, cache_salt, X-Session-ID): choices[0].token_ids,
    finish_reason (a string) and logprobs.content[i].logprob — the same tokens and logprobs as /generate."""
    body = {"sampling_params": {"min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True,
                                "max_tokens": 12, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                "logprobs": 0, "stop": None},
            "model": "m", "token_ids": PROMPTS[0], "cache_salt": "3"}
    out = _ok(compat_srv.post("/inference/v1/generate", json=body, headers={"X-Session-ID": "episode-1"})).json()
    choice = out["choices"][0]
    assert isinstance(out["request_id"], str) and out["prompt_logprobs"] is None
    assert choice["finish_reason"] in ("stop", "length") and len(choice["token_ids"]) == 12
    content = choice["logprobs"]["content"]
    assert len(content) == 12 and all(isinstance(c["logprob"], float) and c["top_logprobs"] == [] for c in content)
    ref = _ok(compat_srv.post("/generate", json={"input_ids": PROMPTS[0], "return_logprob": True,
                                          "sampling_params": {"max_new_tokens": 12, "temperature": 0}})).json()
    assert choice["token_ids"] == ref["output_ids"]
    assert [c["logprob"] for c in content] == pytest.approx([e[0] for e in ref["meta_info"]["output_token_logprobs"]],
                                                            abs=1e-5)
    two = _tokens(compat_srv, PROMPTS[0], n=2, temperature=1.0, seed=7, logprobs=2)
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert all(len(c["top_logprobs"]) == 2 for c in two["choices"][0]["logprobs"]["content"])


def test_prime_rl_prefill_scoring_reads_prompt_logprobs(compat_srv):
    """prime-rl scores by prefill: max_tokens 1, prompt_logprobs 1 -> prompt_logprobs[i] is null for the
    first token, else {token_id: {"logprob": ...}} holding the prompt's own token (the same logprob as
    SGLang's input_token_logprobs)."""
    ids = PROMPTS[1]
    out = _tokens(compat_srv, ids, max_tokens=1, temperature=1.0, top_p=1.0, prompt_logprobs=1)
    plp = out["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    ref = _ok(compat_srv.post("/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                                          "sampling_params": {"max_new_tokens": 1}})).json()
    want = [e[0] for e in ref["meta_info"]["input_token_logprobs"][1:]]
    got = [plp[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]
    assert got == pytest.approx(want, abs=1e-5)
    assert all(1 <= len(entry) <= 2 for entry in plp[1:])  # the prompt token and the top-1


def test_tokenize_detokenize_and_models(compat_srv, compat_tok):
    """/tokenize (a prompt, or chat messages), /detokenize; /v1/models' id and max_model_len (TRL async)."""
    out = _ok(compat_srv.post("/tokenize", json={"model": "m", "prompt": "hello world", "add_special_tokens": False})).json()
    assert out["tokens"] == compat_tok.encode("hello world", add_special_tokens=False) and out["count"] == len(out["tokens"])
    assert isinstance(out["max_model_len"], int) and out["max_model_len"] > 0
    assert _ok(compat_srv.post("/detokenize", json={"tokens": out["tokens"]})).json()["prompt"] == "hello world"
    listed = _ok(compat_srv.get("/v1/models")).json()["data"][0]
    assert isinstance(listed["id"], str) and listed["max_model_len"] == out["max_model_len"]
    assert compat_srv.post("/detokenize", json={"tokens": [10 ** 9]}).status_code == 400


def test_areal_vllm_completions_return_tokens_as_token_ids(compat_srv):
    """AReaL's vLLM backend: /v1/completions with token ids and return_tokens_as_token_ids reads
    choices[0].logprobs.tokens as "token_id:N" strings and token_logprobs."""
    body = {"prompt": PROMPTS[2], "top_p": 1.0, "top_k": 100000000, "max_tokens": 6, "temperature": 0.0,
            "stop_token_ids": [], "ignore_eos": False, "skip_special_tokens": True,
            "return_tokens_as_token_ids": True, "logprobs": 0, "use_beam_search": False, "stream": False}
    choice = _ok(compat_srv.post("/v1/completions", json=body)).json()["choices"][0]
    ids = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    ref = _ok(compat_srv.post("/generate", json={"input_ids": PROMPTS[2],
                                          "sampling_params": {"max_new_tokens": 6, "temperature": 0}})).json()
    assert ids == ref["output_ids"] and len(choice["logprobs"]["token_logprobs"]) == 6


def test_cache_salt_partitions_the_prefix_cache(compat_srv):
    """Requests share cached KV only within one salt (vLLM's cache_salt, SGLang's extra_key)."""
    prompt = random_prompts(300, [64], seed=99)[0]

    def cached(**salt):
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}, **salt}
        return _ok(compat_srv.post("/generate", json=body)).json()["meta_info"]["cached_tokens"]

    assert cached(extra_key="v1") == 0
    assert cached(extra_key="v1") > 0
    assert cached(extra_key="v2") == 0 and cached() == 0
    _tokens(compat_srv, prompt, max_tokens=1, cache_salt="v3")
    assert cached(extra_key="v3") > 0


# ---------------------------------------------------------------------------------------------- control


def test_pause_keep_freezes_requests_and_resume_finishes_them(compat_srv):
    """prime-rl / SkyRL / TRL async: POST /pause?mode=keep&clear_cache=false with no body -> {"status": "paused"};
    a request in flight is kept (not aborted) and finishes after POST /resume -> {"status": "resumed"}."""
    import threading

    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", _tokens(compat_srv, PROMPTS[3], max_tokens=3000,
                                                                    ignore_eos=True)))
    t.start()
    while compat_srv.get("/v1/loads").json()["loads"][0]["num_running_reqs"] == 0:
        time.sleep(0.01)
    assert _ok(compat_srv.post("/pause?mode=keep&clear_cache=false")).json() == {"status": "paused"}
    assert compat_srv.get("/is_paused").json() == {"is_paused": True}
    t.join(2)
    assert t.is_alive()  # frozen, not aborted
    assert _ok(compat_srv.post("/resume")).json() == {"status": "resumed"}
    t.join(120)
    choice = box["r"]["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 3000
    assert compat_srv.get("/is_paused").json() == {"is_paused": False}
    assert compat_srv.post("/pause?mode=sideways").status_code == 400
    r = compat_srv.post("/inference/v1/generate", json={"token_ids": [1, 2], "sampling_params": {"max_tokenz": 3}})
    assert r.status_code == 400 and "max_tokenz" in r.text


def test_pause_wait_lets_requests_in_flight_finish(compat_srv):
    """/pause?mode=wait: the request in flight finishes whole (finish_reason length, not abort) before the
    pause answers; a request sent while paused waits and runs after /resume."""
    import threading

    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", _tokens(compat_srv, PROMPTS[2], max_tokens=400,
                                                                    ignore_eos=True)))
    t.start()
    while compat_srv.get("/v1/loads").json()["loads"][0]["num_running_reqs"] == 0:
        time.sleep(0.01)
    assert _ok(compat_srv.post("/pause?mode=wait")).json() == {"status": "paused"}
    t.join(5)
    assert box["r"]["choices"][0]["finish_reason"] == "length" and len(box["r"]["choices"][0]["token_ids"]) == 400
    late = threading.Thread(target=lambda: box.setdefault("late", _tokens(compat_srv, PROMPTS[1], max_tokens=4)))
    late.start()
    late.join(1.5)
    assert late.is_alive()  # queued while paused
    _ok(compat_srv.post("/resume"))
    late.join(60)
    assert len(box["late"]["choices"][0]["token_ids"]) == 4


def test_sleep_and_wake_up(compat_srv):
    """/sleep?level=1 keeps the weights on the host and drops the KV; /wake_up?tags=weights&tags=kv_cache
    (AReaL's query string) restores them: the same greedy tokens. /reset_prefix_cache with SkyRL's body."""
    before = _greedy(compat_srv)[:2]
    _ok(compat_srv.post("/sleep?level=1"))
    assert compat_srv.get("/is_sleeping").json() == {"is_sleeping": True}
    _ok(compat_srv.post("/wake_up?tags=weights&tags=kv_cache"))
    assert compat_srv.get("/is_sleeping").json() == {"is_sleeping": False}
    assert _greedy(compat_srv)[:2] == before
    _ok(compat_srv.post("/reset_prefix_cache", json={"reset_running_requests": False}))
    _ok(compat_srv.post("/reset_prefix_cache"))
    assert compat_srv.get("/get_world_size").json() == {"world_size": 1}


def test_prime_rl_weight_dir_update_between_pause_and_resume(compat_srv, compat_model, compat_model_b):
    """prime-rl: /pause?mode=keep&clear_cache=false, /update_weights {"weight_dir"} -> {"status": "ok"},
    /resume; a salted request then runs on model B."""
    before = _greedy(compat_srv)
    _ok(compat_srv.post("/pause?mode=keep&clear_cache=false"))
    assert _ok(compat_srv.post("/update_weights", json={"weight_dir": compat_model_b})).json() == {"status": "ok"}
    _ok(compat_srv.post("/resume"))
    after = _greedy(compat_srv)
    _ok(compat_srv.post("/update_weights_from_disk", json={"model_path": compat_model_b}))
    assert after != before and _greedy(compat_srv) == after
    _restore(compat_srv, compat_model)
    assert compat_srv.post("/update_weights", json={"weight_dir": "/nonexistent/dir"}).status_code in (400, 403)


def test_prime_rl_reload_weights_resets_to_the_base_model(compat_srv, compat_model_b):
    """An older prime-rl's from-scratch start: /update_weights {"weight_dir"} without pause (the server resets
    the prefix cache itself), then POST /reload_weights {} -> the weights the server started from serve again,
    under the starting version label."""
    base = _greedy(compat_srv)
    assert _ok(compat_srv.post("/update_weights", json={"weight_dir": compat_model_b})).json() == {"status": "ok"}
    _ok(compat_srv.post("/update_weight_version", json={"new_version": "pushed", "abort_all_requests": False}))
    assert _greedy(compat_srv) != base and compat_srv.get("/weight_info").json()["weight_version"] == "pushed"
    r = _ok(compat_srv.post("/reload_weights", json={}))
    assert r.json() == {"status": "ok", "weight_version": "default"}
    assert _greedy(compat_srv) == base and compat_srv.get("/weight_info").json()["weight_version"] == "default"


# ---------------------------------------------------------------------------------------------- weight pushes


def _vllm_chunks(tensors, chunk_bytes):
    """vLLM's packed producer: bytes in order, a chunk closed by the tensor that takes it past the size."""
    import torch

    chunks, cur, size = [], [], 0
    for _, t in tensors:
        cur.append(t.contiguous().view(-1).view(torch.uint8))
        size += cur[-1].numel()
        if size > chunk_bytes:
            chunks.append(torch.cat(cur))
            cur, size = [], 0
    if cur:
        chunks.append(torch.cat(cur))
    return chunks


def _torch_trainer(url: str, compat_model_b: str, port: int, plan: dict, q) -> None:
    """A trainer process with a torch-only weight path: the group built with plain
    torch.distributed.init_process_group on tcp://, then vLLM's native calls (TRL async GRPO's and SkyRL's
    order) or TRL vllm-serve's."""
    import threading

    import httpx as hx
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    out: dict = {}
    try:
        tensors = [(n, v.float()) for n, v in load_file(f"{compat_model_b}/model.safetensors").items()]
        if plan.get("wrong"):
            tensors = [(n, v.double() if n == plan["wrong"] else v) for n, v in tensors]
        with hx.Client(base_url=url, headers=AUTH, timeout=120) as http:
            if plan["kind"] == "areal":  # AReaL's vLLM server extension (areal_vllm_server.py)
                box: dict = {}
                init = {"master_address": "127.0.0.1", "master_port": str(port), "rank_offset": 1, "world_size": 2,
                        "backend": "gloo", "group_name": "areal-g"}
                t = threading.Thread(target=lambda: box.setdefault("init", http.post(
                    "/areal_init_weights_update_group", json=init)))
                t.start()
                dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
                t.join()
                out["init"] = box["init"].json()
                out["pause"] = http.post("/areal_pause_generation").json()
                meta = {"names": [n for n, _ in tensors], "dtypes": ["float32"] * len(tensors),
                        "shapes": [list(v.shape) for _, v in tensors], "group_name": "areal-g"}
                out["meta"] = http.post("/areal_set_update_weight_meta", json=meta).json()
                send = threading.Thread(target=lambda: box.setdefault("update", http.post("/areal_update_weights_xccl")))
                send.start()
                for _, v in tensors:
                    dist.broadcast(v, src=0)
                send.join()
                out["update"] = (box["update"].status_code, box["update"].json())
                out["continue"] = http.post("/areal_continue_generation").json()
            elif plan["kind"] == "sparse":
                out.update(_sparse_trainer(http, port, tensors, plan))
            elif plan["kind"] == "trl":
                r = http.post("/init_communicator/", json={"host": plan.get("host", "0.0.0.0"), "port": port,
                                                           "world_size": 2, "client_device_uuid": "cpu"})
                out["init"] = r.json()
                dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
                out["rendezvous_on"] = _listening_on(port)
                for name, v in tensors:
                    dtype = "torch.float32" if name != plan.get("wrong") else "torch.float32"
                    http.post("/update_named_param/", json={"name": name, "dtype": dtype, "shape": list(v.shape)})
                    dist.broadcast(v, src=1)
                    dist.barrier()
                r = http.post("/reset_prefix_cache/")
                out["reset"] = (r.status_code, r.json())
                out["close"] = http.post("/close_communicator/").json()
            else:
                box: dict = {}
                init = {"init_info": {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                                      "world_size": 2}}
                t = threading.Thread(target=lambda: box.setdefault("init", http.post("/init_weight_transfer_engine",
                                                                                     json=init)))
                t.start()
                dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
                t.join()
                out["init"] = box["init"].json()
                out["pause"] = http.post("/pause?mode=keep").json()
                info = {"names": [n for n, _ in tensors], "dtype_names": [str(v.dtype).split(".")[-1] for _, v in tensors],
                        "shapes": [list(v.shape) for _, v in tensors], "packed": plan["packed"]}
                if plan["packed"]:
                    info["packed_buffer_size_bytes"] = plan["chunk"]
                if plan["kind"] == "skyrl":
                    calls = [("/collective_rpc", {"method": "skyrl_start_weight_update",
                                                  "kwargs": {"is_checkpoint_format": True}}),
                             ("/collective_rpc", {"method": "update_weights_nccl", "kwargs": {"update_info": info}}),
                             ("/collective_rpc", {"method": "skyrl_finish_weight_update", "kwargs": {}})]
                else:
                    calls = [("/start_weight_update", {"is_checkpoint_format": True}),
                             ("/update_weights", {"update_info": info}),
                             ("/finish_weight_update", {"weight_version": plan.get("version")})]
                out["start"] = http.post(*[calls[0][0]], json=calls[0][1]).json()
                send = threading.Thread(target=lambda: box.setdefault("update", http.post(calls[1][0], json=calls[1][1])))
                send.start()
                payloads = _vllm_chunks(tensors, plan["chunk"]) if plan["packed"] else [v for _, v in tensors]
                out["transfers"] = len(payloads)
                for p in payloads:
                    dist.broadcast(p, src=0)
                send.join()
                out["update"] = (box["update"].status_code, box["update"].json())
                r = http.post(calls[2][0], json=calls[2][1])
                out["finish"] = (r.status_code, r.json())
                out["resume"] = http.post("/resume").json()
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["error"] = repr(exc)
    q.put(out)


def _sparse_trainer(http, port: int, tensors: list, plan: dict) -> dict:
    """vLLM's sparse_nccl trainer (``SparseNCCLTrainerWeightTransferEngine``): patches in checkpoint coordinates
    (name, int32 flat indices, values, full shape) from the served weights to ``tensors`` on a share of the
    elements, one unsorted; ``start_weight_update``, ``update_weights`` with ``num_updates_list`` while each
    patch's indices then values are broadcast — twice, a second chunk patching one tensor again —,
    ``finish_weight_update``. Then a patch with an index past its tensor's end, the same way."""
    import threading

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from weight_sync.checksum import checksum_named_tensors

    out: dict = {}
    box: dict = {}
    init = {"init_info": {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}}
    t = threading.Thread(target=lambda: box.setdefault("init", http.post("/init_weight_transfer_engine", json=init)))
    t.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    t.join()
    served = load_file(f"{plan['served']}/model.safetensors")
    g = torch.Generator().manual_seed(3)
    patches, after = [], []
    for name, new in tensors:
        old = served[name].float().reshape(-1)
        take = torch.rand(old.numel(), generator=g) < 0.05  # what a step changed: a share of the elements
        idx = torch.nonzero(take & (old.view(torch.int32) != new.reshape(-1).view(torch.int32))).reshape(-1)
        if len(patches) == 1:
            idx = idx.flip(0)  # vLLM's patches need not be sorted
        idx = idx.to(torch.int32)
        patches.append((name, idx, new.reshape(-1)[idx.long()].contiguous(), list(new.shape)))
        patched = old.clone()
        patched[idx.long()] = new.reshape(-1)[idx.long()]
        after.append((name, patched.reshape(new.shape)))
    # a second chunk (vLLM's send_weight_chunk) patches one tensor again: applied in order, its values win
    name, idx, values, shape = patches[2]
    again = (name, idx[::2].contiguous(), (values[::2] * 0.5).contiguous(), shape)
    after[2][1].view(-1)[again[1].long()] = again[2]
    out["want"] = checksum_named_tensors(after, dtype=torch.float32)
    bad = [(patches[0][0], patches[0][1] + 1_000_000, *patches[0][2:]), *patches[1:]]
    for label, chunks in (("good", [patches, [again]]), ("bad", [bad])):
        out[f"{label}_start"] = http.post("/start_weight_update", json={"is_checkpoint_format": True}).json()
        for sent in chunks:
            info = {"names": [p[0] for p in sent], "dtype_names": ["float32"] * len(sent),
                    "shapes": [p[3] for p in sent], "num_updates_list": [p[1].numel() for p in sent]}
            send = threading.Thread(target=lambda: box.__setitem__("update", http.post(
                "/update_weights", json={"update_info": info})))
            send.start()
            for _, idx, values, _ in sent:
                dist.broadcast(idx, src=0)
                dist.broadcast(values, src=0)
            send.join()
            out[f"{label}_update"] = (box["update"].status_code, box["update"].json())
        r = http.post("/finish_weight_update", json={"weight_version": f"sparse-{label}"})
        out[f"{label}_finish"] = (r.status_code, r.json())
        out[f"{label}_checksum"] = http.post("/weights_checker", json={"action": "checksum"}).json()["checksum"]
    out["patched_elements"] = sum(p[1].numel() for p in patches)
    return out


def _push(url: str, compat_model_b: str, **plan) -> dict:
    from weight_sync.process_group import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_torch_trainer, args=(url, compat_model_b, free_port(), plan, q))
    proc.start()
    out = q.get(timeout=240)
    proc.join(30)
    assert "error" not in out, out
    return out


@pytest.mark.parametrize("kind,packed", [("trl-async", True), ("skyrl", False)])
def test_vllm_native_push_from_a_plain_torch_trainer(compat_srv, compat_model, compat_model_b, kind, packed):
    """TRL's async GRPO (packed) and SkyRL (per tensor, through /collective_rpc): /init_weight_transfer_engine
    while the trainer runs init_process_group, /pause?mode=keep, start, update_weights during the broadcasts,
    finish, /resume -> model B's greedy tokens (packed: vLLM's chunking, several chunks)."""
    url = str(compat_srv.base_url).rstrip("/")
    before = _greedy(compat_srv)
    out = _push(url, compat_model_b, kind=kind, packed=packed, chunk=96 << 10, version="vllm-7")
    assert out["init"]["message"] == "Weight transfer initialized" and out["pause"] == {"status": "paused"}
    assert out["update"][0] == 200 and out["finish"][0] == 200, out
    assert out["resume"] == {"status": "resumed"}
    if packed:
        assert out["transfers"] > 3
        assert compat_srv.get("/weight_info").json()["weight_version"] == "vllm-7"
    pushed = _greedy(compat_srv)
    assert pushed != before
    _ok(compat_srv.post("/update_weights_from_disk", json={"model_path": compat_model_b}))
    assert _greedy(compat_srv) == pushed
    _restore(compat_srv, compat_model)


def test_vllm_sparse_nccl_patches_land_all_or_nothing(compat_srv, compat_model, compat_model_b):
    """vLLM's sparse weight transfer (vllm#40096, #53751: checkpoint names, int32 flat indices then values per
    tensor, ``num_updates_list`` in ``update_info``) from a plain torch trainer between start and finish: the
    served weights become the patched ones bit for bit (checksums; one patch's indices unsorted, one tensor
    patched again by a second chunk, applied in order); a patch with an
    index past its tensor is a 400 naming it, the update is discarded at finish, and the weights stay as they
    were — no restart."""
    url = str(compat_srv.base_url).rstrip("/")
    out = _push(url, compat_model_b, kind="sparse", served=compat_model)
    assert out["good_update"][0] == 200 and out["good_finish"][0] == 200, out
    assert out["good_checksum"] == out["want"] and out["patched_elements"] > 0
    assert compat_srv.get("/weight_info").json()["weight_version"] == "sparse-good"
    assert out["bad_update"][0] == 400 and "outside the tensor" in str(out["bad_update"][1]), out["bad_update"]
    assert out["bad_finish"][0] == 400 and out["bad_checksum"] == out["want"]
    assert compat_srv.get("/weight_info").json()["weight_version"] == "sparse-good"
    _restore(compat_srv, compat_model)


def test_areal_vllm_extension_push(compat_srv, compat_model, compat_model_b):
    """AReaL's vLLM backend: /areal_init_weights_update_group (port as a string) while the trainer joins,
    /areal_pause_generation, /areal_set_update_weight_meta, /areal_update_weights_xccl during the per-tensor
    broadcasts, /areal_continue_generation -> {"success": true} each, and model B serves."""
    url = str(compat_srv.base_url).rstrip("/")
    before = _greedy(compat_srv)
    out = _push(url, compat_model_b, kind="areal")
    assert out["init"]["success"] and out["pause"]["success"] and out["meta"]["success"], out
    assert out["update"][0] == 200 and out["update"][1]["success"] and out["continue"]["success"], out
    pushed = _greedy(compat_srv)
    _ok(compat_srv.post("/update_weights_from_disk", json={"model_path": compat_model_b}))
    assert pushed != before and _greedy(compat_srv) == pushed
    _restore(compat_srv, compat_model)
    r = compat_srv.post("/areal_update_weights", json={"model_path": compat_model_b})
    assert r.status_code == 200 and r.json()["success"] and _greedy(compat_srv) == pushed
    _restore(compat_srv, compat_model)
    r = compat_srv.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert r.status_code == 400 and "pass a PEFT LoRA adapter folder" in r.json()["error"]["message"]
    r = compat_srv.post("/areal_update_weights_lora", json={"lora_model_path": "/x", "lora_name": "a-v1",
                                                             "lora_int_id": 1, "base_model_name": compat_model})
    assert r.status_code == 400 and "pass a PEFT LoRA adapter folder" in r.json()["message"]  # served: test_lora.py


def test_trl_vllm_serve_routes_and_push(compat_srv, compat_model, compat_model_b, compat_tok):
    """TRL's vllm-serve: /health/, /get_world_size/, /generate/ (text prompts, n) and /chat/ with prompt_ids,
    completion_ids, logprobs and logprob_token_ids; the weight path with the client as the last rank:
    /init_communicator/ (host 0.0.0.0), /update_named_param/ (dtype "torch.float32") + broadcast + barrier per
    parameter, /reset_prefix_cache/ publishes them all -> model B."""
    assert _ok(compat_srv.get("/health/")).json() == {"status": "ok"}
    assert _ok(compat_srv.get("/get_world_size/")).json() == {"world_size": 1}
    body = {"prompts": ["hello there", "a b c"], "images": None, "n": 2, "repetition_penalty": 1.0,
            "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 5, "logprobs": 0,
            "structured_outputs_regex": None, "generation_kwargs": {"seed": 3}}
    out = _ok(compat_srv.post("/generate/", json=body)).json()
    assert out["prompt_ids"] == [compat_tok.encode("hello there"), compat_tok.encode("a b c")]
    assert len(out["completion_ids"]) == 4 and all(len(c) == 5 for c in out["completion_ids"])
    assert all(len(tokens) == 5 and all(len(entry) == 1 for entry in tokens) for tokens in out["logprobs"])
    assert [[ids[0] for ids in tokens] for tokens in out["logprob_token_ids"]] == out["completion_ids"]
    chat = {"messages": [[{"role": "user", "content": "hi"}]], "n": 1, "temperature": 0.0, "max_tokens": 4,
            "logprobs": 1, "chat_template_kwargs": {}, "tools": None}
    out = _ok(compat_srv.post("/chat/", json=chat)).json()
    assert len(out["completion_ids"]) == 1 and all(1 <= len(e) <= 2 for e in out["logprobs"][0])

    url = str(compat_srv.base_url).rstrip("/")
    before = _greedy(compat_srv)
    out = _push(url, compat_model_b, kind="trl")
    assert out["reset"] == (200, {"message": "Request received, resetting prefix cache status: True"}), out
    pushed = _greedy(compat_srv)
    assert pushed != before
    _ok(compat_srv.post("/update_weights_from_disk", json={"model_path": compat_model_b}))
    assert _greedy(compat_srv) == pushed
    _restore(compat_srv, compat_model)
    # a parameter broadcast in another dtype than announced: the publish fails naming it, nothing changes
    # the wildcard spelled otherwise ("0x0" resolves to 0.0.0.0): the rendezvous still binds loopback only
    out = _push(url, compat_model_b, kind="trl", wrong="model.layers.0.mlp.up_proj.weight", host="0x0")
    assert out["rendezvous_on"] == ["127.0.0.1"], out["rendezvous_on"]
    status, answer = out["reset"]
    assert status == 400 and "model.layers.0.mlp.up_proj.weight" in answer["detail"], answer
    assert _greedy(compat_srv) == before


def _listening_on(port: int) -> list[str]:
    """The addresses something on this host listens on at ``port``."""
    import psutil

    return sorted({c.laddr.ip for c in psutil.net_connections(kind="tcp")
                   if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port})


def test_packed_chunks_follow_vllms_rule():
    """Our reading of vLLM's packed layout equals its producer's chunking (a chunk closes with the tensor
    that takes it past the buffer size)."""
    import torch

    from weight_sync.distributed import exact_transfers

    specs = [(f"t{i}", torch.float32, (n,)) for i, n in enumerate([10, 30, 5, 40, 1, 1, 64])]
    transfers = exact_transfers(specs, "packed", 100)
    tensors = [(n, torch.zeros(shape)) for n, _, shape in specs]
    chunks = _vllm_chunks(tensors, 100)
    assert [sum(e[4] for e in t) for t in transfers] == [c.numel() for c in chunks]
    assert sum(len(t) for t in transfers) == len(specs) and math.prod([1]) == 1


def test_trl_newest_client_over_vllm_routes(compat_srv, compat_tok):
    """TRL's newest VLLMClient (after CLIENTS.md's commit) speaks vLLM's routes: /v1/completions with
    return_token_ids and return_tokens_as_token_ids (prompt_token_ids, token_ids, "token_id:N" logprob
    tokens), teacher scoring by prompt_logprobs (max_tokens 1; entries sorted by their exact rank) and
    /v1/chat/completions with return_token_ids."""
    seqs = [PROMPTS[0] + PROMPTS[1], PROMPTS[2]]
    body = {"model": "m", "prompt": seqs, "return_token_ids": True, "return_tokens_as_token_ids": True, "n": 2,
            "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 5,
            "logprobs": 0, "seed": 4}
    choices = _ok(compat_srv.post("/v1/completions", json=body)).json()["choices"]
    assert [c["prompt_token_ids"] for c in choices[::2]] == seqs
    for c in choices:
        assert len(c["token_ids"]) == 5
        assert [int(t.split(":")[1]) for t in c["logprobs"]["tokens"]] == c["token_ids"]
    k, start = 3, len(PROMPTS[0])
    scored = {"model": "m", "prompt": seqs[:1], "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": k}
    plp = _ok(compat_srv.post("/v1/completions", json=scored)).json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(seqs[0]) and plp[0] is None
    for pos in range(start, len(seqs[0])):
        entries = sorted(plp[pos].items(), key=lambda item: item[1]["rank"])  # TRL sorts by rank
        ranks = [e["rank"] for _, e in entries]
        assert ranks[:k] == [1, 2, 3] and all(isinstance(r, int) for r in ranks)
        actual = plp[pos][str(seqs[0][pos])]
        above = sum(e["logprob"] > actual["logprob"] for _, e in entries[:k])
        assert actual["rank"] == 1 + above if above < k else k < actual["rank"] <= 320
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 1, "temperature": 0.0,
            "max_tokens": 4, "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
            "return_tokens_as_token_ids": True}
    out = _ok(compat_srv.post("/v1/chat/completions", json=chat)).json()
    rendered = compat_tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    assert out["prompt_token_ids"] == list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    choice = out["choices"][0]
    assert [int(c["token"].split(":")[1]) for c in choice["logprobs"]["content"]] == choice["token_ids"]


def test_trl_get_sequence_logprobs(compat_srv):
    """TRL's /get_sequence_logprobs/ (distillation): the completion region's top-k logprobs at a temperature,
    padded to k, and the actual token's, as JSON or as base64 float32/int32 arrays of (sequences, longest, k)."""
    import base64
    import struct

    seqs = [PROMPTS[0] + PROMPTS[3], PROMPTS[1] + PROMPTS[2][:4]]
    lens = [len(PROMPTS[0]), len(PROMPTS[1])]
    body = {"sequences": seqs, "prompt_lengths": lens, "top_logprobs": 4, "temperature": 0.7,
            "response_format": "json"}
    js = _ok(compat_srv.post("/get_sequence_logprobs/", json=body)).json()
    assert [len(x) for x in js["logprobs"]] == [len(PROMPTS[3]), 4]
    assert all(len(pos) == 4 for seq in js["logprobs"] for pos in seq)
    assert js["actual_token_ids"][0] == [[t] for t in PROMPTS[3]]
    ref = _ok(compat_srv.post("/generate", json={"input_ids": seqs[0], "return_logprob": True, "logprob_start_len": lens[0],
                                          "sampling_params": {"max_new_tokens": 0, "temperature": 0.7}})).json()
    assert [a[0] for a in js["actual_logprobs"][0]] == pytest.approx(
        [e[0] for e in ref["meta_info"]["input_token_logprobs"]], abs=1e-5)
    binary = _ok(compat_srv.post("/get_sequence_logprobs/", json={**body, "response_format": "binary"})).json()
    n, longest, k = binary["shape"]
    assert (n, longest, k) == (2, len(PROMPTS[3]), 4) and binary["completion_lengths"] == [len(PROMPTS[3]), 4]
    values = struct.unpack(f"<{n * longest * k}f", base64.b64decode(binary["logprobs_b64"]))
    assert list(values[:4]) == pytest.approx(js["logprobs"][0][0], abs=1e-6)
    second = values[longest * k: longest * k + 4 * k]  # the second sequence's rows, then padding (-inf)
    assert list(second[:4]) == pytest.approx(js["logprobs"][1][0], abs=1e-6)
    assert all(v == float("-inf") for v in values[longest * k + 4 * k:])


def test_a_second_start_is_a_400_naming_the_open_update_and_aborts_nothing(compat_srv):
    """vLLM's phased API against the one lifecycle: /start_weight_update while one is open is refused, naming
    it (never a silent restart, never a wedge: /abort_weight_update or the idle timeout ends it); SkyRL's
    start over /collective_rpc gets the same answer; the open one still publishes."""
    assert compat_srv.post("/start_weight_update", json={"is_checkpoint_format": True}).status_code == 200
    again = compat_srv.post("/start_weight_update", json={"is_checkpoint_format": True})
    assert again.status_code == 400 and "/start_weight_update" in again.json()["error"], again.text
    assert "still open" in again.json()["error"]
    rpc = compat_srv.post("/collective_rpc", json={"method": "skyrl_start_weight_update",
                                                   "kwargs": {"is_checkpoint_format": True}})
    assert rpc.status_code == 400 and "still open" in rpc.text
    begin = compat_srv.post("/begin_weight_update", json={})  # another family's start: refused too
    assert begin.status_code == 400 and "/start_weight_update" in begin.text
    done = compat_srv.post("/finish_weight_update", json={"weight_version": "restarted"})
    assert done.status_code == 200, done.text  # nothing staged, published as a version label
    assert compat_srv.post("/finish_weight_update", json={}).status_code == 400  # nothing left open
    compat_srv.post("/update_weight_version", json={"new_version": "default", "abort_all_requests": False})
