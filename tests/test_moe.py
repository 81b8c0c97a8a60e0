"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral, OLMoE with its whole-width q/k
norms and clipped q/k/v): tiny random models from their ``transformers`` config classes,
routers drawn wide so no top-k is a near tie — greedy tokens equal ``transformers`` token for token (fp32),
logprobs within 1e-4 of its forward, batched = alone; the per-expert checkpoint names load into the fused
expert parameters and update like any weight, at TP=2 as at TP=1; routed experts returned; routing replayed."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import hf_greedy, hf_logits, hf_model, near_tied_moe, random_prompts

from rollout import RolloutEngine, SamplingParams
from trainer_bridge.multiturn import Environment, EnvStep

MOE = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[1]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # (experts 64 wide: at TP=2 a rank's gate+up rows, 2 x 32, are as many as the hidden size — shapes alike)
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=False,
                      shared_expert_intermediate_size=80, decoder_sparse_step=1, mlp_only_layers=[1]),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=1.0),
}


def _moe(model_dir, arch: str) -> tuple[str, str]:
    return arch, model_dir(f"moe-{arch}", arch, seed=21, hidden_size=64, intermediate_size=96, num_layers=3,
                           **MOE[arch])


@pytest.fixture(scope="module", params=sorted(MOE))
def moe_model(request, model_dir):
    return _moe(model_dir, request.param)


@pytest.fixture(scope="module", params=["olmoe", "qwen2_moe"])
def tp_moe_model(request, model_dir):
    """The two whose blocks hold more than experts at TP=2: OLMoE's q/k norms span the ranks, Qwen2-MoE's shared
    expert is a TP MLP (every model's experts are split alike)."""
    return _moe(model_dir, request.param)


def test_greedy_tokens_and_logprobs_equal_transformers_batched_and_alone(moe_model):
    arch, path = moe_model
    prompts = random_prompts(256, [6, 13, 9], seed=22)
    sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    with RolloutEngine(path, dtype="float32", kv_cache_tokens=1024) as engine:
        cfg = engine.model_config
        assert cfg.num_experts == MOE[arch].get("num_experts", MOE[arch].get("num_local_experts"))
        assert cfg.moe_layers == ((0, 2) if MOE[arch].get("mlp_only_layers") else (0, 1, 2))  # else layer 1 dense
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
        alone = engine.generate(input_ids=prompts[2], sampling_params=sp)[0]
    assert alone.output_token_ids == outs[2].output_token_ids
    assert alone.output_logprobs == pytest.approx(outs[2].output_logprobs, abs=1e-5)
    for prompt, out in zip(prompts, outs):
        want, margin = hf_greedy(path, prompt, 8)
        assert margin > 1e-3 and out.output_token_ids == want
        lp = torch.log_softmax(hf_logits(path, prompt + want), dim=-1)
        ref = [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(want)]
        assert max(abs(a - b) for a, b in zip(out.output_logprobs, ref)) < 1e-4


def test_expert_weights_update_by_their_checkpoint_names_and_read_back(moe_model):
    """An update of one expert's gate / up / down (per-expert names, as checkpoints and trainers name them) lands
    in the fused parameters and reads back; an unknown expert is refused and nothing changes."""
    arch, path = moe_model
    name = "model.layers.0.block_sparse_moe.experts.1.{}.weight" if arch == "mixtral" else \
        "model.layers.0.mlp.experts.1.{}.weight"
    pieces = {"gate": "w1", "up": "w3", "down": "w2"} if arch == "mixtral" else \
        {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    with RolloutEngine(path, dtype="float32", kv_cache_tokens=512) as engine:
        before = engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params=SamplingParams(max_new_tokens=4,
                                                                                           temperature=0))[0]
        inter, hidden = engine.model_config.moe_intermediate_size, engine.model_config.hidden_size
        new = {p: torch.randn(shape) * 0.2 for p, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)),
                                                             ("down", (hidden, inter)))}
        bad = engine.update_weights_from_tensor([(name.replace(".1.", ".99.").format(pieces["up"]), new["up"])],
                                                partial=True)
        assert not bad.success and "experts.99" in bad.message
        res = engine.update_weights_from_tensor([(name.format(pieces[p]), t) for p, t in new.items()],
                                                weight_version="v2", partial=True)
        assert res.success, res.message
        for p, t in new.items():
            got = torch.tensor(engine.get_weights_by_name(name.format(pieces[p]), 5))
            assert torch.equal(got, t.flatten()[:5])
        after = engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params=SamplingParams(max_new_tokens=4,
                                                                                          temperature=0))[0]
        assert after.weight_version == "v2" and before.weight_version != "v2"


