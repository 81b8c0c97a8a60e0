"""Processed logprobs of sampled tokens, masks in the documented order, prompt logprobs, scoring."""

import pytest
import torch
from helpers import hf_logits, output_ref_logprobs, random_prompts

from rollout import RolloutEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(llama_path, module_engines):
    return module_engines(llama_path, kv_cache_tokens=2048, use_generation_config=False)


def test_sampled_logprobs_match_forward(engine, llama_path):
    prompts = random_prompts(300, [5, 17], seed=2)
    sp = SamplingParams(max_new_tokens=16, temperature=0.7, seed=11, ignore_eos=True)
    for prompt, out in zip(prompts, engine.generate(input_ids=prompts, sampling_params=sp)):
        ref = output_ref_logprobs(llama_path, prompt, out.output_token_ids, temperature=0.7)
        assert out.output_logprobs == pytest.approx(ref, abs=1e-4)
        assert out.logprob_mode == "processed"


def test_masked_logprobs_follow_hf_warpers(engine, llama_path):
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    prompt = random_prompts(300, [9], seed=3)[0]
    cases = [dict(top_k=5), dict(top_p=0.6), dict(min_p=0.2), dict(top_k=20, top_p=0.8, min_p=0.05)]
    for case in cases:
        sp = SamplingParams(max_new_tokens=12, temperature=0.9, seed=5, ignore_eos=True, **case)
        out = engine.generate(input_ids=prompt, sampling_params=sp)[0]
        warpers = [TemperatureLogitsWarper(0.9)]
        if "top_k" in case:
            warpers.append(TopKLogitsWarper(case["top_k"]))
        if "top_p" in case:
            warpers.append(TopPLogitsWarper(case["top_p"]))
        if "min_p" in case:
            warpers.append(MinPLogitsWarper(case["min_p"]))
        logits = hf_logits(llama_path, prompt + out.output_token_ids)
        for i, tok in enumerate(out.output_token_ids):
            ids = torch.tensor([prompt + out.output_token_ids[:i]])
            x = logits[len(prompt) - 1 + i].unsqueeze(0)
            for w in warpers:
                x = w(ids, x)
            lp = torch.log_softmax(x, dim=-1)[0]
            assert torch.isfinite(lp[tok]), f"{case}: sampled a masked token"
            assert out.output_logprobs[i] == pytest.approx(float(lp[tok]), abs=1e-4), case
        # The masks change the distribution: the plain temperature logprob differs somewhere.
        plain = output_ref_logprobs(llama_path, prompt, out.output_token_ids, temperature=0.9)
        assert max(abs(a - b) for a, b in zip(plain, out.output_logprobs)) > 1e-3, case


def test_prompt_logprobs_and_top_logprobs(engine, llama_path):
    prompt = random_prompts(300, [21], seed=4)[0]
    out = engine.generate(input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=3, temperature=0),
                          logprob_start_len=0, top_logprobs_num=3)[0]
    lp = torch.log_softmax(hf_logits(llama_path, prompt), dim=-1)
    ref = [None] + [float(lp[p - 1, prompt[p]]) for p in range(1, len(prompt))]
    assert out.input_logprobs[0] is None
    assert out.input_logprobs[1:] == pytest.approx(ref[1:], abs=1e-4)
    assert len(out.input_top_logprobs) == len(prompt)
    # each prompt token's rank (vLLM's prompt_logprobs rank): 1 + the tokens the reference finds more likely
    ranks = [None] + [int((lp[p - 1] > lp[p - 1, prompt[p]]).sum()) + 1 for p in range(1, len(prompt))]
    assert len(out.input_ranks) == len(prompt) and out.input_ranks[0] is None
    assert sum(abs(a - b) <= 1 for a, b in zip(out.input_ranks[1:], ranks[1:])) == len(prompt) - 1  # ties may swap
    assert max(ranks[1:]) > 3  # some prompt tokens lie outside the top 3
    # greedy: the sampled token is the first top logprob, with the same value
    for tok, lpv, top in zip(out.output_token_ids, out.output_logprobs, out.output_top_logprobs):
        assert top[0][0] == tok and top[0][1] == pytest.approx(lpv, abs=1e-6)
        assert len(top) == 3
    # from a later start, only positions >= start
    out5 = engine.generate(input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=1, temperature=0),
                           logprob_start_len=5)[0]
    assert out5.input_logprobs == pytest.approx(ref[5:], abs=1e-4)


def test_prefill_only_scoring(engine, llama_path):
    prompt = random_prompts(300, [30], seed=5)[0]
    out = engine.generate(input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=0, temperature=0.5),
                          logprob_start_len=0)[0]
    assert out.output_token_ids == [] and out.output_logprobs == []
    lp = torch.log_softmax(hf_logits(llama_path, prompt) / 0.5, dim=-1)
    assert out.input_logprobs[1:] == pytest.approx([float(lp[p - 1, prompt[p]]) for p in range(1, 30)], abs=1e-4)


def test_raw_mode(llama_path):
    prompt = random_prompts(300, [8], seed=6)[0]
    with RolloutEngine(llama_path, dtype="float32", kv_cache_tokens=512, logprob_mode="raw") as e:
        out = e.generate(input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=8, temperature=0.6, top_k=4,
                                                                           seed=1, ignore_eos=True))[0]
    assert out.logprob_mode == "raw"
    assert out.output_logprobs == pytest.approx(output_ref_logprobs(llama_path, prompt, out.output_token_ids), abs=1e-4)
