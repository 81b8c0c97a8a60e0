"""LoRA adapters served beside the base weights: greedy tokens and logprobs equal ``transformers`` +
``peft`` (fp32, TP=1 and TP=2), mixed batches, versions, the prefix cache, and every refusal."""

import json
import os
import shutil
import threading

import pytest
import torch
from helpers import MIN_MARGIN, hf_greedy, hf_lora_greedy, hf_lora_logprobs, random_prompts

from rollout import SamplingParams
from rollout.tools.tiny import make_tiny_adapter

NEW = 10
LENGTHS = [4, 13, 22]
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)

# (name, base model spec, adapter spec): several ranks, alphas, rsLoRA, per-module ranks and alphas,
# adapters on a subset of the linears, a model with q/k/v biases
ADAPTERS = {
    "llama-r8-all": ("llama", dict(arch="llama"), dict(r=8, lora_alpha=16)),
    "llama-r4-qv-rslora": ("llama", dict(arch="llama"), dict(r=4, lora_alpha=8, use_rslora=True,
                                                             target_modules=["q_proj", "v_proj"])),
    "llama-patterns-mlp": ("llama", dict(arch="llama"), dict(r=16, lora_alpha=16, target_modules=["gate_proj",
                                                                                                   "up_proj", "down_proj",
                                                                                                   "o_proj"],
                                                              rank_pattern={"down_proj": 2},
                                                              alpha_pattern={"o_proj": 64})),
    "qwen2-r6-kvo": ("qwen2", dict(arch="qwen2", tie_word_embeddings=True),
                     dict(r=6, lora_alpha=12, target_modules=["k_proj", "v_proj", "o_proj"], std=0.3)),
    # a mixture of experts: the adapter on the attention and the shared expert (peft targets no fused expert)
    "qwen2moe-r8-attn-shared": ("qwen2_moe", dict(arch="qwen2_moe", num_experts=8, num_experts_per_tok=2,
                                                  moe_intermediate_size=48, shared_expert_intermediate_size=80,
                                                  decoder_sparse_step=1, mlp_only_layers=[]),
                                dict(r=8, lora_alpha=16, std=0.3, target_modules=["q_proj", "v_proj", "o_proj",
                                                                                  "gate_proj", "up_proj", "down_proj"])),
}


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """name -> (base path, adapter path, prompts, peft's greedy tokens): each adapter checked to move
    the base model's greedy answer and to have clear greedy margins (seeds tried in turn)."""
    root = tmp_path_factory.mktemp("adapters")
    prompts = random_prompts(300, LENGTHS, seed=2)
    made = {}
    for name, (arch, spec, aspec) in ADAPTERS.items():
        for seed in range(8):
            base = model_dir(f"lora-{arch}-s{seed}", **spec, seed=seed)
            path = make_tiny_adapter(base, str(root / f"{name}-s{seed}"), seed=seed, **aspec)
            refs = [hf_lora_greedy(base, path, p, NEW) for p in prompts]
            plain = [hf_greedy(base, p, NEW)[0] for p in prompts]
            if min(m for _, m in refs) >= MIN_MARGIN and [r for r, _ in refs] != plain:
                made[name] = (base, path, prompts, [r for r, _ in refs])
                break
        else:
            pytest.fail(f"no seed gave adapter {name} clear greedy margins")
    return made


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_greedy_with_an_adapter_matches_peft(module_engines, adapters, name):
    base, path, prompts, refs = adapters[name]
    engine = module_engines(base, max_num_batched_tokens=9)  # chunked prefill mixed with decodes
    result = engine.load_lora_adapter(name, path)
    assert result.success, result.message
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=name)
    for prompt, ref, out in zip(prompts, refs, outs):
        assert out.output_token_ids == ref
        assert out.output_logprobs == pytest.approx(hf_lora_logprobs(base, path, prompt, ref), abs=1e-4)
    # the base weights still answer requests without the adapter, as transformers does
    plain = engine.generate(input_ids=prompts[0], sampling_params=GREEDY)
    assert plain[0].output_token_ids == hf_greedy(base, prompts[0], NEW)[0]


def test_tp2_with_adapters_equals_peft_and_tp1(make_engine, adapters):
    base, path, prompts, refs = adapters["llama-r8-all"]
    _, path_qv, _, refs_qv = adapters["llama-r4-qv-rslora"]
    assert adapters["llama-r4-qv-rslora"][0] == base  # the same base model: one engine serves both
    engine = make_engine(base, tp_size=2)
    assert engine.load_lora_adapter("all", path).success
    assert engine.load_lora_adapter("qv", path_qv).success
    outs = engine.generate(input_ids=prompts * 2, sampling_params=GREEDY, lora_path=["all"] * 3 + ["qv"] * 3)
    assert [o.output_token_ids for o in outs] == refs + refs_qv
    for prompt, ref, out in zip(prompts, refs, outs):
        assert out.output_logprobs == pytest.approx(hf_lora_logprobs(base, path, prompt, ref), abs=1e-4)