def trained_experts(path: str):
    """A copy of the ``transformers`` model with every expert moved (as a trainer's step moves them), and its
    ``named_parameters()`` — transformers v5's names: the experts fused."""
    model = copy.deepcopy(hf_model(path))  # (the helper's model is cached: never changed in place)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".experts." in n:
                p.mul_(1.5)
    return model, [(n, p.detach().clone()) for n, p in model.named_parameters()]


def _update_over(engine: RolloutEngine, how: str, named: list, folder) -> None:
    """``named`` into ``engine`` in process, from a checkpoint folder, or over a weight-update group from a
    separate sender process (several buckets)."""
    import multiprocessing as mp

    from safetensors.torch import save_file
    from test_weight_sync import _dist_sender

    from weight_sync.distributed import WeightUpdateSender
    from weight_sync.process_group import free_port

    if how == "tensors":
        assert engine.update_weights_from_tensor(named, weight_version="v5").success
    elif how == "disk":
        save_file({n: t.contiguous() for n, t in named}, str(folder / "model.safetensors"))
        assert engine.update_weights_from_disk(str(folder), weight_version="v5").success
    else:
        port, world = free_port(), 1 + engine.tp_size
        proc = mp.get_context("spawn").Process(target=_dist_sender, args=(port, world, named, 32 << 10, False))
        proc.start()
        assert engine.init_weights_update_group("127.0.0.1", port, 1, world, "g", timeout_s=30).success
        result = engine.update_weights_from_distributed(*WeightUpdateSender.describe(named), "g", weight_version="v5",
                                                        load_format="rollout_bucket", bucket_bytes=32 << 10)
        proc.join(30)
        assert result.success, result.message


def test_tp2_equals_tp1_with_every_expert_split_over_the_ranks(tp_moe_model, tmp_path):
    """Expert tensor parallelism (each rank every expert's half of the intermediate dimension, one all-reduce a
    block): greedy tokens and routed experts equal TP=1's, logprobs within 1e-5; a trainer's fused v5 tensors
    load into the split parameters (each rank its gate rows and its up rows) and read back whole — in process at
    TP=1, from a checkpoint folder (OLMoE) or over a weight-update group from a separate sender (Qwen2-MoE) at
    TP=2, the same weights (checksums) either way; a TP size that does not split the experts is refused naming
    them."""
    import shutil

    arch, path = tp_moe_model
    prompts = random_prompts(256, [6, 13, 9], seed=27)
    sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    _, named = trained_experts(path)
    folder = tmp_path / "trained"
    shutil.copytree(path, folder)
    outs, after, checksums = {}, {}, {}
    for tp in (1, 2):
        with RolloutEngine(path, dtype="float32", kv_cache_tokens=1024, tp_size=tp,
                           enable_return_routed_experts=True) as engine:
            outs[tp] = engine.generate(input_ids=prompts, sampling_params=sp, return_routed_experts=True)
            _update_over(engine, "tensors" if tp == 1 else "disk" if arch == "olmoe" else "group", named, folder)
            checksums[tp] = engine.get_weights_checksum()
            after[tp] = engine.generate(input_ids=prompts, sampling_params=sp)
            for fused in ("gate_up_proj", "down_proj"):  # read back whole from every rank's part
                name = f"model.layers.0.mlp.experts.{fused}"
                want = dict(named)[name]
                got = engine.get_weights_by_name(name, want.numel())
                assert torch.equal(torch.tensor(got).view_as(want), want)
    assert checksums[1] == checksums[2]
    for a, b in [*zip(outs[1], outs[2]), *zip(after[1], after[2])]:
        assert a.output_token_ids == b.output_token_ids
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
    assert all(torch.equal(a.routed_experts, b.routed_experts) for a, b in zip(outs[1], outs[2]))
    assert [o.output_token_ids for o in after[1]] != [o.output_token_ids for o in outs[1]]
    with pytest.raises(ValueError, match="experts' intermediate"):
        RolloutEngine(path, dtype="float32", kv_cache_tokens=512, tp_size=5)


