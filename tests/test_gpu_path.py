"""The CUDA path's code, run on this CPU: device randomness, the Triton kernels under ``TRITON_INTERPRET=1``
(set by conftest.py), the decode step's device work without a host synchronisation, and its launches."""

from __future__ import annotations

import hypothesis
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.random import device_uniforms, seed_tensor, uniforms

U64 = st.integers(min_value=0, max_value=2**64 - 1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(U64 | st.integers(min_value=-2**70, max_value=2**70), st.integers(0, 2**40)),
                min_size=1, max_size=64))
def test_device_uniforms_are_the_host_uniforms_bit_for_bit(pairs):
    seeds, positions = [s for s, _ in pairs], [p for _, p in pairs]
    host = uniforms(seeds, positions)
    dev = device_uniforms(seed_tensor(seeds), torch.tensor(positions, dtype=torch.int64)).numpy()
    assert (host.view(np.uint64) == dev.view(np.uint64)).all()
    # and the float32 the sampler draws with, rounded the same way on both sides
    assert torch.equal(torch.from_numpy(host).float(), torch.from_numpy(dev).float())


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest distance between two same-dtype tensors in units of ``b``'s last place."""
    mantissa = 7 if b.dtype == torch.bfloat16 else 23
    _, exp = torch.frexp(b.float())
    ulp = torch.ldexp(torch.ones_like(b, dtype=torch.float32), exp - 1 - mantissa)
    return float(((a.float() - b.float()).abs() / ulp).max())


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_add_rms_norm_is_the_residual_add_then_the_layers_norm(dtype, hidden):
    from rollout.kernels.triton.fused import add_rms_norm
    from rollout.layers.layernorm import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(hidden, 1e-6, dtype)
    norm.weight.data = torch.randn(hidden, dtype=dtype)
    x, r = torch.randn(5, hidden, dtype=dtype), torch.randn(5, hidden, dtype=dtype) * 3
    out, res = add_rms_norm(x, r, norm.weight, 1e-6)
    assert torch.equal(res, x + r)  # the residual stored exactly as the layer adds it
    # the sum of squares is reduced in another order than torch's (fp32): a last place at most
    assert _ulps(out, norm(x + r)) <= (1 if dtype == torch.bfloat16 else 4)
    out1, res1 = add_rms_norm(x, None, norm.weight, 1e-6)
    assert res1 is x and _ulps(out1, norm(x)) <= (1 if dtype == torch.bfloat16 else 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_cache_rotates_q_and_writes_k_and_v_to_their_slots(dtype):
    from rollout.kernels.triton.fused import rope_and_cache
    from rollout.layers.rotary import RotaryEmbedding, apply_rotary

    torch.manual_seed(1)
    hq, hkv, d, t = 4, 2, 32, 6
    rope = RotaryEmbedding(d, 128, 10000.0, None)
    positions = torch.tensor([0, 5, 17, 63, 64, 127])
    cos, sin = rope.tables(positions, dtype)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, dtype=dtype)
    kc, vc = torch.zeros(10, 8, hkv, d, dtype=dtype), torch.zeros(10, 8, hkv, d, dtype=dtype)
    slots = torch.tensor([3, 9, 17, 40, 41, 79])
    q = rope_and_cache(qkv, cos, sin, kc, vc, slots, hq, hkv)
    qk = apply_rotary(qkv[:, : (hq + hkv) * d].view(t, -1, d), cos, sin)
    assert torch.equal(q, qk[:, :hq])  # every op rounded where torch rounds: the same bits
    assert torch.equal(kc.view(-1, hkv, d)[slots], qk[:, hq:])
    assert torch.equal(vc.view(-1, hkv, d)[slots], qkv[:, (hq + hkv) * d:].view(t, hkv, d))
    untouched = torch.ones(80, dtype=torch.bool)
    untouched[slots] = False
    assert not kc.view(-1, hkv, d)[untouched].any() and not vc.view(-1, hkv, d)[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_the_mlps_activation(dtype):
    import torch.nn.functional as F

    from rollout.kernels.triton.fused import silu_mul

    torch.manual_seed(2)
    gate_up = torch.randn(7, 2 * 1500, dtype=dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    # Triton's exp is not torch's (fp32: a few last places; bf16: where that crosses a rounding, one)
    assert _ulps(silu_mul(gate_up), F.silu(gate) * up) <= (1 if dtype == torch.bfloat16 else 8)


@pytest.mark.parametrize("arch", ["qwen3"])  # q/k norms on top of the llama layer (llama: the tests below)
def test_the_triton_layer_path_gives_transformers_greedy_tokens_and_logprobs(model_dir, arch):
    """The CUDA kernel plan (fused Triton ops, Triton paged decode) run on this CPU: greedy tokens equal
    transformers token for token (fp32) and logprobs match its forward, batched = alone."""
    from helpers import hf_model, random_prompts

    from rollout import RolloutEngine, SamplingParams

    path = model_dir("llama-default", "llama") if arch == "llama" else model_dir("qwen3-gpu-path", arch, seed=4)
    prompts = random_prompts(300, [5, 11, 8], seed=3)
    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    with RolloutEngine(path, dtype="float32", kv_cache_tokens=512, kernels={"triton": True}) as engine:
        assert engine.worker.model_runner.kernels.triton
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
        alone = engine.generate(input_ids=prompts[1], sampling_params=sp)
    hf = hf_model(path)
    for prompt, out in zip(prompts, outs):
        ids = list(prompt)
        with torch.no_grad():  # greedy by full forwards of transformers' model (no cache), its logprobs
            for _ in range(6):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        ref = ids[len(prompt):]
        assert out.output_token_ids == ref
        want = [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(ref)]
        assert max(abs(a - b) for a, b in zip(out.output_logprobs, want)) < 1e-4
    assert alone[0].output_token_ids == outs[1].output_token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_invariant_triton_gemm_gives_a_row_the_same_bits_in_any_batch(dtype):
    from rollout.kernels.triton.matmul import invariant_linear

    g = torch.Generator().manual_seed(7)
    w, b = (torch.randn(100, 70, generator=g) * 0.1).to(dtype), torch.randn(100, generator=g).to(dtype)
    x = torch.randn(77, 70, generator=g).to(dtype)
    full = invariant_linear(x, w, b)
    for rows in (1, 2, 31, 33, 64, 76):
        assert torch.equal(invariant_linear(x[-rows:], w, b), full[-rows:])
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    if dtype == torch.bfloat16:
        assert _ulps(full, ref.to(dtype)) <= 1  # one rounding of the fp32 sum
    else:
        assert torch.allclose(full, ref, atol=1e-5)  # the fp32 sum, in another order


def test_the_batch_invariant_mode_on_the_triton_plan_is_bitwise_and_the_trainer_reproduces_it(model_dir):
    """``deterministic=True`` on the CUDA kernel plan (under the interpreter here): one forward a step with the
    Triton GEMM of fixed tiles, the per-row Triton norm / rotary / decode attention (unsplit) — a request's bf16
    tokens and logprobs alone = among others, and its scored prefill = its decode steps (chunking, the prefix
    cache and overlap change nothing more than batching does: the CPU plan's tests). The trainer's forward on the
    same plan (``trainer_bridge.on_policy.engine_logprobs(triton=True)``: the Triton kernels as autograd
    functions) gives the engine's logprobs bit for bit."""
    from helpers import random_prompts
    from transformers import AutoModelForCausalLM

    from rollout import RolloutEngine, SamplingParams
    from trainer_bridge.on_policy import engine_logprobs

    path = model_dir("llama-invariant-triton", "llama", seed=8, hidden_size=64, intermediate_size=128, num_layers=2)
    mine = random_prompts(300, [6], seed=5)
    others = random_prompts(300, [3, 5, 4], seed=6)
    sp = SamplingParams(n=2, max_new_tokens=2, temperature=0.8, seed=3, ignore_eos=True)
    kw = dict(dtype="bfloat16", kv_cache_tokens=1024, deterministic=True, kernels={"triton": True})

    def key(outs):
        return [(o.output_token_ids, o.output_logprobs) for o in outs]

    with RolloutEngine(path, **kw) as engine:
        runner = engine.worker.model_runner
        assert runner.row_invariant and runner.gemm_plans.kernels == {"triton"}
        alone = engine.generate(input_ids=mine, sampling_params=sp)
        got = engine.generate(input_ids=others[:2] + mine + others[2:],
                              sampling_params=[SamplingParams(max_new_tokens=2, seed=1)] * 2 + [sp]
                              + [SamplingParams(max_new_tokens=2, seed=2)])
        assert key([o for o in got if o.prompt_index == 2]) == key(alone)
        scored = engine.score([o.prompt_token_ids for o in alone], [o.output_token_ids for o in alone],
                              SamplingParams(temperature=0.8))
        assert [s.output_logprobs for s in scored] == [o.output_logprobs for o in alone]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    got = engine_logprobs(hf, [o.prompt_token_ids + o.output_token_ids for o in alone],
                          [len(o.prompt_token_ids) for o in alone], 0.8, triton=True)
    assert [lp.detach().tolist() for lp in got] == [o.output_logprobs for o in alone]
    got[0].sum().backward()  # the standard gradient through the Triton forwards
    assert all(p.grad is not None and torch.isfinite(p.grad.float()).all() for p in hf.parameters() if p.requires_grad)


def _decode_batch(ctx_lens: list[int], block_size: int):
    from rollout.batch import ModelWorkerBatch

    tables, start = [], 0
    for c in ctx_lens:
        n = -(-c // block_size)
        tables.append(list(range(start, start + n)))
        start += n
    n = len(ctx_lens)
    return ModelWorkerBatch(input_ids=[7 + i for i in range(n)], block_tables=tables, ctx_lens=list(ctx_lens),
                            q_lens=[1] * n, logits_rows=list(range(n)), sample_logits_idx=list(range(n)),
                            sampling=None)


@pytest.fixture(scope="module")
def triton_engine(model_dir):
    from rollout import RolloutEngine

    path = model_dir("qwen2-gpu-path", "qwen2", seed=9, num_layers=3)
    with RolloutEngine(path, dtype="float32", kv_cache_tokens=1024, kernels={"triton": True}) as engine:
        yield engine


def test_the_decode_steps_device_work_has_no_host_sync_and_few_launches_a_layer(triton_engine):
    """The body a CUDA graph captures (``CudaGraphRunner.run``), on the CUDA kernel plan, run on this CPU under
    ``StepAudit``: no host synchronisation, at most 12 launches a layer, and the logits of the eager forward."""
    from rollout.executor.cuda_graph_runner import CudaGraphRunner
    from rollout.kernels.audit import StepAudit

    runner = triton_engine.worker.model_runner
    graphs = CudaGraphRunner(runner, 8, batch_sizes=(1, 2, 4, 8))
    batch = _decode_batch([5, 19, 33], runner.block_size)
    layer = runner.model.model.layers[1]
    per_layer = {}
    carried = layer.forward_carried

    def counted(*args, **kw):
        before = dict(audit.launches)
        out = carried(*args, **kw)
        per_layer.update({k: v - before.get(k, 0) for k, v in audit.launches.items() if v - before.get(k, 0)})
        return out

    with torch.inference_mode():
        eager = runner.forward(batch)
        n, bs = graphs.stage(batch)
        assert (n, bs) == (3, 4)
        layer.forward_carried = counted
        try:
            with StepAudit() as audit:
                logits = graphs.run(bs)
        finally:
            del layer.forward_carried
    assert audit.syncs == []
    print("launches in one layer:", per_layer)
    assert sum(per_layer.values()) <= 12, per_layer
    assert {"triton:add_rms_norm", "triton:rope_and_cache", "triton:silu_mul"} <= set(per_layer)
    assert any(name.startswith("triton:paged_decode") for name in per_layer)  # split over the context or not
    torch.testing.assert_close(logits[:n], eager, rtol=1e-5, atol=1e-5)


def test_a_host_sync_added_inside_the_step_is_refused(triton_engine):
    from rollout.executor.cuda_graph_runner import CudaGraphRunner
    from rollout.kernels.audit import HostSyncError, StepAudit

    runner = triton_engine.worker.model_runner
    graphs = CudaGraphRunner(runner, 4, batch_sizes=(1, 2, 4))
    mlp = runner.model.model.layers[0].mlp
    plain = mlp.forward
    syncs = {
        "item": lambda x: x.sum().item(),
        "tolist": lambda x: x[0, :2].tolist(),
        "bool": lambda x: bool((x > 0).any()),
        "nonzero": lambda x: (x[0] > 0).nonzero(),
        "boolean index": lambda x: x[x > 0],
        "cpu": lambda x: x.cpu(),
        "host tensor": lambda x: torch.tensor([1, 2]),
    }
    with torch.inference_mode():
        _, bs = graphs.stage(_decode_batch([4, 9], runner.block_size))
        for name, sync in syncs.items():
            mlp.forward = lambda x, sync=sync: (sync(x), plain(x))[1]
            try:
                with pytest.raises(HostSyncError), StepAudit():
                    graphs.run(bs)
                    pytest.fail(f"{name}: not refused")
            finally:
                del mlp.forward
        with StepAudit() as audit:  # and without one, the same step passes
            graphs.run(bs)
    assert audit.num_launches > 0 and not audit.syncs


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_the_static_sampler_gives_the_samplers_tokens_and_logprobs_without_a_sync(data):
    """``sample_static`` (what a CUDA graph captures) against ``sample`` on the same rows: every token and
    every logprob's bits, greedy, temperature, top-k, top-p and min-p mixed in one batch; no host sync."""
    from rollout.batch import SamplingInputs
    from rollout.kernels.audit import StepAudit
    from rollout.layers.sampler import StaticSampling, masks_of, sample, sample_static
    from rollout.random import uniforms as host_uniforms

    n = data.draw(st.integers(1, 6))
    vocab = data.draw(st.sampled_from([50, 300]))
    rows = data.draw(st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1.0, 1.3]), st.sampled_from([0, 1, 5, 40]),
                                        st.sampled_from([1.0, 0.9, 0.3, 0.0]), st.sampled_from([0.0, 0.1]),
                                        st.integers(0, 2**64 - 1), st.integers(0, 500)), min_size=n, max_size=n))
    raw = data.draw(st.booleans())
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99)))) * 3
    temps, ks, ps, mins, seeds, positions = (list(c) for c in zip(*rows))
    sampling = SamplingInputs(temperatures=temps, uniforms=host_uniforms(seeds, positions).tolist(),
                              top_ks=ks if any(k > 0 for k in ks) else None,
                              top_ps=ps if any(p < 1 for p in ps) else None,
                              min_ps=mins if any(m > 0 for m in mins) else None, raw_logprobs=raw, seeds=seeds,
                              draw_positions=positions)
    mask_rows = sorted(data.draw(st.sets(st.integers(0, n - 1))))
    if mask_rows:  # and the kept sets, where asked
        sampling.mask_rows, sampling.max_mask_size = mask_rows, vocab
    assert sampling.fits_static
    want = sample(logits, sampling.to_device(vocab, torch.device("cpu")))
    bs = n + data.draw(st.integers(0, 2))  # padded rows, as a graph's batch size pads
    static = StaticSampling(8, torch.device("cpu"))
    static.stage(sampling, bs)
    padded = torch.cat([logits, torch.randn(bs - n, vocab)])
    plain = sampling.top_ks is None and sampling.top_ps is None and sampling.min_ps is None
    for filtered in (True, False) if plain else (True,):
        with StepAudit():
            outs = sample_static(padded, static, raw_logprobs=raw, filtered=filtered, masks=bool(mask_rows))
        assert torch.equal(outs[0][:n], want.token_ids)
        assert torch.equal(outs[1][:n], want.logprobs)
        if mask_rows:
            assert masks_of(outs[2][mask_rows], vocab) == want.masks
            assert torch.equal(outs[3][:n][mask_rows], want.sampling_logprobs[mask_rows])


