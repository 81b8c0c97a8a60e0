"""Sampling masks and trainer-side replay: with top-k / top-p / min-p and a repetition penalty on,
the trainer's replayed logprobs equal the engine's (fp32), while the unmasked recompute is biased."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import hf_logits, random_prompts

from rollout import RolloutEngine, SamplingParams
from trainer_bridge.replay import replay_logprobs

PROMPTS = random_prompts(300, [7, 12, 5], seed=140)
TRUNCATED = SamplingParams(n=4, max_new_tokens=10, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05,
                           repetition_penalty=1.2, seed=9, ignore_eos=True)


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("fid-qwen3", "qwen3", seed=21, head_std=1.5)


@pytest.fixture(scope="module")
def engine(model, module_engines):
    return module_engines(model, kv_cache_tokens=2048)


def trainer_logits(path, o) -> torch.Tensor:
    """The trainer's raw logits at the positions that produced each output token."""
    logits = hf_logits(path, o.prompt_token_ids + o.output_token_ids)
    n = len(o.prompt_token_ids)
    return logits[n - 1: n - 1 + len(o.output_token_ids)]


def test_masks_are_the_kept_sets_and_replay_matches_the_engine(engine, model):
    outs = engine.generate(input_ids=PROMPTS, sampling_params=TRUNCATED, return_sampling_mask=True)
    worst_masked, worst_unmasked = 0.0, 0.0
    for o in outs:
        assert len(o.output_token_sampling_mask) == len(o.output_token_ids) == len(o.output_token_sampling_logprobs)
        for tok, mask in zip(o.output_token_ids, o.output_token_sampling_mask):
            assert mask == sorted(set(mask)) and tok in mask and 1 <= len(mask) <= 20
        assert o.output_token_sampling_logprobs == pytest.approx(o.output_logprobs, abs=1e-6)
        logits = trainer_logits(model, o)
        replayed = replay_logprobs(logits, o.prompt_token_ids, o.output_token_ids, o.output_token_sampling_mask,
                                   TRUNCATED)
        unmasked = torch.log_softmax(logits / TRUNCATED.temperature, -1).gather(
            1, torch.tensor(o.output_token_ids)[:, None])[:, 0]
        engine_lp = torch.tensor(o.output_logprobs)
        worst_masked = max(worst_masked, float((replayed - engine_lp).abs().max()))
        worst_unmasked = max(worst_unmasked, float((unmasked - engine_lp).abs().max()))
    assert worst_masked < 1e-4
    assert worst_unmasked > 1e-2  # truncated support: the unmasked recompute is off by the kept mass


def test_masks_cost_nothing_when_off_and_do_not_change_tokens(engine):
    plain = engine.generate(input_ids=PROMPTS, sampling_params=TRUNCATED)
    masked = engine.generate(input_ids=PROMPTS, sampling_params=TRUNCATED, return_sampling_mask=True)
    assert [o.output_token_ids for o in plain] == [o.output_token_ids for o in masked]
    assert all(o.output_token_sampling_mask == [] for o in plain)


def test_greedy_masks_are_the_token_alone(engine):
    outs = engine.generate(input_ids=PROMPTS, sampling_params=SamplingParams(max_new_tokens=4, temperature=0,
                                                                              ignore_eos=True),
                           return_sampling_mask=True)
    for o in outs:
        assert o.output_token_sampling_mask == [[t] for t in o.output_token_ids]
        assert o.output_token_sampling_logprobs == [0.0] * 4


def test_a_mask_past_the_cap_fails_its_request_alone(model):
    with RolloutEngine(model, dtype="float32", kv_cache_tokens=2048, max_sampling_mask_size=8) as e:
        wide = SamplingParams(max_new_tokens=4, temperature=1.0, seed=1, ignore_eos=True)
        with pytest.raises(ValueError, match="max_sampling_mask_size=8"):
            e.generate(input_ids=PROMPTS[0], sampling_params=wide, return_sampling_mask=True)
        ok = e.generate(input_ids=PROMPTS[0], sampling_params=SamplingParams(
            max_new_tokens=4, temperature=1.0, top_k=8, seed=1, ignore_eos=True), return_sampling_mask=True)
        assert all(len(m) <= 8 for m in ok[0].output_token_sampling_mask)