def test_a_mixed_batch_gives_each_request_what_it_gives_alone(make_engine, adapters):
    """Two adapters and the base weights in one batch (and with overlap scheduling): each request's
    tokens and logprobs are those it gets alone."""
    base, path_a, prompts, refs_a = adapters["llama-r8-all"]
    _, path_b, _, refs_b = adapters["llama-r4-qv-rslora"]
    plain = [hf_greedy(base, p, NEW)[0] for p in prompts]
    for overlap, det in ((False, False), (True, False), (False, True)):  # det: the batch-invariant mode, bitwise
        engine = make_engine(base, enable_overlap=overlap, deterministic=det)
        assert engine.load_lora_adapter("a", path_a).success and engine.load_lora_adapter("b", path_b).success
        mix = ["a", None, "b", "b", "a", None, None, "a", "b"]
        outs = engine.generate(input_ids=[prompts[i % 3] for i in range(9)], sampling_params=GREEDY, lora_path=mix)
        want = {"a": refs_a, "b": refs_b, None: plain}
        assert [o.output_token_ids for o in outs] == [want[m][i % 3] for i, m in enumerate(mix)]
        alone = {m: engine.generate(input_ids=prompts[1], sampling_params=GREEDY, lora_path=m)[0] for m in want}
        for i, m in enumerate(mix):
            if i % 3 == 1 and det:
                assert outs[i].output_logprobs == alone[m].output_logprobs
            elif i % 3 == 1:
                assert outs[i].output_logprobs == pytest.approx(alone[m].output_logprobs, abs=1e-5)


def test_sampled_tokens_with_an_adapter_follow_its_distribution(make_engine, adapters):
    """Sampling (temperature 1, seeded): the logprob reported for every sampled token is the
    adapter-model's, not the base model's."""
    base, path, prompts, _ = adapters["llama-r8-all"]
    engine = make_engine(base)
    assert engine.load_lora_adapter("a", path).success
    outs = engine.generate(input_ids=prompts, lora_path="a",
                           sampling_params=SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=3, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.output_logprobs == pytest.approx(hf_lora_logprobs(base, path, prompt, out.output_token_ids),
                                                    abs=1e-4)


def test_the_prefix_cache_is_keyed_by_adapter_version_and_adapter_loads_flush_nothing(make_engine, adapters):
    base, path_a, prompts, refs_a = adapters["llama-r8-all"]
    _, path_b, _, _ = adapters["llama-r4-qv-rslora"]
    engine = make_engine(base, block_size=4)
    long_prompt = prompts[2]  # 22 tokens: 5 full blocks
    plain = engine.generate(input_ids=long_prompt, sampling_params=GREEDY)[0]
    assert engine.load_lora_adapter("a", path_a).success
    on_a = engine.generate(input_ids=long_prompt, sampling_params=GREEDY, lora_path="a")[0]
    assert on_a.num_cached_tokens == 0 and on_a.output_token_ids == refs_a[2]  # never the base model's KV
    again = engine.generate(input_ids=long_prompt, sampling_params=GREEDY, lora_path="a")[0]
    assert again.num_cached_tokens > 0 and again.output_token_ids == refs_a[2]  # its own KV is reused
    generation = engine.worker.model_runner.weights_generation
    assert engine.load_lora_adapter("b", path_b).success  # another adapter: nothing flushed, nothing repacked
    assert engine.unload_lora_adapter("b").success
    assert engine.worker.model_runner.weights_generation == generation
    base_again = engine.generate(input_ids=long_prompt, sampling_params=GREEDY)[0]
    assert base_again.num_cached_tokens > 0 and base_again.output_token_ids == plain.output_token_ids
    a_again = engine.generate(input_ids=long_prompt, sampling_params=GREEDY, lora_path="a")[0]
    assert a_again.num_cached_tokens > 0
    # a new version of "a" (other weights under the same name) reuses none of version 1's KV
    assert engine.load_lora_adapter("a", path_b).success
    v2 = engine.generate(input_ids=long_prompt, sampling_params=GREEDY, lora_path="a")[0]
    assert v2.num_cached_tokens == 0
    assert v2.output_token_ids == hf_lora_greedy(base, path_b, long_prompt, NEW)[0]
    # version 3 takes the slot of version 1 (retired by version 2's load, collected by this one), and none of
    # version 1's modules it does not target is left there (version 1: every linear; 2 and 3: q and v only)
    slot_1 = {a["version"]: a["slot"] for a in engine.list_lora_adapters()}[1]
    assert engine.load_lora_adapter("a", path_b).success
    assert [(a["version"], a["slot"]) for a in engine.list_lora_adapters() if a["version"] == 3] == [(3, slot_1)]
    assert {a["version"] for a in engine.list_lora_adapters()} == {2, 3}
    v3 = engine.generate(input_ids=long_prompt, sampling_params=GREEDY, lora_path="a")[0]
    assert v3.num_cached_tokens == 0 and v3.output_token_ids == v2.output_token_ids


def test_a_request_finishes_on_the_version_it_started_with(make_engine, adapters):
    """Version 2 of an adapter is loaded while a request runs on version 1 (paused in place at that
    moment, then resumed): the running request's tokens are all version 1's, later requests get
    version 2, and version 1's slot is emptied once nothing uses it. Unloading an adapter in use is
    refused."""
    base, path_a, prompts, refs_a = adapters["llama-r8-all"]
    _, path_b, _, _ = adapters["llama-r4-qv-rslora"]
    long = 150
    ref_long, margin = hf_lora_greedy(base, path_a, prompts[1], long)
    assert margin >= MIN_MARGIN  # no greedy step decided by rounding
    ref_b = hf_lora_greedy(base, path_b, prompts[0], NEW)[0]
    engine = make_engine(base)
    assert engine.load_lora_adapter("policy", path_a).success
    out = {}

    def run():
        out["r"] = engine.generate(input_ids=prompts[1], lora_path="policy",
                                   sampling_params=SamplingParams(max_new_tokens=long, temperature=0, ignore_eos=True))

    worker = threading.Thread(target=run)
    worker.start()
    while not engine.list_lora_adapters()[0]["num_running_requests"]:
        threading.Event().wait(0.005)
    engine.pause_generation("in_place")  # the request holds its place and KV, mid-way
    assert engine.list_lora_adapters()[0]["num_running_requests"] == 1
    busy = engine.unload_lora_adapter("policy")
    assert not busy.success and "in use by 1 running request" in busy.message
    loaded = engine.load_lora_adapter("policy", path_b)
    assert loaded.success and loaded.detail["lora_version"] == 2
    versions = {(a["version"], a["current"]) for a in engine.list_lora_adapters()}
    assert versions == {(1, False), (2, True)}  # version 1 still resident for its request
    engine.continue_generation()
    new = engine.generate(input_ids=prompts[0], sampling_params=GREEDY, lora_path="policy")[0]
    worker.join(120)
    assert out["r"][0].output_token_ids == ref_long  # every token from version 1
    assert (out["r"][0].lora_name, out["r"][0].lora_version) == ("policy", 1)
    assert new.output_token_ids == ref_b and new.lora_version == 2  # version 2
    assert engine.unload_lora_adapter("policy").success
    assert engine.list_lora_adapters() == [] and engine.memory_nbytes()["lora_adapters"] == 0


def test_adapters_from_tensors_equal_the_folder(make_engine, adapters):
    """``load_lora_adapter_from_tensors`` with peft's state dict and config (as a trainer holds them)."""
    from safetensors.torch import load_file

    base, path, prompts, refs = adapters["llama-r4-qv-rslora"]
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    config = json.load(open(os.path.join(path, "adapter_config.json")))
    engine = make_engine(base)
    assert engine.load_lora_adapter_from_tensors("t", tensors, config).success
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path="t")
    assert [o.output_token_ids for o in outs] == refs


