"""Greedy generation equals transformers token for token (fp32), with exact logprobs."""

import pytest
from helpers import MIN_MARGIN, hf_greedy, output_ref_logprobs, random_prompts

from rollout import RolloutEngine, SamplingParams

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}

VARIANTS = {
    "llama-untied-gqa": dict(arch="llama", num_heads=4, num_kv_heads=2),
    "llama-tied-mqa-llama3rope": dict(arch="llama", num_heads=4, num_kv_heads=1, tie_word_embeddings=True,
                                      rope_parameters=LLAMA3_ROPE),
    "mistral-gqa": dict(arch="mistral", num_heads=4, num_kv_heads=2),
    "qwen2-bias-tied": dict(arch="qwen2", num_heads=4, num_kv_heads=2, tie_word_embeddings=True),
    "qwen3-qknorm-headdim": dict(arch="qwen3", num_heads=4, num_kv_heads=2, head_dim=24),
}
LENGTHS = [3, 11, 20, 37]
NEW_TOKENS = 12


def checked_model(model_dir, name, spec, prompts):
    """A variant whose greedy steps all have a clear top-1 margin (tries a few seeds)."""
    for seed in range(8):
        path = model_dir(f"{name}-s{seed}", seed=seed, **spec)
        refs = [hf_greedy(path, p, NEW_TOKENS) for p in prompts]
        if min(m for _, m in refs) >= MIN_MARGIN:
            return path, [r for r, _ in refs]
    pytest.fail(f"no seed gave {name} greedy margins >= {MIN_MARGIN}")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_matches_transformers(model_dir, name):
    prompts = random_prompts(300, LENGTHS, seed=1)
    path, refs = checked_model(model_dir, name, VARIANTS[name], prompts)
    # A small token budget forces chunked prefill (and mixes prefill chunks with decodes).
    with RolloutEngine(path, dtype="float32", kv_cache_tokens=1024, max_num_batched_tokens=7) as engine:
        outs = engine.generate(input_ids=prompts,
                               sampling_params=SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
        assert [o.prompt_index for o in outs] == list(range(len(prompts)))
        for prompt, ref, out in zip(prompts, refs, outs):
            assert out.output_token_ids == ref
            assert out.finish_reason == "length"
            ref_lp = output_ref_logprobs(path, prompt, ref)
            assert out.output_logprobs == pytest.approx(ref_lp, abs=1e-4)
        # Alone and batched give the same tokens.
        alone = engine.generate(input_ids=prompts[2],
                                sampling_params=SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
        assert alone[0].output_token_ids == refs[2]
