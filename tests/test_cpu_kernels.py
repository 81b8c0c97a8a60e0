"""CPU bf16 engines read oneDNN-packed copies of their linear weights: the bf16 copy gives bitwise
the same tokens and logprobs as plain ``F.linear``, the fp32 copy (large batches) the same values
up to bf16 rounding; neither is ever stale — every way the weights change (full and partial updates
from tensors, disk, a transaction; release and resume) is followed by a repack."""

import glob
import os

import pytest
import torch
from helpers import random_prompts
from safetensors.torch import load_file, save_file

from rollout import RolloutEngine, SamplingParams

SP = [SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True),
      SamplingParams(max_new_tokens=10, temperature=1.0, seed=5, n=3, ignore_eos=True)]


@pytest.fixture(scope="module")
def qwen_path(model_dir):
    return model_dir("qwen2-bias", "qwen2")  # q/k/v biases: the packed kernel adds them as F.linear does


@pytest.fixture(scope="module")
def engines(qwen_path):
    kw = dict(dtype="bfloat16", kv_cache_tokens=1024)
    with RolloutEngine(qwen_path, cpu_fp32_gemm_rows=0, **kw) as packed, \
            RolloutEngine(qwen_path, cpu_fp32_gemm_rows=1, **kw) as wide, \
            RolloutEngine(qwen_path, cpu_packed_weights=False, **kw) as plain:
        yield packed, wide, plain


def _outputs(engine, prompts):
    outs = engine.generate(input_ids=prompts, sampling_params=SP * (len(prompts) // 2))
    return [(o.output_token_ids, o.output_logprobs) for o in outs]


SCORED = [([5, 9, 14, 3, 77, 120], [33, 8, 250, 41, 7, 19, 60, 2]), ([42, 42, 7], [101, 5, 5, 280, 13])]


def _scores(engine) -> torch.Tensor:
    outs = engine.score([p for p, _ in SCORED], [o for _, o in SCORED], SamplingParams(temperature=1.0),
                        return_sampling_mask=False)
    return torch.tensor([lp for o in outs for lp in o.output_logprobs])


def _state(path, scale):
    sd = {}
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        sd.update(load_file(f))
    return {k: (v.float() * scale).to(torch.bfloat16) for k, v in sd.items()}


def test_packed_weights_are_used_and_bitwise_equal_through_every_weight_change(engines, qwen_path, tmp_path):
    packed, wide, plain = engines
    runner, wide_runner = packed.worker.model_runner, wide.worker.model_runner
    assert runner._packed_modules and plain.worker.model_runner._packed_modules == []
    prompts = random_prompts(300, [7, 12, 5, 9], seed=1)
    first = _outputs(packed, prompts)
    assert first == _outputs(plain, prompts)
    assert all(m.packed_weight is not None and m.packed_weight.wide is None for m in runner._packed_modules)
    before = _scores(plain)
    assert (_scores(wide) - before).abs().max() < 0.03  # bf16 rounding apart
    assert all(m.packed_weight.wide is not None for m in wide_runner._packed_modules)

    def same_after(change):
        for e in (packed, wide, plain):
            res = change(e)
            assert res is None or res.success, res.message
        now = _outputs(packed, prompts)
        assert now == _outputs(plain, prompts)
        assert runner._packed_generation == runner.weights_generation  # repacked, not stale
        plain_scores = _scores(plain)
        assert (_scores(wide) - plain_scores).abs().max() < 0.03
        assert wide_runner._wide_generation == wide_runner.weights_generation
        return now, plain_scores

    full = _state(qwen_path, 1.3)
    after_full, scores = same_after(lambda e: e.update_weights_from_tensor(list(full.items())))
    # the weights did change (by far more than rounding), and the packed copies followed
    assert after_full != first and (scores - before).abs().max() > 0.3
    name = "model.layers.0.mlp.down_proj.weight"
    same_after(lambda e: e.update_weights_from_tensor([(name, full[name] * 2)], partial=True))
    disk = tmp_path / "disk"
    disk.mkdir()
    for f in os.listdir(qwen_path):
        if not f.endswith(".safetensors"):
            os.symlink(os.path.join(qwen_path, f), disk / f)
    save_file(_state(qwen_path, 0.97), str(disk / "model.safetensors"))
    same_after(lambda e: e.update_weights_from_disk(str(disk)))

    def transaction(e):
        assert e.begin_weight_update().success
        assert e.update_weights_from_tensor(list(_state(qwen_path, 1.02).items()), transaction=True).success
        return e.commit_weight_update()
    same_after(transaction)

    def release_resume(e):
        assert e.release_memory_occupation(["weights"], backup_weights=True).success
        return e.resume_memory_occupation(["weights"])
    same_after(release_resume)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_kernel_equals_sdpa_over_the_gathered_context(dtype):
    """The CPU kernel reads each sequence's blocks in place: GQA groups, partial last blocks,
    scattered block tables and a sliding window, against SDPA over the gathered context."""
    from rollout.layers.paged_decode_cpu import load, paged_decode_attention

    assert load() is not None, "the C++ kernel did not build on this machine"
    g = torch.Generator().manual_seed(3)
    for hq, hkv, d, bs, window in ((9, 3, 64, 16, None), (4, 4, 32, 8, 5), (8, 1, 128, 16, None)):
        nb, b = 120, 5
        kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
        vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
        lens = torch.tensor([1, bs, bs + 1, 7 * bs - 3, 10 * bs])
        tables = torch.randperm(nb, generator=g)[: b * 10].view(b, 10)
        q = torch.randn(b, hq, d, generator=g).to(dtype)
        out = paged_decode_attention(q, kc, vc, tables, lens, d ** -0.5, window)
        for i in range(b):
            n = int(lens[i])
            pos = torch.arange(max(0, n - window) if window else 0, n)
            slots = tables[i][pos // bs] * bs + pos % bs
            k = kc.view(-1, hkv, d)[slots].float().transpose(0, 1).repeat_interleave(hq // hkv, 0)
            v = vc.view(-1, hkv, d)[slots].float().transpose(0, 1).repeat_interleave(hq // hkv, 0)
            ref = torch.nn.functional.scaled_dot_product_attention(q[i].float().unsqueeze(1), k, v,
                                                                    scale=d ** -0.5).squeeze(1)
            tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the output
            assert (out[i].float() - ref).abs().max() < tol


def test_bf16_decode_with_the_kernel_reports_what_a_prefill_scores(qwen_path):
    """Logprobs drawn while decoding through the kernel equal, up to bf16 rounding, the same tokens
    scored by a prefill (gather + SDPA), as they do on the gather path."""
    prompts = random_prompts(300, [9, 30, 4], seed=2)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    worst, mean = {}, {}
    for kernel in (True, False):
        with RolloutEngine(qwen_path, dtype="bfloat16", kv_cache_tokens=1024, cpu_paged_attention=kernel) as e:
            assert e.worker.model_runner.use_paged_kernel == kernel
            outs = e.generate(input_ids=prompts, sampling_params=sp)
            scored = e.score(prompts, [o.output_token_ids for o in outs], SamplingParams(temperature=1.0),
                             return_sampling_mask=False)
        diffs = [abs(x - y) for o, s in zip(outs, scored) for x, y in zip(o.output_logprobs, s.output_logprobs)]
        worst[kernel], mean[kernel] = max(diffs), sum(diffs) / len(diffs)
    # bf16 decode and prefill round differently (the gather path shows how much); a wrong block or
    # softmax would be off by whole nats
    assert worst[True] < 0.15 and mean[True] < 2 * mean[False] + 0.005, (worst, mean)