def _edited(src: str, dst: str, config_edit=None, tensor_edit=None) -> str:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config_edit is not None:
        cfg = json.load(open(os.path.join(dst, "adapter_config.json")))
        config_edit(cfg)
        json.dump(cfg, open(os.path.join(dst, "adapter_config.json"), "w"))
    if tensor_edit is not None:
        tensors = load_file(os.path.join(dst, "adapter_model.safetensors"))
        tensor_edit(tensors)
        save_file(tensors, os.path.join(dst, "adapter_model.safetensors"))
    return dst


def test_adapters_the_engine_cannot_serve_are_refused_and_nothing_changes(make_engine, adapters, tmp_path):
    base, path, prompts, refs = adapters["llama-r8-all"]
    first_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = {
        "dora": (dict(config_edit=lambda c: c.update(use_dora=True)), "DoRA"),
        "modules_to_save": (dict(config_edit=lambda c: c.update(modules_to_save=["lm_head"])), "modules_to_save"),
        "lora_bias": (dict(config_edit=lambda c: c.update(lora_bias=True)), "LoRA biases"),
        "embedding": (dict(tensor_edit=lambda t: t.update({
            "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 320)})), "embedding"),
        "lm_head": (dict(tensor_edit=lambda t: t.update({
            "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(320, 8)})), "LM head"),
        "wrong_shape": (dict(tensor_edit=lambda t: t.update({first_a: torch.zeros(8, 65)})), "do not fit"),
        "missing_B": (dict(tensor_edit=lambda t: t.pop(first_a.replace("lora_A", "lora_B"))), "lora_B.weight is missing"),
        "nan": (dict(tensor_edit=lambda t: t[first_a].fill_(float("nan"))), "non-finite"),
        "not_lora": (dict(config_edit=lambda c: c.update(peft_type="IA3")), "only LoRA"),
        "experts": (dict(config_edit=lambda c: c.update(target_parameters=["mlp.experts.gate_up_proj"])),
                    "LoRA on parameters"),
    }
    engine = make_engine(base, max_lora_rank=8, max_loaded_loras=2)
    assert engine.load_lora_adapter("good", path).success
    before = engine.memory_nbytes()["lora_adapters"]
    for case, (edit, words) in cases.items():
        bad = _edited(path, str(tmp_path / case), **edit)
        result = engine.load_lora_adapter(case, bad)
        assert not result.success and words in result.message, (case, result.message)
    big = make_tiny_adapter(base, str(tmp_path / "r16"), r=16)
    result = engine.load_lora_adapter("big", big)
    assert not result.success and "max_lora_rank=8" in result.message
    missing = engine.load_lora_adapter("missing", str(tmp_path / "nowhere"))
    assert not missing.success and "not a folder" in missing.message
    assert not engine.load_lora_adapter("plain-model", base).success  # a model folder is not an adapter
    assert [a["name"] for a in engine.list_lora_adapters()] == ["good"]
    assert engine.memory_nbytes()["lora_adapters"] == before
    with pytest.raises(ValueError, match="lora_path 'nope': no LoRA adapter of that name is loaded"):
        engine.generate(input_ids=prompts[0], sampling_params=GREEDY, lora_path="nope")
    assert not engine.unload_lora_adapter("nope").success
    # the slots are bounded: a third adapter is refused while two are resident
    assert engine.load_lora_adapter("second", path).success
    full = engine.load_lora_adapter("third", path)
    assert not full.success and "max_loaded_loras=2" in full.message
    # and the engine still serves the adapter it had, exactly
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path="good")
    assert [o.output_token_ids for o in outs] == refs


def test_the_memory_budget_bounds_resident_adapters(make_engine, adapters):
    base, path, _, _ = adapters["llama-r8-all"]
    engine = make_engine(base, max_lora_memory_mb=0.1)  # one 65 kB adapter fits, two do not
    assert engine.load_lora_adapter("one", path).success
    result = engine.load_lora_adapter("two", path)
    assert not result.success and "max_lora_memory_mb" in result.message


# ------------------------------------------------------------------ over HTTP, with the field's names


def test_adapters_over_http_with_sglang_and_vllm_names(make_server, adapters, tmp_path):
    """SGLang's and vLLM's LoRA routes on a real socket: load (a folder under --allowed-weight-dirs,
    tensors as a same-host bucket), ``lora_path`` on /generate (one per prompt too), the adapter as
    ``model`` on /v1/completions and in /v1/models, AReaL's ``<name>-v<version>`` names, vLLM's
    duplicate and unknown-name answers, and the refusals (outside the allowed dirs, pickled tensors)."""
    import httpx
    from safetensors.torch import load_file

    from rollout.server.client import RolloutClient
    from weight_sync.shm import SharedMemoryBucket

    base, path_a, prompts, refs_a = adapters["llama-r8-all"]
    _, path_b, _, refs_b = adapters["llama-r4-qv-rslora"]
    allowed = tmp_path / "adapters"
    shutil.copytree(path_a, allowed / "policy-v1")
    shutil.copytree(path_b, allowed / "policy-v2")
    server = make_server(base, "--dtype", "float32", "--kv-cache-tokens", "1024", "--allowed-weight-dirs",
                         str(allowed), "--lora-paths", f"boot={allowed / 'policy-v1'}")
    client = RolloutClient(server.url)
    http = httpx.Client(base_url=server.url, timeout=60)
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}
    # the adapter loaded at start, by SGLang's /generate field
    items = http.post("/generate", json={**body, "lora_path": "boot"}).json()
    assert [it["output_ids"] for it in items] == refs_a
    # SGLang's load route (AReaL's versioned names), its answer, and one lora_path per prompt
    r = http.post("/load_lora_adapter", json={"lora_name": "policy-v2", "lora_path": str(allowed / "policy-v2")})
    assert r.status_code == 200 and r.json()["success"] and set(r.json()["loaded_adapters"]) == {"boot", "policy-v2"}
    items = http.post("/generate", json={**body, "lora_path": ["policy-v2", None, "boot"]}).json()
    plain = hf_greedy(base, prompts[1], NEW)[0]
    assert [it["output_ids"] for it in items] == [refs_b[0], plain, refs_a[2]]
    outs = client.generate(input_ids=prompts, sampling_params=GREEDY, lora_path="policy-v2")
    assert [o.output_token_ids for o in outs] == refs_b
    # vLLM's: the adapter as the model, listed in /v1/models
    ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert ids[1:] == ["boot", "policy-v2"]  # after the base model, by slot
    c = http.post("/v1/completions", json={"model": "policy-v2", "prompt": prompts[0], "max_tokens": NEW,
                                           "temperature": 0, "ignore_eos": True, "return_token_ids": True}).json()
    assert c["choices"][0]["token_ids"] == refs_b[0] and c["model"] == "policy-v2"
    # vLLM's load and unload: a name loaded twice needs load_inplace; an unknown one is 404
    vload = {"lora_name": "v", "lora_path": str(allowed / "policy-v1")}
    assert http.post("/v1/load_lora_adapter", json=vload).text == "Success: LoRA adapter 'v' added successfully."
    again = http.post("/v1/load_lora_adapter", json=vload)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert http.post("/v1/load_lora_adapter", json={**vload, "load_inplace": True}).status_code == 200
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "v"}).status_code == 200
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "v"}).status_code == 404
    # SGLang's from-tensors route with a same-host bucket; a pickled payload is refused unread
    tensors = load_file(os.path.join(path_b, "adapter_model.safetensors"))
    config = json.load(open(os.path.join(path_b, "adapter_config.json")))
    bucket = SharedMemoryBucket()
    try:
        result = client.load_lora_adapter_from_tensors("pushed", bucket.write(list(tensors.items())), config)
        assert result.success, result.message
    finally:
        bucket.close()
    assert [o.output_token_ids for o in client.generate(input_ids=prompts, sampling_params=GREEDY,
                                                        lora_path="pushed")] == refs_b
    pickled = http.post("/load_lora_adapter_from_tensors", json={"lora_name": "x", "config_dict": config,
                                                                 "serialized_tensors": "gASV..."})
    assert pickled.status_code == 400 and "never unpickles" in pickled.text
    # outside --allowed-weight-dirs: 403; an unknown adapter on /generate: 400 naming it
    outside = http.post("/load_lora_adapter", json={"lora_name": "out", "lora_path": path_a})
    assert outside.status_code == 403
    unknown = http.post("/generate", json={**body, "lora_path": "nope"})
    assert unknown.status_code == 400 and "lora_path 'nope': no LoRA adapter" in unknown.text
    assert client.unload_lora_adapter("pushed").success
    assert http.post("/unload_lora_adapter", json={"lora_name": "pushed"}).status_code == 400
    http.close()
    client.close()


def _trainer_side(path: str):
    """(peft's tensors in fp32, as a trainer holds them; peft's config)."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    return [(n, t.float().contiguous()) for n, t in tensors.items()], json.load(open(os.path.join(path,
                                                                                        "adapter_config.json")))


def test_adapters_pushed_over_the_weight_update_group_as_miles_sends_them(make_server, adapters):
    """miles' ``/load_lora_adapter_from_distributed`` on a real socket: the body (names, dtype strings,
    shapes, ``upsert``) then one broadcast per tensor over the group the trainer hosts; our bucketed
    layout too. Refused adapters (a DoRA config, a wrong shape, tokens added) answer 400 or
    ``success: false``, are drained so the trainer's broadcasts complete, and change nothing: the next
    push on the same group lands."""
    import httpx

    from rollout.server.client import RolloutClient
    from trainer_bridge.distributed_target import _Call
    from weight_sync.distributed import WeightUpdateSender
    from weight_sync.process_group import free_port

    base, path_a, prompts, refs_a = adapters["llama-r8-all"]
    _, path_b, _, refs_b = adapters["llama-r4-qv-rslora"]
    server = make_server(base, "--dtype", "float32", "--kv-cache-tokens", "1024")
    client = RolloutClient(server.url)
    http = httpx.Client(base_url=server.url, timeout=60)
    port = free_port()
    join = _Call("join", client.init_weights_update_group, "127.0.0.1", port, 1, 2, "lora-group", "gloo", 30)
    sender = WeightUpdateSender("127.0.0.1", port, 2, "lora-group", timeout_s=30)
    assert join.get(40).success

    def push(tensors, config, load_format=None, **extra):
        body = {"lora_name": "policy", "config_dict": config, "names": [n for n, _ in tensors],
                "dtypes": [str(t.dtype).replace("torch.", "") for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors], "group_name": "lora-group", "pinned": False,
                "upsert": True, **({"load_format": load_format} if load_format else {}), **extra}
        call = _Call("load", http.post, "/load_lora_adapter_from_distributed", json=body)
        sender.send(tensors, load_format=load_format or "direct", bucket_bytes=64 << 10)
        return call.get(60)

    tensors_a, config_a = _trainer_side(path_a)
    r = push(tensors_a, config_a)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert set(r.json()["loaded_adapters"]) == {"policy"}
    outs = client.generate(input_ids=prompts, sampling_params=GREEDY, lora_path="policy")
    assert [o.output_token_ids for o in outs] == refs_a
    # refused, drained, nothing changed
    bad_shape = [(n, t[:, :-1].contiguous()) if i == 0 else (n, t) for i, (n, t) in enumerate(tensors_a)]
    r = push(bad_shape, config_a)
    assert r.status_code == 400 and not r.json()["success"] and "do not fit the base weight" in r.text
    r = push(tensors_a, {**config_a, "use_dora": True})
    assert r.status_code == 400 and "DoRA" in r.text
    added = http.post("/load_lora_adapter_from_distributed", json={
        "lora_name": "x", "config_dict": config_a, "names": ["a"], "dtypes": ["float32"], "shapes": [[1]],
        "added_tokens_config": {"tokens": ["<x>"]}})
    assert added.status_code == 400 and "added_tokens_config" in added.text
    outs = client.generate(input_ids=prompts, sampling_params=GREEDY, lora_path="policy")
    assert [o.output_token_ids for o in outs] == refs_a
    # a new version of the name over the same group, in our bucketed layout
    tensors_b, config_b = _trainer_side(path_b)
    r = push(tensors_b, config_b, load_format="rollout_bucket", bucket_bytes=64 << 10, weight_version="step-2")
    assert r.status_code == 200 and r.json()["success"], r.text
    outs = client.generate(input_ids=prompts, sampling_params=GREEDY, lora_path="policy")
    assert [o.output_token_ids for o in outs] == refs_b and outs[0].lora_version == 2
    assert set(outs[0].output_weight_versions) == {"step-2"}
    # a NaN, and a value that overflows only once scaled (lora_alpha 64 on rank 4): refused in our layout
    # too (counted as each bucket is put in place), drained, and version 2 still serves
    first_b = next(i for i, (n, _) in enumerate(tensors_b) if "lora_B" in n)
    for fill, config in ((float("nan"), config_b), (3.0e38, {**config_b, "lora_alpha": 64})):
        edited = [(n, t.clone().fill_(fill) if i == first_b else t) for i, (n, t) in enumerate(tensors_b)]
        r = push(edited, config, load_format="rollout_bucket", bucket_bytes=64 << 10)
        assert r.status_code == 400 and "non-finite" in r.text, r.text
    outs = client.generate(input_ids=prompts, sampling_params=GREEDY, lora_path="policy")
    assert [o.output_token_ids for o in outs] == refs_b and outs[0].lora_version == 2
    client.destroy_weights_update_group("lora-group")
    sender.close()
    http.close()
    client.close()


def test_a_trainer_sending_a_before_b_has_the_a_buckets_received_in_place(make_engine, adapters):
    """Pushes of a training run over the group, tensors in ``wire_order`` (every ``A``, then every ``B``, as
    ``trainer_bridge.lora`` sends them): once a retired version's memory is lent to the next push, the
    buckets of ``A`` tensors (all of them: no bucket holds an ``A`` beside a ``B``) are received straight into
    the adapter's buffer (no copy) and only checked there — a NaN in one is still refused, and the version
    before keeps serving; peft's tokens."""
    from rollout.weights.lora import wire_order
    from trainer_bridge.distributed_target import _Call
    from weight_sync.distributed import WeightUpdateSender
    from weight_sync.process_group import free_port

    base, path, prompts, refs = adapters["llama-r8-all"]
    tensors, config = _trainer_side(path)
    tensors = [tensors[i] for i in wire_order([n for n, _ in tensors])]
    a_bytes = sum(t.nbytes for n, t in tensors if "lora_A" in n)
    engine = make_engine(base, dtype="float32", kv_cache_tokens=1024)
    port = free_port()
    join = _Call("join", engine.init_weights_update_group, "127.0.0.1", port, 1, 2, "inplace", "gloo", 30)
    sender = WeightUpdateSender("127.0.0.1", port, 2, "inplace", timeout_s=30)
    assert join.get(40).success
    bucket = 3 * max(t.nbytes for _, t in tensors)

    def push(named, version):
        call = _Call("load", engine.load_lora_adapter_from_distributed, "policy", config, [n for n, _ in named],
                     [str(t.dtype).replace("torch.", "") for _, t in named], [list(t.shape) for _, t in named],
                     "inplace", load_format="rollout_bucket", bucket_bytes=bucket, weight_version=version)
        sender.send(named, load_format="rollout_bucket", bucket_bytes=bucket)
        return call.get(60)

    in_place = []
    for step in range(1, 4):
        r = push(tensors, f"step-{step}")
        assert r.success, r.message
        in_place.append(r.detail["received_in_place_bytes"])
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path="policy")
        assert [o.output_token_ids for o in outs] == refs and set(outs[0].output_weight_versions) == {f"step-{step}"}
    assert in_place[0] == in_place[1] == 0  # no retired version's memory to land in yet
    assert in_place[2] == a_bytes, (in_place, a_bytes)  # every A: no bucket holds an A beside a B
    bad = [(n, t.clone().fill_(float("nan")) if i == 0 else t) for i, (n, t) in enumerate(tensors)]  # an A
    r = push(bad, "step-4")
    assert not r.success and "non-finite" in r.message and r.detail["received_in_place_bytes"] > 0, r
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path="policy")
    assert [o.output_token_ids for o in outs] == refs and set(outs[0].output_weight_versions) == {"step-3"}
    engine.destroy_weights_update_group("inplace")
    sender.close()