@torch.no_grad()
def hf_routed(path: str, ids: list[int]) -> torch.Tensor:
    """The top-k experts ``transformers`` routes each position of ``ids`` to, [len(ids), layers, top_k] (dense
    layers 0), read from its routers' outputs."""
    model = hf_model(path)
    layers = model.model.layers
    k = model.config.num_experts_per_tok
    out = torch.zeros(len(ids), len(layers), k, dtype=torch.int32)
    hooks = []
    for i, layer in enumerate(layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            def keep(_m, _a, result, i=i):
                out[:, i] = result[2].to(torch.int32)
            hooks.append(gate.register_forward_hook(keep))
    model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return out


def test_routed_experts_are_the_experts_transformers_routes_every_position_to(moe_model):
    """``return_routed_experts``: per sample, the experts each layer routed positions [start, len - 1) to (SGLang's
    rows) — equal to the top-k of a ``transformers`` forward over the same tokens, through the prefix cache (a
    second request's cached prompt), n samples forked off one prefill, a start offset, and overlap scheduling."""
    arch, path = moe_model
    prompts = random_prompts(256, [21, 9], seed=23)
    greedy = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5, n=2, ignore_eos=True)
    for overlap in (False, True):
        with RolloutEngine(path, dtype="float32", kv_cache_tokens=1024, enable_return_routed_experts=True,
                           enable_overlap=overlap) as engine:
            plain = engine.generate(input_ids=prompts, sampling_params=greedy)
            outs = engine.generate(input_ids=prompts, sampling_params=greedy, return_routed_experts=True)
            forks = engine.generate(input_ids=prompts[:1], sampling_params=sampled, return_routed_experts=True)
            late = engine.generate(input_ids=prompts[1], sampling_params=greedy, return_routed_experts=True,
                                   routed_experts_start_len=4)[0]
        layers, k = engine.model_config.num_hidden_layers, engine.model_config.num_experts_per_tok
        assert all(o.routed_experts is None for o in plain)
        assert outs[0].num_cached_tokens >= 16  # the second call's prompt came from the prefix cache
        for o in [*outs, *forks]:
            ids = o.prompt_token_ids + o.output_token_ids
            assert o.routed_experts.shape == (len(ids) - 1, layers, k) and o.routed_experts_start_len == 0
            assert torch.equal(o.routed_experts, hf_routed(path, ids)[:-1]), (arch, overlap)
        assert forks[0].output_token_ids != forks[1].output_token_ids
        ids = late.prompt_token_ids + late.output_token_ids
        assert late.routed_experts_start_len == 4
        assert torch.equal(late.routed_experts, hf_routed(path, ids)[4:-1])


def test_exact_ties_in_the_router_are_broken_as_transformers_breaks_them(tmp_path):
    """Router rows in exactly equal pairs (``near_tied_moe`` at eps 0): with top-3 of 8, every token-layer's
    third choice is one of a tied pair, and the two experts of a chosen pair come in tied order; the engine
    routes (greedy, prefill and decode, batched) to exactly the experts, in the order, ``transformers`` does."""
    path = near_tied_moe(str(tmp_path / "exact-tie"), eps=0.0)
    prompts = random_prompts(256, [12, 7, 12, 9], seed=5)
    with RolloutEngine(path, dtype="float32", kv_cache_tokens=1024, enable_return_routed_experts=True) as engine:
        outs = engine.generate(input_ids=prompts, return_routed_experts=True,
                               sampling_params=SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
    for o in outs:
        ids = o.prompt_token_ids + o.output_token_ids
        chosen = [set(row.tolist()) for row in o.routed_experts.reshape(-1, 3)]
        assert all(any((2 * j in c) != (2 * j + 1 in c) for j in range(4)) for c in chosen)  # a tie decided
        assert torch.equal(o.routed_experts, hf_routed(path, ids)[:-1])


def test_routed_experts_are_refused_where_they_cannot_be_returned(moe_model, llama_path):
    _, path = moe_model
    with RolloutEngine(path, dtype="float32", kv_cache_tokens=256) as engine:
        with pytest.raises(ValueError, match="enable_return_routed_experts"):
            engine.generate(input_ids=[[5, 6, 7]], return_routed_experts=True)
    with RolloutEngine(path, dtype="float32", kv_cache_tokens=256, enable_return_routed_experts=True) as engine:
        with pytest.raises(ValueError, match="routed_experts_start_len=4 is past its 3 prompt tokens"):
            engine.generate(input_ids=[[5, 6, 7]], return_routed_experts=True, routed_experts_start_len=4)
        with pytest.raises(ValueError, match="routed_experts_start_len must be"):
            engine.generate(input_ids=[[5, 6, 7]], return_routed_experts=True, routed_experts_start_len=-1)
        assert engine.generate(input_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=2),
                               return_routed_experts=True)[0].routed_experts.shape[0] == 4
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        RolloutEngine(llama_path, dtype="float32", kv_cache_tokens=256, enable_return_routed_experts=True)


