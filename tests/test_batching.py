"""Prefix sharing, the prefix cache, preemption and seeded determinism."""

import pytest
from helpers import random_prompts

from rollout import RolloutEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(llama_path, module_engines):
    return module_engines(llama_path, kv_cache_tokens=4096, use_generation_config=False)


def sp(**kw):
    base = dict(max_new_tokens=10, temperature=1.0, ignore_eos=True)
    base.update(kw)
    return SamplingParams(**base)


def test_n_samples_share_one_prefill(engine):
    prompt = random_prompts(300, [37], seed=7)[0]  # 37 = 2 full blocks + a partial one
    engine.flush_cache()
    before = engine.get_stats()
    outs = engine.generate(input_ids=prompt, sampling_params=sp(n=8, seed=100))
    after = engine.get_stats()
    assert after["num_prefill_tokens"] - before["num_prefill_tokens"] == len(prompt)
    assert after["num_forked_samples"] - before["num_forked_samples"] == 7
    assert [o.sample_index for o in outs] == list(range(8))
    engine.flush_cache()
    separate = engine.generate(input_ids=[prompt] * 8, sampling_params=[sp(seed=100 + i) for i in range(8)])
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in separate]
    for a, b in zip(outs, separate):
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
    assert len({tuple(o.output_token_ids) for o in outs}) > 1, "different sample seeds gave identical samples"


def test_prefix_cache_hit_gives_cold_tokens(engine):
    prompt = random_prompts(300, [40], seed=8)[0]
    engine.flush_cache()
    cold = engine.generate(input_ids=prompt, sampling_params=sp(seed=3))[0]
    hits = engine.get_stats()["prefix_cache_hit_tokens"]
    warm = engine.generate(input_ids=prompt, sampling_params=sp(seed=3))[0]
    assert engine.get_stats()["prefix_cache_hit_tokens"] - hits == 32  # two full 16-token blocks
    assert warm.num_cached_tokens == 32 and cold.num_cached_tokens == 0
    assert warm.output_token_ids == cold.output_token_ids
    assert warm.output_logprobs == pytest.approx(cold.output_logprobs, abs=1e-5)


def test_preemption_keeps_tokens(llama_path, engine):
    prompts = random_prompts(300, [20, 25, 30, 18, 22, 27], seed=9)
    params = sp(max_new_tokens=40, seed=21)
    ref = engine.generate(input_ids=prompts, sampling_params=params)
    # 8 blocks of 16 tokens cannot hold six sequences of ~60 tokens: the scheduler must preempt.
    with RolloutEngine(llama_path, dtype="float32", kv_cache_tokens=128, max_model_len=128) as small:
        outs = small.generate(input_ids=prompts, sampling_params=params)
        assert small.get_stats()["num_preemptions"] > 0
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in ref]
    assert sum(o.num_preemptions for o in outs) > 0


def test_admission_keeps_room_for_decode_so_preemption_is_the_exception(llama_path, engine):
    """``decode_reserve_ratio``: admission leaves free the KV the running sequences grow into (that share of
    their remaining new tokens). Reserving all of it, a pool too small for every sequence at once runs them in
    waves with no preemption; reserving none preempts; the tokens are the same."""
    prompts = random_prompts(300, [20, 25, 30, 18, 22, 27], seed=9)
    params = sp(max_new_tokens=40, seed=21)
    ref = engine.generate(input_ids=prompts, sampling_params=params)
    runs = {}
    for ratio in (0.0, 1.0):
        with RolloutEngine(llama_path, dtype="float32", kv_cache_tokens=128, max_model_len=128,
                           decode_reserve_ratio=ratio) as small:
            runs[ratio] = (small.generate(input_ids=prompts, sampling_params=params),
                           small.get_stats()["num_preemptions"])
    assert runs[0.0][1] > 0 and runs[1.0][1] == 0
    for outs, _ in runs.values():
        assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in ref]


def test_seed_independent_of_batch_composition(engine):
    target, *others = random_prompts(300, [12, 30, 7, 25], seed=10)
    alone = engine.generate(input_ids=target, sampling_params=sp(seed=42))[0]
    mixed = engine.generate(input_ids=[others[0], target, *others[1:]],
                            sampling_params=[sp(seed=1), sp(seed=42), sp(seed=2), sp(n=3, seed=9)])
    assert mixed[1].output_token_ids == alone.output_token_ids
    other_seed = engine.generate(input_ids=target, sampling_params=sp(seed=43))[0]
    assert other_seed.output_token_ids != alone.output_token_ids


def test_unseeded_requests_differ_but_follow_engine_seed(llama_path):
    prompt = random_prompts(300, [10], seed=11)[0]
    runs = []
    for _ in range(2):
        with RolloutEngine(llama_path, dtype="float32", kv_cache_tokens=512, seed=5) as e:
            runs.append([o.output_token_ids for o in e.generate(input_ids=[prompt] * 3, sampling_params=sp())])
    assert runs[0] == runs[1]  # same engine seed, same request order: same samples
    assert len({tuple(t) for t in runs[0]}) == 3  # each request got its own seed
