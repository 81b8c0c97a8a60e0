"""Stop conditions and logit processors: each test fails if its feature is ignored."""

import pytest
import torch
from helpers import hf_greedy, random_prompts

from rollout import SamplingParams


@pytest.fixture(scope="module")
def engine(llama_path, module_engines):
    return module_engines(llama_path, kv_cache_tokens=2048, use_generation_config=False)


def greedy(**kw):
    base = dict(max_new_tokens=20, temperature=0, ignore_eos=True)
    base.update(kw)
    return SamplingParams(**base)


def test_stop_string_trims_text_keeps_tokens(engine):
    prompt = engine.tokenizer("The quick brown")["input_ids"]
    full = engine.generate(input_ids=prompt, sampling_params=greedy())[0]
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), "pick a visible stop string"
    out = engine.generate(input_ids=prompt, sampling_params=greedy(stop=stop))[0]
    assert out.finish_reason == "stop" and out.matched_stop == stop
    pos = text.find(stop)
    assert out.text == text[:pos] and out.stop_text_offset == pos
    # ids and logprobs cover every sampled token, up to the one that completed the stop string
    n = len(out.output_token_ids)
    assert out.output_token_ids == full.output_token_ids[:n] and len(out.output_logprobs) == n
    assert stop in engine.tokenizer.decode(out.output_token_ids)
    assert stop not in engine.tokenizer.decode(out.output_token_ids[:-1])


def test_stop_token_ids(engine):
    prompt = random_prompts(300, [6], seed=12)[0]
    full = engine.generate(input_ids=prompt, sampling_params=greedy())[0].output_token_ids
    stop_id = full[4]
    out = engine.generate(input_ids=prompt, sampling_params=greedy(stop_token_ids=[stop_id]))[0]
    assert out.output_token_ids == full[: full.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.matched_stop == stop_id


def test_stop_text_is_trimmed_unless_no_stop_trim_as_sglang_does(engine):
    """SGLang trims the matched stop string, and a stop token's text, from ``text`` unless
    ``no_stop_trim`` (slime and miles send it with ``skip_special_tokens: false``)."""
    prompt = engine.tokenizer("The quick brown")["input_ids"]
    full = engine.generate(input_ids=prompt, sampling_params=greedy())[0]
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 2]
    kept = engine.generate(input_ids=prompt, sampling_params=greedy(stop=stop, no_stop_trim=True))[0]
    pos = full.text.find(stop)
    assert kept.text == full.text[:pos + len(stop)] and kept.matched_stop == stop
    stop_id = full.output_token_ids[3]
    sp = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop_id, None],
          "skip_special_tokens": False}
    trimmed = engine.generate(input_ids=prompt, sampling_params=sp)[0]
    untrimmed = engine.generate(input_ids=prompt, sampling_params={**sp, "no_stop_trim": True})[0]
    ids = full.output_token_ids[:full.output_token_ids.index(stop_id) + 1]
    assert trimmed.output_token_ids == untrimmed.output_token_ids == ids  # the tokens are all there either way
    assert trimmed.text == engine.tokenizer.decode(ids[:-1], skip_special_tokens=False)
    assert untrimmed.text == engine.tokenizer.decode(ids, skip_special_tokens=False)


def test_eos_and_min_new_tokens(engine):
    eos = engine.tokenizer.eos_token_id
    prompt = random_prompts(300, [6], seed=13)[0]
    bias = {eos: 100.0}
    out = engine.generate(input_ids=prompt, sampling_params=greedy(ignore_eos=False, logit_bias=bias))[0]
    assert out.output_token_ids == [eos] and out.finish_reason == "stop"
    out = engine.generate(input_ids=prompt, sampling_params=greedy(ignore_eos=False, logit_bias=bias,
                                                                    min_new_tokens=5))[0]
    assert len(out.output_token_ids) == 6 and out.output_token_ids[-1] == eos
    assert eos not in out.output_token_ids[:5]
    out = engine.generate(input_ids=prompt, sampling_params=greedy(ignore_eos=True, logit_bias=bias, max_new_tokens=4))[0]
    assert out.output_token_ids == [eos] * 4 and out.finish_reason == "length"


def test_logit_bias_and_allowed_tokens(engine):
    prompt = random_prompts(300, [6], seed=14)[0]
    out = engine.generate(input_ids=prompt, sampling_params=greedy(max_new_tokens=5, logit_bias={77: 60.0}))[0]
    assert out.output_token_ids == [77] * 5
    allowed = [10, 20, 30]
    out = engine.generate(input_ids=prompt, sampling_params=SamplingParams(
        max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=allowed))[0]
    assert set(out.output_token_ids) <= set(allowed)
    # processed logprobs are over the allowed set only: they are much higher than the raw ones
    assert sum(out.output_logprobs) > -12 * 1.2


def clear_reference(path, make_proc, tries=10):
    """A prompt whose processed greedy reference has clear margins at every step."""
    for seed in range(tries):
        prompt = random_prompts(300, [8], seed=100 + seed)[0]
        ref, margin = hf_greedy(path, prompt, 20, make_proc(prompt))
        if margin >= 0.01:
            return prompt, ref
    pytest.fail("no prompt with clear margins")


def test_repetition_penalty_matches_hf(engine, llama_path):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    proc = RepetitionPenaltyLogitsProcessor(1.8)

    def hf_proc(prompt):
        return lambda logits, ids: proc(torch.tensor([ids]), logits.unsqueeze(0))[0]

    prompt, ref = clear_reference(llama_path, hf_proc)
    out = engine.generate(input_ids=prompt, sampling_params=greedy(repetition_penalty=1.8))[0]
    plain = engine.generate(input_ids=prompt, sampling_params=greedy())[0]
    assert out.output_token_ids == ref
    assert plain.output_token_ids != ref


def test_frequency_and_presence_penalties(engine, llama_path):
    def openai_proc(freq, pres):
        def make(prompt):
            def f(logits, ids):
                out = ids[len(prompt):]
                logits = logits.clone()
                for t in set(out):
                    logits[t] -= freq * out.count(t) + pres
                return logits
            return f
        return make

    for freq, pres in [(1.5, 0.0), (0.0, 1.5)]:
        prompt, ref = clear_reference(llama_path, openai_proc(freq, pres))
        plain = engine.generate(input_ids=prompt, sampling_params=greedy())[0]
        out = engine.generate(input_ids=prompt,
                              sampling_params=greedy(frequency_penalty=freq, presence_penalty=pres))[0]
        assert out.output_token_ids == ref
        assert out.output_token_ids != plain.output_token_ids