def test_a_trainers_fused_expert_tensors_update_the_engine_in_place(moe_model):
    """transformers v5 holds a layer's experts fused (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
    [E, H, I]; Mixtral's block as ``mlp``): a full update by the trainer's own parameter names is accepted, and
    the engine then computes what the trainer's model computes. A fused tensor sent with one of its per-expert
    pieces is refused naming both, nothing changed."""
    arch, path = moe_model
    model, named = trained_experts(path)
    assert any(n == "model.layers.0.mlp.experts.gate_up_proj" for n, _ in named)
    piece = "model.layers.0.block_sparse_moe.experts.0.w2.weight" if arch == "mixtral" else \
        "model.layers.0.mlp.experts.0.down_proj.weight"
    prompt = random_prompts(256, [7], seed=24)[0]
    with RolloutEngine(path, dtype="float32", kv_cache_tokens=512) as engine:
        checksum = engine.get_weights_checksum()
        down = dict(named)["model.layers.0.mlp.experts.down_proj"]
        bad = engine.update_weights_from_tensor([("model.layers.0.mlp.experts.down_proj", down), (piece, down[0])],
                                                partial=True)
        assert not bad.success and piece in bad.message and "send one of them" in bad.message
        assert engine.get_weights_checksum() == checksum
        res = engine.update_weights_from_tensor(named, weight_version="v5-names")
        assert res.success, res.message
        out = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(max_new_tokens=6, temperature=0,
                                                                                  ignore_eos=True))[0]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + out.output_token_ids])).logits[0].float(), dim=-1)
    rows = lp[len(prompt) - 1: -1]
    assert out.output_token_ids == rows.argmax(-1).tolist()
    ref = rows.gather(1, torch.tensor(out.output_token_ids)[:, None])[:, 0]
    assert max(abs(a - float(b)) for a, b in zip(out.output_logprobs, ref)) < 1e-4