def test_areal_lora_updates_over_the_group_and_from_disk_with_versioned_names(make_server, adapters, tmp_path):
    """AReaL's LoRA routes as its vLLM backend sends them: ``/areal_set_update_weight_meta_lora`` then
    ``/areal_update_weights_lora_xccl`` (the body again, or ``{}`` as older AReaL sends) with one
    broadcast per tensor under the peft model's parameter names; ``/areal_update_weights_lora`` from a
    saved folder. Each version is ``<name>-v<version>``: a newer one replaces the older (freed once
    unused), whose names keep routing to the newest, so versions never pile up."""
    import httpx

    from trainer_bridge.distributed_target import _Call
    from weight_sync.distributed import WeightUpdateSender
    from weight_sync.process_group import free_port

    base, path_a, prompts, refs_a = adapters["llama-r8-all"]
    _, path_b, _, refs_b = adapters["llama-r4-qv-rslora"]
    allowed = tmp_path / "adapters"
    shutil.copytree(path_b, allowed / "v2")
    server = make_server(base, "--dtype", "float32", "--kv-cache-tokens", "1024", "--allowed-weight-dirs",
                         str(allowed))
    http = httpx.Client(base_url=server.url, timeout=60)
    port = free_port()
    join = _Call("join", http.post, "/areal_init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": str(port), "rank_offset": 1, "world_size": 2,
        "backend": "gloo", "group_name": "areal"})
    sender = WeightUpdateSender("127.0.0.1", port, 2, "areal", timeout_s=30)
    assert join.get(40).status_code == 200
    tensors, config = _trainer_side(path_a)
    # the trainer's parameter names (peft's adapter name inside), as AReaL gathers them
    tensors = [(n.replace(".weight", ".default.weight"), t) for n, t in tensors]
    body = {"names": [n for n, _ in tensors], "dtypes": ["float32"] * len(tensors),
            "shapes": [list(t.shape) for _, t in tensors], "group_name": "areal", "lora_name": "policy-v1",
            "lora_int_id": 1, "lora_target_modules": config["target_modules"], "lora_rank": config["r"],
            "lora_alpha": config["lora_alpha"], "lora_bias": "none", "base_model_name": base}

    def completions(model):
        got = []
        for p in prompts:
            c = http.post("/v1/completions", json={"model": model, "prompt": p, "max_tokens": NEW, "temperature": 0,
                                                   "ignore_eos": True, "return_token_ids": True}).json()
            got.append(c["choices"][0]["token_ids"])
        return got

    def xccl(update_body):
        assert http.post("/areal_set_update_weight_meta_lora", json=body).status_code == 200
        call = _Call("update", http.post, "/areal_update_weights_lora_xccl", json=update_body)
        sender.send(tensors, load_format="direct")
        return call.get(60)

    r = xccl(body)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert completions("policy-v1") == refs_a
    r = http.post("/areal_update_weights_lora", json={"lora_model_path": str(allowed / "v2"), "lora_name": "policy-v2",
                                                      "lora_int_id": 1, "base_model_name": base})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert completions("policy-v2") == refs_b and completions("policy-v1") == refs_b  # the old name: the newest
    body["lora_name"] = "policy-v3"
    r = xccl({})  # older AReaL: the metadata set before says it all
    assert r.status_code == 200 and r.json()["success"], r.text
    assert completions("policy-v1") == refs_a and completions("policy-v3") == refs_a
    resident = http.get("/get_server_info").json()["lora_adapters"]
    assert [a["name"] for a in resident if a["current"]] == ["policy-v3"] and len(resident) <= 2
    outside = http.post("/areal_update_weights_lora", json={"lora_model_path": path_a, "lora_name": "x-v1",
                                                            "lora_int_id": 2, "base_model_name": base})
    assert outside.status_code == 403
    sender.close()
    http.close()