@pytest.mark.parametrize("filtered", [False, True])
def test_the_graph_runners_sampler_samples_its_forwards_rows_as_the_sampler_does(triton_engine, filtered):
    """``CudaGraphRunner.replay`` then ``sample`` (the graphs' path, run eagerly on this CPU): the tokens and
    logprobs of ``ModelRunner.sample`` on the same logits; inputs it does not serve go back to that path."""
    from rollout.batch import SamplingInputs
    from rollout.executor.cuda_graph_runner import CudaGraphRunner
    from rollout.kernels.audit import StepAudit
    from rollout.layers.sampler import sample
    from rollout.random import uniforms as host_uniforms

    runner = triton_engine.worker.model_runner
    graphs = CudaGraphRunner(runner, 8, batch_sizes=(1, 2, 4, 8))
    batch = _decode_batch([6, 17, 30, 2, 9], runner.block_size)
    seeds, positions = [11, 2**63 + 5, 7, 7, 0], [0, 3, 9, 10, 200]
    sampling = SamplingInputs(temperatures=[1.0, 0.7, 0.0, 1.0, 1.2],
                              uniforms=host_uniforms(seeds, positions).tolist(), seeds=seeds,
                              draw_positions=positions)
    if filtered:
        sampling.top_ks, sampling.top_ps, sampling.min_ps = [0, 5, 0, 2, 0], [0.8, 1.0, 1.0, 0.5, 1.0], None
    vocab = runner.model_config.vocab_size
    with torch.inference_mode():
        logits = graphs.replay(batch)
        assert graphs.samples(logits, sampling)
        want = sample(logits, sampling.to_device(vocab, runner.device))
        with StepAudit():
            graphs.run_sampler(8, filtered)
        got = graphs.sample(sampling)
        assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.logprobs, want.logprobs)
        sampling.top_logprobs_num = 2  # not the graph's: the eager sampler takes it
        assert not graphs.samples(logits, sampling)
        assert not graphs.samples(logits[:3], SamplingInputs([1.0] * 3, [0.5] * 3, seeds=[1] * 3,
                                                             draw_positions=[0] * 3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 7])
