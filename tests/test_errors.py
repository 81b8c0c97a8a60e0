"""Bad input: a clear error naming what to fix, and the engine keeps serving."""

import json
import os
import shutil

import pytest
import torch
from helpers import random_prompts
from safetensors.torch import load_file, save_file

from rollout import RolloutEngine, SamplingParams, WeightLoadError


@pytest.fixture(scope="module")
def engine(llama_path, module_engines):
    return module_engines(llama_path, kv_cache_tokens=256, max_model_len=200)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_unknown_architecture(llama_path, tmp_path):
    path = _copy(llama_path, tmp_path / "m")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match="unsupported architecture.*supported: LlamaForCausalLM"):
        RolloutEngine(path)


@pytest.mark.parametrize("damage", ["missing", "shape", "unknown", "int"])
def test_bad_checkpoints(llama_path, tmp_path, damage):
    path = _copy(llama_path, tmp_path / "m")
    st = os.path.join(path, "model.safetensors")
    tensors = load_file(st)
    name = "model.layers.1.mlp.up_proj.weight"
    if damage == "missing":
        del tensors[name]
        match = f"missing weights: {name}"
    elif damage == "shape":
        tensors[name] = tensors[name][:, :-1].contiguous()
        match = f"{name}: shape"
    elif damage == "unknown":
        tensors["model.layers.9.mlp.up_proj.weight"] = tensors[name].clone()
        match = "unknown weight name 'model.layers.9"
    else:
        tensors[name] = tensors[name].to(torch.int32)
        match = "not a floating-point type"
    save_file(tensors, st)
    with pytest.raises(WeightLoadError, match=match):
        RolloutEngine(path)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"),
    (dict(top_k=-3), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(min_new_tokens=5, max_new_tokens=2), "min_new_tokens"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(frequency_penalty=3.0), "frequency_penalty"),
    (dict(stop=[""]), "stop"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
])
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_bad_requests_leave_engine_usable(engine):
    prompt = random_prompts(300, [10], seed=17)[0]
    good = SamplingParams(max_new_tokens=5, temperature=0)
    before = engine.generate(input_ids=prompt, sampling_params=good)[0].output_token_ids
    with pytest.raises(ValueError, match="prompt 0 has 300 tokens; the limit is"):
        engine.generate(input_ids=[1] * 300, sampling_params=good)
    with pytest.raises(ValueError, match="lower max_new_tokens"):
        engine.generate(input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=500))
    with pytest.raises(ValueError, match="outside"):
        engine.generate(input_ids=[[1, 2, 99999]], sampling_params=good)
    with pytest.raises(ValueError, match="empty"):
        engine.generate(input_ids=[[]], sampling_params=good)
    with pytest.raises(ValueError, match="logit_bias"):
        engine.generate(input_ids=prompt, sampling_params=SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="exactly one of"):
        engine.generate(sampling_params=good)
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        engine.generate(input_ids=prompt, sampling_params={"temprature": 1.0})
    # nothing half-submitted: a batch with one bad prompt submits none
    with pytest.raises(ValueError):
        engine.generate(input_ids=[prompt, [1] * 300], sampling_params=good)
    assert engine.get_stats()["num_free_blocks"] == engine.get_stats()["num_blocks"]
    assert engine.generate(input_ids=prompt, sampling_params=good)[0].output_token_ids == before


def test_bad_engine_options(llama_path):
    with pytest.raises(ValueError, match="unknown engine option"):
        RolloutEngine(llama_path, kv_cache_size=5)
    with pytest.raises(ValueError, match="logprob_mode"):
        RolloutEngine(llama_path, logprob_mode="weird")
    with pytest.raises(ValueError, match="dtype"):
        RolloutEngine(llama_path, dtype="int8")


def test_abort_returns_partial_output(model_dir):
    import asyncio

    prompt = random_prompts(300, [10], seed=18)[0]
    sp = SamplingParams(max_new_tokens=1500, temperature=0, ignore_eos=True)

    async def run(engine):
        last, aborted = None, False
        async for o in await engine.async_generate(input_ids=prompt, sampling_params=sp, rid="long-one", stream=True):
            if not aborted and len(o.output_token_ids) >= 3:
                engine.abort_request("long-one")
                aborted = True
            last = o
        return last

    path = model_dir("llama-long", "llama", max_position_embeddings=4096)
    with RolloutEngine(path, dtype="float32", kv_cache_tokens=2048) as engine:
        out = asyncio.run(run(engine))
        assert out.finish_reason == "abort"
        assert 3 <= len(out.output_token_ids) < 1500
        assert len(out.output_logprobs) == len(out.output_token_ids)
        # the engine still serves, and the aborted request's blocks were freed
        assert engine.generate(input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=2))[0].finish_reason
        stats = engine.get_stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]