def test_distributed_target_pushes_adapters_to_a_tp2_engine(adapters):
    """``DistributedTarget.push_adapter`` into an engine of two TP ranks (rank 1 in its own process)
    whose ranks join the trainer's group: only the adapter moves, and greedy tokens equal peft's."""
    from rollout import RolloutEngine
    from trainer_bridge import DistributedTarget

    base, path, prompts, refs = adapters["llama-patterns-mlp"]
    tensors, config = _trainer_side(path)
    engine = RolloutEngine(base, dtype="float32", tp_size=2, kv_cache_tokens=1024, use_generation_config=False)
    try:
        target = DistributedTarget(engine, timeout_s=30)
        checksum = engine.get_weights_checksum()
        result = target.push_adapter("policy", config, tensors, "step-1")
        assert result.success, result.message
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path="policy")
        assert [o.output_token_ids for o in outs] == refs
        assert engine.get_weights_checksum() == checksum and engine.get_weight_version() != "step-1"
        target.close()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_low_rank_term_lands_on_its_rows_alone_whatever_form_the_rows_take(dtype, backend):
    """``LoraSlots.add`` over every row, a run of rows and scattered rows (two adapters, two pieces of a
    merged linear, one piece without an adapter, a slot this linear holds nothing in) equals the term
    computed row by row in fp32 — with the torch path and with the batched Triton kernel (run by
    Triton's interpreter on this CPU: ``TRITON_INTERPRET=1``, set by conftest.py)."""
    from rollout.layers.lora import LoraBatch, LoraContext, LoraSlots

    if backend == "triton":
        pytest.importorskip("triton", reason="needs the test extra 'triton' (pip install -e '.[test]')")
        assert os.environ.get("TRITON_INTERPRET") == "1"
    g = torch.Generator().manual_seed(0)
    slots = LoraSlots([(0, 70), (70, 4)], context=LoraContext(backend=backend))
    # slot -> piece -> (A [r, in], B [out, r], scale); 70 output rows: two column blocks of the kernel
    pieces = {0: {0: (torch.randn(3, 5, generator=g), torch.randn(70, 3, generator=g), 0.5),
                  1: (torch.randn(2, 5, generator=g), torch.randn(4, 2, generator=g), 2.0)},
              1: {1: (torch.randn(17, 5, generator=g), torch.randn(4, 17, generator=g), 1.0)}}
    for slot, p in pieces.items():
        blocks = slots.blocks({i: a.shape[0] for i, (a, _, _) in p.items()})
        rank = sum(a.shape[0] for a, _, _ in p.values())
        a_fused, b_fused = torch.zeros(rank, 5), torch.zeros(slots.width, rank)
        for i, (r0, r, start, length) in blocks.items():
            a_fused[r0: r0 + r] = p[i][0]
            b_fused[start: start + length, r0: r0 + r] = p[i][1] * p[i][2]
        slots.adapters[slot] = (a_fused, b_fused)
    x, y = torch.randn(19, 5, generator=g).to(dtype), torch.randn(19, 74, generator=g).to(dtype)

    def expected(row_slots):
        want = y.float().clone()
        for r, slot in enumerate(row_slots):
            for i, (a, b, scale) in pieces.get(slot, {}).items():
                start, length = slots.piece_offsets[i]
                want[r, start: start + length] += (x[r].float() @ a.t() @ b.t()) * scale
        return want.to(dtype)

    scattered = [1, 0, -1, 0, 1, -1, 0] + [0] * 10 + [2, 1]  # slot 2: resident elsewhere, not in this linear
    cases = [([0] * 19, LoraBatch([(0, None)])),
             ([-1, 0, 0, 0, 1, 1] + [-1] * 13, LoraBatch([(0, slice(1, 4)), (1, slice(4, 6))])),
             (scattered, LoraBatch([(0, torch.tensor([1, 3, 6, *range(7, 17)])), (1, torch.tensor([0, 4, 18])),
                                    (2, torch.tensor([17]))]))]
    for row_slots, batch in cases:
        got = slots.add(y.clone(), x, batch)
        # bf16: the interpreter truncates fp32 -> bf16 stores (a GPU rounds to nearest): a whole ulp
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.07, rtol=2 ** -7)
        assert torch.allclose(got.float(), expected(row_slots).float(), **tol)
        assert len(LoraBatch.from_sequences(row_slots, [1] * 19, torch.device("cpu")).groups) == len(batch.groups)