def test_ragged_attention_is_each_sequences_causal_attention_over_its_paged_context(dtype, window):
    """One launch for a batch mixing fresh prompts, chunks behind a cached prefix and decode rows, against
    causal SDPA per sequence over the same context gathered from the cache."""
    import torch.nn.functional as F

    from rollout.kernels.triton.prefill import ragged_paged_attention

    torch.manual_seed(5)
    hq, hkv, d, bsz = 4, 2, 16, 8
    q_lens, ctx_lens = [5, 1, 20, 1, 3], [5, 9, 37, 1, 40]
    kc = torch.randn(30, bsz, hkv, d, dtype=dtype)
    vc = torch.randn(30, bsz, hkv, d, dtype=dtype)
    perm = torch.randperm(30).tolist()
    tables, start = [], 0
    for c in ctx_lens:
        n = -(-c // bsz)
        tables.append(perm[start: start + n] + [0] * (6 - n))
        start += n
    q = torch.randn(sum(q_lens), hq, d, dtype=dtype)
    starts = torch.tensor([0] + q_lens[:-1]).cumsum(0)
    out = ragged_paged_attention(q, kc, vc, starts, torch.tensor(q_lens), torch.tensor(ctx_lens),
                                 torch.tensor(tables), max(q_lens), d ** -0.5, window)
    for s, (ql, c) in enumerate(zip(q_lens, ctx_lens)):
        slots = torch.tensor([tables[s][p // bsz] * bsz + p % bsz for p in range(c)])
        k = kc.view(-1, hkv, d)[slots].float().transpose(0, 1)
        v = vc.view(-1, hkv, d)[slots].float().transpose(0, 1)
        qs = q[int(starts[s]): int(starts[s]) + ql].float().transpose(0, 1)
        pos = torch.arange(c - ql, c).unsqueeze(1)
        mask = torch.arange(c).unsqueeze(0) <= pos
        if window is not None:
            mask &= torch.arange(c).unsqueeze(0) > pos - window
        ref = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=d ** -0.5, enable_gqa=True)
        got = out[int(starts[s]): int(starts[s]) + ql].float().transpose(0, 1)
        torch.testing.assert_close(got, ref, atol=1e-5 if dtype == torch.float32 else 3e-2,
                                   rtol=1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_paged_decode_split_over_the_context_is_the_unsplit_kernel(splits):
    """Decode attention walked in parts (small batches of long contexts) and combined: the one-part kernel's
    result, and SDPA's over the gathered context."""
    import torch.nn.functional as F

    from rollout.kernels.triton.paged_decode import decode_splits, paged_decode_attention

    torch.manual_seed(6)
    hq, hkv, d, bsz = 6, 2, 16, 8
    lens = [1, 29, 64, 17]
    kc, vc = torch.randn(40, bsz, hkv, d), torch.randn(40, bsz, hkv, d)
    tables = torch.randperm(40)[:32].view(4, 8)
    q = torch.randn(4, hq, d)
    out = paged_decode_attention(q, kc, vc, tables, torch.tensor(lens), d ** -0.5, num_splits=splits)
    for i, c in enumerate(lens):
        slots = torch.tensor([int(tables[i, p // bsz]) * bsz + p % bsz for p in range(c)])
        k, v = kc.view(-1, hkv, d)[slots].transpose(0, 1), vc.view(-1, hkv, d)[slots].transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[i].unsqueeze(1), k, v, scale=d ** -0.5, enable_gqa=True).squeeze(1)
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)
    assert decode_splits(1, 2, 256) > 1 and decode_splits(256, 2, 256) == 1 and decode_splits(4, 2, 8) == 1


def test_the_graph_runner_stages_a_step_on_the_host_and_reads_placeholders_on_the_device(triton_engine):
    """``stage``: ids, positions, slots, context lengths and only the block-table columns a step reads, padded
    rows on the scratch block; ids < 0 (under overlap: the previous step's samples) read from the device."""
    from rollout.executor.cuda_graph_runner import CudaGraphRunner

    runner = triton_engine.worker.model_runner
    graphs = CudaGraphRunner(runner, 8, batch_sizes=(1, 2, 4, 8))
    bsz, scratch = runner.block_size, runner.kv.scratch_block
    batch = _decode_batch([5, 2 * bsz + 3, bsz], bsz)
    batch.input_ids, batch.has_placeholders = [-2, 9, -1], True
    future = torch.tensor([40, 41, 42])
    for _ in range(3):  # the staging buffers are used in turn: each step's values, not a stale set's
        n, bs = graphs.stage(batch, future)
    assert (n, bs) == (3, 4)
    assert graphs.input_ids[:4].tolist() == [41, 9, 40, 0]
    assert graphs.ctx_lens[:4].tolist() == [5, 2 * bsz + 3, bsz, 1]
    assert graphs.positions[:4].tolist() == [4, 2 * bsz + 2, bsz - 1, 0]
    tables = batch.block_tables
    assert graphs.slot_mapping[:4].tolist() == [tables[0][0] * bsz + 4, tables[1][2] * bsz + 2,
                                                tables[2][0] * bsz + bsz - 1, scratch * bsz]
    assert graphs.block_tables[1, :3].tolist() == tables[1] and graphs.block_tables[3, 0] == scratch


_TORCH_PATH_RUNS: dict = {}


@pytest.mark.parametrize("mode", ["plain", "overlap+speculative"])
def test_a_cpu_engine_on_the_cuda_path_samples_what_the_torch_path_samples(model_dir, mode):
    """A whole engine on the CUDA path (fused kernels, the graph runner's staging and its sampler, penalties
    from per-sequence counts on the device; bodies run eagerly here) against the torch path (penalties from
    sets rebuilt each step): the same tokens and logprobs with temperature, top-k / top-p, n > 1, repetition,
    frequency and presence penalties and a min-tokens ban — plain (with masks), and under overlap with
    speculation (whose verify rows take the sets, after which the counts are written afresh)."""
    from helpers import random_prompts

    from rollout import RolloutEngine, SamplingParams

    path = model_dir("llama-default", "llama")
    prompts = random_prompts(300, [6, 13, 9, 4, 7], seed=12)
    params = [SamplingParams(max_new_tokens=5, temperature=1.0, seed=3, n=2, ignore_eos=True),
              SamplingParams(max_new_tokens=5, temperature=0.8, top_k=30, top_p=0.9, seed=4, ignore_eos=True),
              SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True),
              SamplingParams(max_new_tokens=5, temperature=1.0, repetition_penalty=1.3, seed=5, ignore_eos=True),
              SamplingParams(max_new_tokens=8, temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.7,
                             presence_penalty=0.3, min_new_tokens=3, stop_token_ids=[17], n=2)]
    extra = {"overlap+speculative": {"enable_overlap": True, "speculative_num_draft_tokens": 3,
                                     "speculative_policy": "always"}}.get(mode, {})
    runs = {}
    if "torch" not in _TORCH_PATH_RUNS:  # the torch path's run: the same in every mode, made once
        with RolloutEngine(path, dtype="float32", kv_cache_tokens=1024, max_model_len=128,
                           kernels={"fusion": "torch"}) as e:
            _TORCH_PATH_RUNS["torch"] = (e.generate(input_ids=prompts, sampling_params=params), e.generate(
                input_ids=prompts[:3], sampling_params=params[:3], return_sampling_mask=True))
    plain_runs, masked_runs = _TORCH_PATH_RUNS["torch"]
    runs[False] = plain_runs + (masked_runs if mode == "plain" else [])
    with RolloutEngine(path, dtype="float32", kv_cache_tokens=1024, max_model_len=128, kernels={"triton": True},
                       **extra) as e:
        outs = e.generate(input_ids=prompts, sampling_params=params)
        if mode != "plain":  # again: guesses from the first round are verified now
            outs = e.generate(input_ids=prompts, sampling_params=params)
        if mode == "plain":  # the kept sets where asked (the sampler graph computes them too)
            outs += e.generate(input_ids=prompts[:3], sampling_params=params[:3], return_sampling_mask=True)
        runs[True] = outs
        assert e.worker.model_runner.graph_runner is not None and e.get_stats()["num_graph_replays"] == 0
        assert e.worker.model_runner.penalty_state is not None
        if mode != "plain":
            assert e.get_stats()["spec_verify_ct"] > 0
    assert [o.output_token_ids for o in runs[True]] == [o.output_token_ids for o in runs[False]]
    for a, b in zip(runs[True], runs[False]):
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-4
        assert a.output_token_sampling_mask == b.output_token_sampling_mask
        assert all(abs(x - y) < 1e-4 for x, y in zip(a.output_token_sampling_logprobs,
                                                     b.output_token_sampling_logprobs))
    assert mode != "plain" or any(o.output_token_sampling_mask for o in runs[True])


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_penalties_from_device_counts_are_the_sparse_sets_bit_for_bit(data):
    """The same rows sampled with penalties from the sets the host rebuilds each step and from the device's
    per-sequence counts (written from the history, then kept by recording each sampled token): the processed
    logits, tokens and logprobs are the same bits; a slot that no longer holds its history is written afresh."""
    from types import SimpleNamespace

    from rollout import SamplingParams
    from rollout.batch import PenaltySlots, SamplingInputs, ScoredPosition
    from rollout.layers.sampler import PenaltyState, apply_logit_processors, sample

    vocab, n = 40, data.draw(st.integers(1, 4))
    seqs = []
    for i in range(n):
        prompt = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
        outs = data.draw(st.lists(st.integers(0, vocab - 1), max_size=8))
        params = SamplingParams(temperature=data.draw(st.sampled_from([0.0, 1.0])), max_new_tokens=50,
                                repetition_penalty=data.draw(st.sampled_from([1.0, 1.3, 0.8])),
                                frequency_penalty=data.draw(st.sampled_from([0.0, 0.1, 0.7])),
                                presence_penalty=data.draw(st.sampled_from([0.0, 0.3]))).resolved({})
        view = ScoredPosition(params, prompt + outs, len(prompt), SimpleNamespace(top_logprobs_num=0,
                                                                                 return_sampling_mask=False), seed=i)
        seqs.append(SimpleNamespace(seq_id=i, token_ids=view.token_ids, num_prompt_tokens=len(prompt), params=params,
                                    req=view.req, seed=i, num_output_tokens=len(outs), output_ids=outs))
    hypothesis.assume(any(s.params.repetition_penalty != 1 or s.params.frequency_penalty or s.params.presence_penalty
                          for s in seqs))
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 50)))) * 3
    sparse = SamplingInputs.from_seqs(seqs, (), False)
    slots = PenaltySlots(8)
    dense = SamplingInputs.from_seqs(seqs, (), False, penalty_slots=slots)
    assert dense.repetition is None and dense.additive_penalty is None
    state = PenaltyState(8, vocab, torch.device("cpu"))
    state.write(dense.penalty_inits)
    a, b = sparse.to_device(vocab, torch.device("cpu")), dense.to_device(vocab, torch.device("cpu"))
    b.penalty_state = state
    assert torch.equal(apply_logit_processors(logits, a), apply_logit_processors(logits, b))
    want, got = sample(logits, a), sample(logits, b)
    assert torch.equal(want.token_ids, got.token_ids) and torch.equal(want.logprobs, got.logprobs)
    def step(inputs, tokens):  # what the device records and the host appends after a sampling
        state.record(torch.tensor(inputs.penalty_slots), tokens)
        for s, t in zip(seqs, tokens.tolist()):
            append(s, t)

    def append(s, t):
        s.token_ids, s.output_ids, s.num_output_tokens = s.token_ids + [t], s.output_ids + [t], s.num_output_tokens + 1

    step(dense, got.token_ids)
    for _ in range(2):  # the next steps agree with sets rebuilt from the history, nothing written afresh
        again = SamplingInputs.from_seqs(seqs, (), False, penalty_slots=slots)
        assert again.penalty_inits == []
        c = again.to_device(vocab, torch.device("cpu"))
        c.penalty_state = state
        rebuilt = SamplingInputs.from_seqs(seqs, (), False).to_device(vocab, torch.device("cpu"))
        assert torch.equal(apply_logit_processors(logits, rebuilt), apply_logit_processors(logits, c))
        step(again, sample(logits, c).token_ids)
    slot = again.penalty_slots[0]
    append(seqs[0], 1)  # a token the device never saw (an accepted speculative guess): written afresh
    fresh = SamplingInputs.from_seqs(seqs, (), False, penalty_slots=slots)
    assert [i[0] for i in fresh.penalty_inits] == ([slot] if slot >= 0 else [])