def test_overlap_and_tp2_give_the_same_masks(model, engine):
    ref = engine.generate(input_ids=PROMPTS, sampling_params=TRUNCATED, return_sampling_mask=True)
    for kw in (dict(enable_overlap=True), dict(tp_size=2)):
        with RolloutEngine(model, dtype="float32", kv_cache_tokens=2048, **kw) as e:
            got = e.generate(input_ids=PROMPTS, sampling_params=TRUNCATED, return_sampling_mask=True)
        assert [o.output_token_ids for o in got] == [o.output_token_ids for o in ref], kw
        assert [o.output_token_sampling_mask for o in got] == [o.output_token_sampling_mask for o in ref], kw


@pytest.mark.parametrize("sp", [TRUNCATED, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True),
                                SamplingParams(max_new_tokens=6, temperature=1.3, min_new_tokens=3, seed=2,
                                               logit_bias={7: 2.0}, frequency_penalty=0.5, presence_penalty=0.3)],
                         ids=["truncated", "greedy", "penalties"])
def test_replayed_scoring_returns_what_generation_reported(engine, model, sp):
    """Default mode: within 4 ulps of the logits' size (one prefill over the rollout vs. the decode
    steps that produced it reduce in another order, and the GEMM kernels a CPU engine measured fastest
    differ between 1 and many rows: each logit may move by an ulp or two; this model's logits reach
    ~50, where an fp32 ulp is 3.8e-6); batch-invariant mode: bitwise."""
    for e in (engine, None):
        if e is None:
            e = RolloutEngine(model, dtype="float32", kv_cache_tokens=2048, deterministic=True)
        try:
            _check_scoring(e, sp, model if e is engine else None)
        finally:
            if e is not engine:
                e.shutdown()


def _logit_ulp(path, outs) -> float:
    """An fp32 ulp at the largest logit of these sequences (fp32 forward of ``transformers``)."""
    top = max(float(hf_logits(path, o.prompt_token_ids + o.output_token_ids).abs().max()) for o in outs)
    return 2.0 ** (math.floor(math.log2(top)) - 23)


def _check_scoring(engine, sp, path):
    """path: the model, for a bound of 4 ulps of its logits; None: bitwise."""
    gen = engine.generate(input_ids=PROMPTS, sampling_params=sp, return_sampling_mask=True, top_logprobs_num=2)
    tol = 0.0 if path is None else 4 * _logit_ulp(path, gen)
    scored = engine.score([o.prompt_token_ids for o in gen], [o.output_token_ids for o in gen],
                          sampling_params=SamplingParams(**{**vars(sp), "n": 1}), top_logprobs_num=2)
    assert len(scored) == len(gen)
    for g, s in zip(gen, scored):
        assert s.prompt_token_ids == g.prompt_token_ids and s.output_token_ids == g.output_token_ids
        if tol == 0:
            assert s.output_logprobs == g.output_logprobs
            assert s.output_token_sampling_logprobs == g.output_token_sampling_logprobs
        assert s.output_logprobs == pytest.approx(g.output_logprobs, abs=tol)
        assert s.output_token_sampling_logprobs == pytest.approx(g.output_token_sampling_logprobs, abs=tol)
        assert s.output_token_sampling_mask == g.output_token_sampling_mask
        assert [[t for t, _ in top] for top in s.output_top_logprobs] == \
            [[t for t, _ in top] for top in g.output_top_logprobs]


def test_scoring_tokens_generation_would_not_have_drawn(engine):
    out = engine.generate(input_ids=PROMPTS[:1], sampling_params=SamplingParams(max_new_tokens=3, temperature=0,
                                                                                 ignore_eos=True))[0]
    other = [(t + 1) % 300 for t in out.output_token_ids]
    s = engine.score([PROMPTS[0]], [other], SamplingParams(temperature=0.8, top_k=1))[0]
    assert all(lp == float("-inf") for lp in s.output_token_sampling_logprobs)  # outside the top-1 set
    with pytest.raises(ValueError, match="n must be 1"):
        engine.score([PROMPTS[0]], [other], SamplingParams(n=2))
    with pytest.raises(ValueError, match="empty"):
        engine.score([[]], [other])