def test_routed_experts_over_http_as_slime_and_skyrl_read_them(model_dir, make_server):
    """``rollout serve --enable-return-routed-experts``: ``/generate`` with ``return_routed_experts`` (slime's and
    miles' request) answers ``meta_info.routed_experts`` (base64 int32, reshaped by the reader to
    [len(tokens) - 1 - routed_experts_start_len, layers, top_k]) and ``routed_experts_start_len``;
    ``/skyrl/v1/generate`` packs them as SkyRL's reader decodes them; ``/get_server_info`` says the flag is on;
    a bad start and SkyRL's unserved evidence switches are 400s naming what to fix."""
    import base64

    import httpx
    import numpy as np

    _, path = _moe(model_dir, "qwen3_moe")
    server = make_server(path, "--dtype", "float32", "--kv-cache-tokens", "1024", "--enable-return-routed-experts")
    prompt = random_prompts(256, [11], seed=25)[0]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        info = http.get("/get_server_info").json()
        assert info["enable_return_routed_experts"] is True
        layers, k = 3, MOE["qwen3_moe"]["num_experts_per_tok"]
        for start in (0, 5):
            r = http.post("/generate", json={"input_ids": prompt, "return_logprob": True, "return_routed_experts": True,
                                             "routed_experts_start_len": start,
                                             "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
            assert r.status_code == 200, r.text[:300]
            meta = r.json()["meta_info"]
            tokens = prompt + [t for _, t, _ in meta["output_token_logprobs"]]
            assert meta["routed_experts_start_len"] == start
            got = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
            got = torch.from_numpy(got.reshape(len(tokens) - 1 - start, layers, k).copy())
            assert torch.equal(got, hf_routed(path, tokens)[start:-1])
        r = http.post("/skyrl/v1/generate", json={"token_ids": prompt, "sampling_params": {"max_tokens": 4,
                                                                                          "temperature": 0}})
        assert r.status_code == 200, r.text[:300]
        assert b'"routed_experts":{"data":"' in r.content  # where SkyRL's reader cuts the base64 out
        choice = r.json()["choices"][0]
        packed = choice["routed_experts"]
        assert packed["dtype"] == "uint8" and packed["shape"] == [len(prompt) + 3, layers, k]
        got = np.frombuffer(base64.b64decode(packed["data"]), dtype=np.uint8).reshape(packed["shape"])
        assert torch.equal(torch.from_numpy(got.astype(np.int32)), hf_routed(path, prompt + choice["token_ids"])[:-1])
        r = http.post("/generate", json={"input_ids": prompt, "return_routed_experts": True,
                                         "routed_experts_start_len": 99})
        assert r.status_code == 400 and "routed_experts_start_len" in r.text
        r = http.post("/skyrl/v1/generate", json={"token_ids": prompt, "return_full_logprobs": True})
        assert r.status_code == 400 and "return_full_logprobs" in r.text
    with server.client() as client:  # the trainer's HTTP client (disaggregated routing replay) reads them whole
        out = client.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 4, "temperature": 0},
                              return_routed_experts=True)[0]
    assert torch.equal(out.routed_experts, hf_routed(path, prompt + out.output_token_ids)[:-1])


def test_routing_replay_gives_the_trainer_the_engines_experts_where_a_near_tie_splits_them(tmp_path):
    """R3 (``trainer_bridge.routing_replay``) on a model whose routers have near-ties at fp32's rounding
    (``near_tied_moe``): the engine and ``transformers`` route some token-layers differently and those tokens'
    logprobs differ by up to several nats; with the engine's experts replayed, every sampled token's logprob is
    within 1e-4 of the engine's (fp32), and the router still gets its gradient (through the replayed experts'
    weights)."""
    from trainer_bridge.routing_replay import replay_rows, replaying

    path = near_tied_moe(str(tmp_path / "tied"))
    prompts = random_prompts(256, [8] * 12, seed=26)
    with RolloutEngine(path, dtype="float32", kv_cache_tokens=1024, enable_return_routed_experts=True) as engine:
        outs = engine.generate(input_ids=prompts, return_routed_experts=True,
                               sampling_params=SamplingParams(max_new_tokens=12, temperature=1.0, seed=7))
    model = hf_model(path)
    seqs = [o.prompt_token_ids + o.output_token_ids for o in outs]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])

    def sampled_logprobs(logits):
        return torch.cat([torch.log_softmax(logits[i, len(o.prompt_token_ids) - 1: len(s) - 1].float(), -1)
                         .gather(1, torch.tensor(o.output_token_ids)[:, None])[:, 0]
                          for i, (o, s) in enumerate(zip(outs, seqs))])

    engine_lp = torch.tensor([lp for o in outs for lp in o.output_logprobs])
    with torch.no_grad():
        natural = (sampled_logprobs(model(input_ids=ids, attention_mask=mask).logits) - engine_lp).abs()
    rows = replay_rows([o.routed_experts for o in outs], list(map(len, seqs)), width)
    model.zero_grad()
    with replaying(model, rows):
        replayed_lp = sampled_logprobs(model(input_ids=ids, attention_mask=mask).logits)
    replayed_lp.sum().backward()
    replayed = (replayed_lp.detach() - engine_lp).abs()
    assert float(replayed.max()) < 1e-4, float(replayed.max())
    assert float(natural.max()) > 0.05 and float(natural.mean()) > 10 * float(replayed.mean()), float(natural.max())
    assert all(float(layer.mlp.gate.weight.grad.abs().sum()) > 0 for layer in model.model.layers)
    model.zero_grad()


class _Chat(Environment):
    """A user who asks again after every reply (tool-free: the tiny chat tokenizer's prompts stay short)."""

    def reset(self) -> list[dict]:
        return [{"role": "user", "content": "Tell me a colour."}]

    def step(self, message: dict) -> EnvStep:
        return EnvStep(messages=[{"role": "user", "content": "And another one?"}])


