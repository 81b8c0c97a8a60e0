"""True on-policy: the trainer's logprobs (``trainer_bridge.on_policy.engine_logprobs`` on a Hugging Face
model) equal the batch-invariant engine's bit for bit in bf16; its gradient is the standard one; the
batch-invariant mode's kernels are row-invariant (prefill = decode, any chunk of rows)."""

from __future__ import annotations

import pytest
import torch
from helpers import random_prompts

from rollout import RolloutEngine, SamplingParams


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen2"])
def arch_model(request, model_dir):
    return request.param, model_dir(f"on-policy-{request.param}", request.param, seed=41, hidden_size=128,
                                    intermediate_size=256, num_layers=2)


def _hf(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def _rollouts(path, temperature, deterministic=True, **kw):
    prompts = random_prompts(300, [5, 23, 9, 14], seed=42)
    sp = SamplingParams(n=2, max_new_tokens=10, temperature=temperature, seed=7, ignore_eos=True)
    with RolloutEngine(path, dtype="bfloat16", kv_cache_tokens=2048, deterministic=deterministic, **kw) as e:
        return e.generate(input_ids=prompts, sampling_params=sp)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_trainer_s_bf16_logprobs_are_the_engine_s_bit_for_bit(arch_model, temperature):
    from trainer_bridge.grpo import completion_logits
    from trainer_bridge.on_policy import engine_logprobs

    arch, path = arch_model
    outs = _rollouts(path, temperature, max_num_batched_tokens=16)  # chunked prefill, batched decode
    seqs = [o.prompt_token_ids + o.output_token_ids for o in outs]
    prompt_lens = [len(o.prompt_token_ids) for o in outs]
    hf = _hf(path, torch.bfloat16)
    got = engine_logprobs(hf, seqs, prompt_lens, temperature)
    for lp, o in zip(got, outs):
        assert lp.dtype == torch.float32 and lp.detach().tolist() == o.output_logprobs  # exactly
    # one sequence at a time packs other rows: the same bits
    alone = engine_logprobs(hf, seqs[3:4], prompt_lens[3:4], temperature)[0]
    assert torch.equal(alone.detach(), got[3].detach())
    # the plain transformers forward the trainer used before: the bf16 mismatch the field fights
    with torch.no_grad():
        logits = completion_logits(hf, seqs, prompt_lens)
    plain = [torch.log_softmax(lg / temperature, -1).gather(1, torch.tensor(o.output_token_ids)[:, None])[:, 0]
             for lg, o in zip(logits, outs)]
    diff = max(float((p - torch.tensor(o.output_logprobs)).abs().max()) for p, o in zip(plain, outs))
    assert 0 < diff < 0.5


def test_the_gradient_is_the_standard_forward_s(model_dir):
    """fp32: the engine's forward agrees with transformers' within fp32 rounding, and so do the gradients of
    a GRPO-like loss (each kernel's backward is the standard one of its math)."""
    from trainer_bridge.grpo import completion_logits
    from trainer_bridge.on_policy import engine_logprobs

    path = model_dir("on-policy-grad", "qwen2", seed=43, hidden_size=64, intermediate_size=128, num_layers=2)
    seqs = random_prompts(300, [12, 7, 19], seed=44)
    prompt_lens = [4, 3, 10]
    weights = torch.tensor([0.5, -1.0, 2.0])
    grads = []
    for ours in (True, False):
        hf = _hf(path, torch.float32)
        if ours:
            lps = engine_logprobs(hf, seqs, prompt_lens, 0.8)
        else:
            logits = completion_logits(hf, seqs, prompt_lens)
            lps = [torch.log_softmax(lg / 0.8, -1).gather(1, torch.tensor(s[p:])[:, None])[:, 0]
                   for lg, s, p in zip(logits, seqs, prompt_lens)]
        sum(w * lp.sum() for w, lp in zip(weights, lps)).backward()
        grads.append({n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None})
        if ours:
            values = torch.cat([lp.detach() for lp in lps])
        else:
            assert torch.allclose(values, torch.cat([lp.detach() for lp in lps]), atol=2e-5)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], rtol=1e-3, atol=1e-5), name


def test_prefill_of_a_rollout_gives_the_decode_steps_bits(arch_model):
    """Scoring a rollout in one prefill (every position at once) reports the logprobs its decode steps
    reported, bit for bit, in bf16 — and a position is the same after a prefix-cache hit."""
    _, path = arch_model
    prompts = random_prompts(300, [11, 6], seed=45)
    sp = SamplingParams(n=1, max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    with RolloutEngine(path, dtype="bfloat16", kv_cache_tokens=2048, deterministic=True) as e:
        gen = e.generate(input_ids=prompts, sampling_params=sp)
        for _ in range(2):  # the second pass finds every prompt in the prefix cache
            scored = e.score([o.prompt_token_ids for o in gen], [o.output_token_ids for o in gen], sp)
            assert [s.output_logprobs for s in scored] == [o.output_logprobs for o in gen]


def test_chunked_gemm_is_row_invariant_or_the_mode_takes_the_tiled_kernel():
    from rollout.kernels.cpu import invariant
    from rollout.kernels.cpu.capability import cpu_capability

    kernel = invariant.gemm_kernel(torch.bfloat16, [(200, 96)])
    assert kernel == ("chunked" if cpu_capability().onednn_bf16 and invariant.chunk_sizes(200, 96) else "tiled")
    assert invariant.gemm_kernel(torch.float32, [(200, 96)]) == "tiled"
    w = (torch.randn(200, 96) * 0.1).bfloat16()
    x = torch.randn(300, 96).bfloat16()
    for k in ("tiled", kernel):  # 300 rows: a call of the largest chunk size and one padded
        full = invariant.linear(x, w, None, k)
        for rows in (1, 2, 9, 63, 64, 65, 257, 299):
            assert torch.equal(invariant.linear(x[-rows:], w, None, k), full[-rows:]), (k, rows)
        assert (full.float() - torch.nn.functional.linear(x.float(), w.float())).abs().max() < 0.05


def test_true_on_policy_refuses_what_it_cannot_replay():
    from trainer_bridge.grpo import GRPOConfig

    with pytest.raises(ValueError, match="temperature sampling only"):
        GRPOConfig(true_on_policy=True, top_p=0.9)
    with pytest.raises(ValueError, match="LoRA"):
        GRPOConfig(true_on_policy=True, lora_name="policy")
