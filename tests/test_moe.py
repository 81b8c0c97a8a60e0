"""Mixtures of experts (Qwen3-MoE, Mixtral): tiny random models from their ``transformers`` config classes,
routers drawn wide so no top-k is a near tie — greedy tokens equal ``transformers`` token for token (fp32),
logprobs within 1e-4 of its forward, batched = alone; the per-expert checkpoint names load into the fused
expert parameters and update like any weight; TP > 1 refused for now."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy, hf_logits, random_prompts

from rollout import RolloutEngine, SamplingParams

MOE = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[1]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


@pytest.fixture(scope="module", params=sorted(MOE))
def moe_model(request, model_dir):
    arch = request.param
    return arch, model_dir(f"moe-{arch}", arch, seed=21, hidden_size=64, intermediate_size=96, num_layers=3,
                           **MOE[arch])


def test_greedy_tokens_and_logprobs_equal_transformers_batched_and_alone(moe_model):
    arch, path = moe_model
    prompts = random_prompts(256, [6, 13, 9], seed=22)
    sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    with RolloutEngine(path, dtype="float32", kv_cache_tokens=1024) as engine:
        cfg = engine.model_config
        assert cfg.num_experts == MOE[arch].get("num_experts", MOE[arch].get("num_local_experts"))
        assert cfg.moe_layers == ((0, 2) if arch == "qwen3_moe" else (0, 1, 2))  # qwen3_moe: layer 1 dense
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


def test_a_mixture_of_experts_refuses_tp2_naming_why(moe_model):
    _, path = moe_model
    with pytest.raises(ValueError, match="mixture of experts"):
        RolloutEngine(path, dtype="float32", kv_cache_tokens=512, tp_size=2)