def test_a_multi_turn_trajectory_replays_the_experts_of_every_turn_environment_tokens_included(tmp_path):
    """Multi-turn GRPO with routing replay (``run_grpo_multiturn``'s rollout and logprobs; the near-tied model,
    episodes played as engine sessions): each trajectory carries the experts of every position but its last —
    each turn's sampled tokens and the environment's tokens as the next turn's prefill routed them — and the
    trainer's forward replays them on every one of those positions, giving every sampled token of every turn
    the engine's logprob (fp32, 1e-4), where the trainer's own routing is far off."""
    from transformers import AutoTokenizer

    from rollout.tools.tiny import build_chat_tokenizer
    from trainer_bridge.grpo import GRPOConfig
    from trainer_bridge.grpo_multiturn import _MultiTurnRun
    from trainer_bridge.multiturn import MultiTurnRunner
    from trainer_bridge.targets import ColocatedTarget

    path = near_tied_moe(str(tmp_path / "tied-chat"), tokenizer=build_chat_tokenizer("qwen2_5"))
    tok = AutoTokenizer.from_pretrained(path)
    model = hf_model(path)
    cfg = GRPOConfig(steps=1, prompts_per_step=2, n=2, max_new_tokens=12, routing_replay=True, release_memory=False,
                     dist_check_samples=0)
    with RolloutEngine(path, dtype="float32", kv_cache_tokens=4096, enable_return_routed_experts=True) as engine:
        runner = MultiTurnRunner(engine, tok, max_turns=3, max_total_tokens=400, tool_call_parser=None)
        run = _MultiTurnRun(cfg, model, engine, ["colours"] * 2, lambda task: _Chat(), runner, None, False,
                            ColocatedTarget(engine))
        ro = run.rollout(0)
    trajs = ro.outputs
    seqs = [t.prompt_token_ids + t.output_token_ids for t in trajs]
    assert len(trajs) == 4 and all(len(t.turns) == 3 and 0 in t.loss_mask for t in trajs)  # environment tokens
    assert all(t.routed_experts.shape == (len(s) - 1, 2, 3) for t, s in zip(trajs, seqs))
    with torch.no_grad():
        replayed, _, engine_lp = run.logprobs(model, ro, trajs)
        assert run.replayed_tokens == sum(len(s) - 1 for s in seqs)
        natural, _, _ = run.logprobs(model, ro, trajs, replay=False)
    engine_lp = torch.cat(engine_lp)
    replayed, natural = (torch.cat(replayed) - engine_lp).abs(), (torch.cat(natural) - engine_lp).abs()
    assert float(replayed.max()) < 1e-4, float(replayed.max())
    assert float(natural.max()) > 0.05 and float(natural.mean()) > 10 * float(replayed.mean()), float(natural.max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", ["random", "one expert", "one token"])
def test_the_fused_triton_moe_is_the_per_expert_loop(dtype, routing):
    """``rollout.kernels.triton.moe.fused_moe`` (the CUDA plan's: rows grouped by expert on the device, one
    grouped GEMM per projection; Triton's interpreter here) against the per-expert loop: fp32 within 1e-5,
    bf16 within its rounding; experts routed nothing, every token on one expert, a single token."""
    from rollout.kernels.triton.moe import fused_moe
    from rollout.layers.moe import SparseMoe

    torch.manual_seed(3)
    moe = SparseMoe(8, 2, 64, 48, True, dtype)
    for p in (moe.experts.w13, moe.experts.w2):
        p.data = torch.randn(p.shape, dtype=dtype) * 0.1
    t = 1 if routing == "one token" else 37
    x = torch.randn(t, 64, dtype=dtype)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(t)]) if routing != "one expert" else \
        torch.tensor([[3, 5]] * t)
    weights = torch.rand(t, 2).to(dtype)
    got = fused_moe(x, moe.experts.w13, moe.experts.w2, ids, weights)
    want = moe._per_expert(x, ids, weights)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-2)