def test_the_batched_triton_kernel_serves_a_mixed_batch_as_peft_does(make_engine, adapters):
    """The whole engine with ``lora_backend="triton"`` (the kernel under Triton's interpreter on this
    CPU): two adapters and the base in one batch, greedy tokens equal to peft's and the base model's."""
    pytest.importorskip("triton", reason="needs the test extra 'triton' (pip install -e '.[test]')")
    base, path_a, prompts, refs_a = adapters["llama-r8-all"]
    _, path_b, _, refs_b = adapters["llama-r4-qv-rslora"]
    engine = make_engine(base, lora_backend="triton")
    assert engine.worker.model_runner.lora_context.backend == "triton"
    assert engine.load_lora_adapter("a", path_a).success and engine.load_lora_adapter("b", path_b).success
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=["a", None, "b"])
    plain = hf_greedy(base, prompts[1], NEW)[0]
    assert [o.output_token_ids for o in outs] == [refs_a[0], plain, refs_b[2]]


def test_the_lora_benchmark_writes_its_numbers_and_plot(tmp_path):
    from rollout.cli import main

    assert main(["bench", "lora", "--model", "tiny", "--dtype", "float32", "--rank", "4", "--repeats", "1",
                 "--new-tokens", "12", "--batches", "1,4", "--out-dir", str(tmp_path), "--workdir", str(tmp_path)]) == 0
    res = json.load(open(tmp_path / "lora.json"))
    assert res["push"]["adapter_bytes"] < res["push"]["full_bytes"] and res["push"]["adapter_push_s"] > 0
    dist = res["distributed_push"]
    assert dist["adapter_bytes"] == res["push"]["adapter_bytes"]
    assert all(dist[f]["push_s"] > 0 and dist[f]["bare_broadcast_s"] > 0 for f in ("direct", "rollout_bucket"))
    assert set(res["decode"]) == {"batch1_adapters1", "batch4_adapters1", "batch4_adapters4", "batch4_adapters4_grouped"}
    assert all(v["lora_step_s"] > 0 and v["base_step_s"] > 0 for v in res["decode"].values())
    assert (tmp_path / "lora.png").exists() and res["machine"]["cpu"]


