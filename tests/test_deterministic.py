"""Batch-invariant mode (``deterministic=True``): a request's tokens and logprobs are bitwise the
same alone, in a batch of 64 mixed with other requests, with chunked prefill forced, with a warm
prefix cache and with overlap on, in bf16 and fp32 (speculation: tests/test_speculative.py; the CUDA
kernel plan: tests/test_gpu_path.py)."""

from __future__ import annotations

import pytest
from helpers import random_prompts

from rollout import RolloutEngine, SamplingParams

MINE = random_prompts(300, [9, 21, 4], seed=150)
OTHERS = random_prompts(300, [3 + (7 * i) % 30 for i in range(61)], seed=151)
SP = SamplingParams(n=2, max_new_tokens=8, temperature=0.9, top_p=0.95, seed=17, ignore_eos=True)
OTHER_SP = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("det-llama", "llama", seed=31, hidden_size=128, intermediate_size=256, num_layers=3)


def run(path, batch: bool, others: int = 61, dtype: str = "bfloat16", **kw):
    with RolloutEngine(path, dtype=dtype, kv_cache_tokens=4096, deterministic=True, **kw) as e:
        if not batch:
            outs = e.generate(input_ids=MINE, sampling_params=SP, top_logprobs_num=2)
            warm = e.generate(input_ids=MINE, sampling_params=SP, top_logprobs_num=2)  # prefix cache warm now
            assert any(o.num_cached_tokens for o in warm)
            return outs, warm
        before = others // 2  # 64 prompts by default, ours in the middle
        prompts = OTHERS[:before] + MINE + OTHERS[before:others]
        params = [OTHER_SP] * before + [SP] * len(MINE) + [OTHER_SP] * (others - before)
        outs = e.generate(input_ids=prompts, sampling_params=params, top_logprobs_num=2)
        return [o for o in outs if before <= o.prompt_index < before + len(MINE)], None


def key(outs):
    return [(o.output_token_ids, o.output_logprobs, o.output_top_logprobs) for o in outs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_alone_batched_chunked_cached_and_overlapped_are_bitwise_equal(model, dtype):
    alone, warm = run(model, batch=False, dtype=dtype)
    assert key(warm) == key(alone)
    batched, _ = run(model, batch=True, dtype=dtype)
    assert key(batched) == key(alone)
    chunked, _ = run(model, batch=True, max_num_batched_tokens=5, dtype=dtype)
    assert key(chunked) == key(alone)
    overlapped, _ = run(model, batch=True, enable_overlap=True, max_num_seqs=7, dtype=dtype)
    assert key(overlapped) == key(alone)
    assert len({tuple(o.output_token_ids) for o in alone}) > 1  # n samples stay distinct


def test_tp2_is_batch_invariant_too(model):
    """At TP=2 the same holds among TP=2 runs (the all-reduce splits each matmul's sum in two, so the
    bits may differ from TP=1's). Every token is a forward with its own all-reduces here, so the
    batch is a smaller mix (16 others); TP=1 covers the batch of 64."""
    alone, _ = run(model, batch=False, tp_size=2)
    batched, _ = run(model, batch=True, others=8, tp_size=2, max_num_batched_tokens=5)
    assert key(batched) == key(alone)