def test_a_mixture_of_experts_on_the_cuda_plan_serves_what_the_torch_path_serves_without_a_host_sync(model_dir):
    """A CPU engine on the CUDA kernel plan (the fused Triton MoE, decode graphs captured — bodies eager on a
    CPU): greedy tokens, logprobs (1e-4) and routed experts equal the torch path's; the decode step's device
    work (what a graph captures: the routing, its record, the grouping and both grouped GEMMs) has no host
    synchronisation."""
    from test_gpu_path import _decode_batch

    from rollout.executor.cuda_graph_runner import CudaGraphRunner
    from rollout.kernels.audit import StepAudit

    _, path = _moe(model_dir, "qwen2_moe")  # (its shared expert too; the others' blocks are the same kernels)
    prompts = random_prompts(256, [6, 13], seed=28)
    sp = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    outs = {}
    for triton in (False, True):
        with RolloutEngine(path, dtype="float32", kv_cache_tokens=1024, enable_return_routed_experts=True,
                           kernels={"triton": triton}, max_model_len=128, cuda_graph_max_bs=4) as engine:
            outs[triton] = engine.generate(input_ids=prompts, sampling_params=sp, return_routed_experts=True)
            if triton:
                runner = engine.worker.model_runner
                assert runner.graph_runner is not None  # a mixture of experts captures graphs on this plan
                graphs = CudaGraphRunner(runner, 4, batch_sizes=(1, 2, 4))
                with torch.inference_mode():
                    _, bs = graphs.stage(_decode_batch([5, 19, 33], runner.block_size))
                    with StepAudit() as audit:
                        graphs.run(bs)
                assert audit.syncs == [] and "triton:fused_moe" in audit.launches
    for a, b in zip(outs[False], outs[True]):
        assert a.output_token_ids == b.output_token_ids
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-4)
        assert torch.equal(a.routed_experts, b.routed_experts)


def test_speculation_sessions_and_the_batch_invariant_mode_on_a_mixture_of_experts(model_dir):
    """The engine's other modes hold on a mixture of experts: exact speculation (verify rows routed as the
    tokens they check; the same tokens and routed experts as plain decoding), session turns (each turn's tokens
    those of its whole history sent as one request, its routed experts those of the history's positions from
    ``routed_experts_start_len``), and the batch-invariant mode (alone = in a batch, bit for bit)."""
    _, path = _moe(model_dir, "qwen3_moe")
    prompts = random_prompts(256, [9, 14], seed=29)
    kw = dict(dtype="float32", kv_cache_tokens=2048, use_generation_config=False, enable_return_routed_experts=True)
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, seed=4, ignore_eos=True)
    with RolloutEngine(path, **kw) as plain, RolloutEngine(path, speculative_num_draft_tokens=4,
                                                          speculative_policy="always", **kw) as spec:
        for _ in range(2):  # the second round guesses from the first one's rollouts
            a = plain.generate(input_ids=prompts, sampling_params=sp, return_routed_experts=True)
            b = spec.generate(input_ids=prompts, sampling_params=sp, return_routed_experts=True)
            assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]
            assert all(torch.equal(x.routed_experts, y.routed_experts) for x, y in zip(a, b))
        assert spec.get_stats()["spec_accept_token_num"] >= 5
        sid = plain.open_session()
        first = plain.generate(input_ids=prompts[0], sampling_params=sp, session_id=sid)[0]
        history = prompts[0] + first.output_token_ids + prompts[1]
        turn = plain.generate(input_ids=prompts[1], sampling_params=sp, session_id=sid, return_routed_experts=True,
                              routed_experts_start_len=len(prompts[0]))[0]
        whole = plain.generate(input_ids=history, sampling_params=sp, return_routed_experts=True,
                               routed_experts_start_len=len(prompts[0]))[0]
        assert turn.prompt_token_ids == history and turn.output_token_ids == whole.output_token_ids
        assert torch.equal(turn.routed_experts, whole.routed_experts) and turn.routed_experts_start_len == 9
    with RolloutEngine(path, **{**kw, "deterministic": True}) as det:
        alone = det.generate(input_ids=prompts[:1], sampling_params=sp, return_routed_experts=True)[0]
        mixed = det.generate(input_ids=[prompts[1], prompts[0]], sampling_params=sp, return_routed_experts=True)[1]
    assert alone.output_token_ids == mixed.output_token_ids and alone.output_logprobs == mixed.output_logprobs
    assert torch.equal(alone.routed_experts, mixed.routed_experts)