def test_the_weight_sync_benchmark_reports_an_adapter_push(tmp_path):
    """``rollout bench weight-sync`` with ``--lora-rank``: the adapter's pushes beside the full-weight paths."""
    from rollout.cli import main

    assert main(["bench", "weight-sync", "--models", "tiny", "--dtype", "float32", "--repeats", "1", "--bucket-mib", "1",
                 "--lora-rank", "4", "--out-dir", str(tmp_path), "--workdir", str(tmp_path)]) == 0
    res = json.load(open(tmp_path / "weight_sync.json"))
    lora = res["models"][0]["lora"]
    assert lora["rank"] == 4 and 0 < lora["adapter_bytes"] < lora["full_bytes"]
    assert lora["adapter_push_s"] > 0 and lora["distributed"]["adapter_bytes"] == lora["adapter_bytes"]
    assert all(lora["distributed"][f]["fraction_of_raw"] > 0 for f in ("direct", "rollout_bucket"))
    assert (tmp_path / "weight_sync.png").exists()


def test_a_rank_zero_adapter_or_a_bad_pattern_is_refused_and_the_group_keeps_working(make_engine, adapters, tmp_path):
    """A rank-0 adapter (``lora_A`` [0, in], ``lora_B`` [out, 0], a valid config) and an ``alpha_pattern``
    key that is no regular expression: refused naming the cause, by folder, by tensors and over a real
    gloo group — where the refusal drains the trainer's broadcasts, so its send completes and the next
    good push on the same group lands. ``allowed_dirs`` as one string (read character by character, "/"
    would allow every folder) is refused."""
    from trainer_bridge.distributed_target import _Call
    from weight_sync.distributed import WeightUpdateSender
    from weight_sync.process_group import free_port

    base, path, prompts, refs = adapters["llama-r8-all"]
    tensors, config = _trainer_side(path)
    rank0 = [(n, torch.zeros((0, t.shape[1]) if "lora_A" in n else (t.shape[0], 0))) for n, t in tensors]
    engine = make_engine(base, dtype="float32", kv_cache_tokens=1024)
    r = engine.load_lora_adapter_from_tensors("zero", rank0, config)
    assert not r.success and "rank 0" in r.message, r.message
    bad_pattern = {**config, "alpha_pattern": {"(": 2.0}}
    r = engine.load_lora_adapter_from_tensors("pattern", tensors, bad_pattern)
    assert not r.success and "alpha_pattern" in r.message, r.message
    folder = _edited(path, str(tmp_path / "pattern"), config_edit=lambda c: c.update(alpha_pattern={"(": 2.0}))
    r = engine.load_lora_adapter("pattern", folder)
    assert not r.success and "alpha_pattern" in r.message, r.message
    with pytest.raises(ValueError, match="allowed_dirs"):
        engine.load_lora_adapter("strung", path, allowed_dirs="/")
    port = free_port()
    join = _Call("join", engine.init_weights_update_group, "127.0.0.1", port, 1, 2, "zero-g", "gloo", 30)
    sender = WeightUpdateSender("127.0.0.1", port, 2, "zero-g", timeout_s=30)
    assert join.get(40).success

    def push(named, cfg):
        call = _Call("load", engine.load_lora_adapter_from_distributed, "policy", cfg, [n for n, _ in named],
                     [str(t.dtype).replace("torch.", "") for _, t in named], [list(t.shape) for _, t in named],
                     "zero-g")
        sender.send(named, load_format="direct")  # completes: the refusal drains what was announced
        return call.get(60)

    for named, cfg, says in ((rank0, config, "rank 0"), (tensors, bad_pattern, "alpha_pattern")):
        r = push(named, cfg)
        assert not r.success and says in r.message, r.message
    r = push(tensors, config)
    assert r.success, r.message
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path="policy")
    assert [o.output_token_ids for o in outs] == refs
    engine.destroy_weights_update_group("zero-g")
    sender.close()
