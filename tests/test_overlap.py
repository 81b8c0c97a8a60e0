"""Overlap scheduling with delayed sampling gives exactly the tokens of the plain loop."""

import asyncio

import pytest
from helpers import random_prompts

from rollout import RolloutEngine, SamplingParams


def workload(engine):
    prompts = random_prompts(300, [5, 18, 33, 9], seed=40)
    params = [
        SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_new_tokens=24, temperature=0.9, seed=7, n=3, repetition_penalty=1.3,
                       frequency_penalty=0.5, presence_penalty=0.3, ignore_eos=True),
        SamplingParams(max_new_tokens=24, temperature=1.0, seed=8, min_new_tokens=6, top_k=30, top_p=0.9,
                       logit_bias={engine.tokenizer.eos_token_id: 4.0}),
        SamplingParams(max_new_tokens=24, temperature=0.7, seed=9, stop=["e"], min_p=0.05),
    ]
    return engine.generate(input_ids=prompts, sampling_params=params, logprob_start_len=2, top_logprobs_num=2)


@pytest.mark.parametrize("tp", [1, 2])
def test_overlap_on_off_identical(llama_path, tp):
    results = {}
    for overlap in (False, True):
        with RolloutEngine(llama_path, dtype="float32", kv_cache_tokens=1024, enable_overlap=overlap,
                           tp_size=tp, max_num_batched_tokens=24) as e:
            results[overlap] = workload(e)
            stats = e.get_stats()
            assert stats["num_free_blocks"] == stats["num_blocks"]  # nothing leaked by extra slots
    off, on = results[False], results[True]
    assert [o.output_token_ids for o in off] == [o.output_token_ids for o in on]
    assert [o.finish_reason for o in off] == [o.finish_reason for o in on]
    assert any(o.finish_reason == "stop" for o in off)
    for a, b in zip(off, on):
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
        assert a.input_logprobs[1:] == pytest.approx(b.input_logprobs[1:], abs=1e-5)
        assert a.text == b.text


def test_overlap_abort_and_preemption(llama_path):
    prompts = random_prompts(300, [20, 25, 30, 18, 22, 27], seed=41)
    sp = SamplingParams(max_new_tokens=40, temperature=1.0, seed=5, ignore_eos=True)
    outs = {}
    for overlap in (False, True):
        with RolloutEngine(llama_path, dtype="float32", kv_cache_tokens=128, max_model_len=128,
                           enable_overlap=overlap) as e:
            outs[overlap] = e.generate(input_ids=prompts, sampling_params=sp)
            assert e.get_stats()["num_preemptions"] > 0
    assert [o.output_token_ids for o in outs[False]] == [o.output_token_ids for o in outs[True]]

    async def run(engine):
        last, aborted = None, False
        stream = await engine.async_generate(input_ids=prompts[0], rid="a", stream=True,
                                             sampling_params=SamplingParams(max_new_tokens=100, ignore_eos=True))
        async for o in stream:
            if not aborted and len(o.output_token_ids) >= 2:
                engine.abort_request("a")
                aborted = True
            last = o
        return last

    with RolloutEngine(llama_path, dtype="float32", kv_cache_tokens=1024, enable_overlap=True) as e:
        out = asyncio.run(run(e))
        assert out.finish_reason == "abort" and len(out.output_logprobs) == len(out.output_token_ids) < 100
        e.flush_cache()  # drains the pipeline instead of failing
        stats = e.get_stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]
        assert e.generate(input_ids=prompts[1], sampling_params=sp)[0].output_token_ids == \
            outs[False][1].output_token_ids
