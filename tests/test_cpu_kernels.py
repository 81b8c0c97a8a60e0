"""CPU GEMM kernels (``rollout.kernels.cpu.plan``) and the paged decode kernel, on whatever CPU runs
the suite. Each kernel is forced through the engine options so every path runs on every machine:
the base kernel (oneDNN-packed bf16 where the CPU has native bf16 — bitwise ``F.linear`` — plain
``F.linear`` elsewhere), the fp32-compute path (fp32 copies of bf16 weights), the C++ kernel that
reads bf16 weights in place and the register-tiled C++ GEMM over fp32 panels; none is ever stale —
every way the weights change (full and partial updates from tensors, disk, a transaction; release
and resume) drops the copies, rebuilt at the next forward."""

import glob
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import random_prompts
from safetensors.torch import load_file, save_file

from rollout import RolloutEngine, SamplingParams
from rollout.kernels.cpu.capability import KERNEL_ISAS, cpu_capability

SP = [SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True),
      SamplingParams(max_new_tokens=10, temperature=1.0, seed=5, n=3, ignore_eos=True)]
BASE = "onednn" if cpu_capability().onednn_bf16 else "linear"  # what a bf16 GEMM runs without copies


@pytest.fixture(scope="module")
def qwen_path(model_dir):
    return model_dir("qwen2-bias", "qwen2")  # q/k/v biases: every kernel adds them as F.linear does


@pytest.fixture(scope="module")
def engines(qwen_path):
    kw = dict(dtype="bfloat16", kv_cache_tokens=1024, kernel_unfused=("norm",))  # GEMM kernels alone differ
    with RolloutEngine(qwen_path, kernel_fp32_gemm_rows=0, kernel_small_gemm_rows=0, **kw) as base, \
            RolloutEngine(qwen_path, kernel_gemm="fp32", **kw) as wide, \
            RolloutEngine(qwen_path, kernel_fp32_gemm_rows=0, kernel_small_gemm_rows=64, **kw) as own, \
            RolloutEngine(qwen_path, kernel_gemm="tiled", **kw) as tiled, \
            RolloutEngine(qwen_path, kernel_gemm="linear", **kw) as plain:
        yield base, wide, own, tiled, plain


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


def test_every_kernel_runs_where_forced_and_copies_follow_every_weight_change(engines, qwen_path, tmp_path):
    base, wide, own, tiled, plain = engines
    runners = {e: e.worker.model_runner for e in engines}
    assert runners[base].gemm_plans.kernels == {BASE}  # the capability decides the base kernel
    assert runners[wide].gemm_plans.kernels == {"fp32"} and runners[own].gemm_plans.kernels == {"own", BASE}
    assert runners[tiled].gemm_plans.kernels == {"tiled"}
    assert runners[plain]._packed_modules == []
    prompts = random_prompts(300, [7, 12, 5, 9], seed=1)
    first = _outputs(base, prompts)
    assert first == _outputs(plain, prompts)  # oneDNN-packed bf16 is bitwise F.linear
    before = _scores(plain)
    for e in (wide, own, tiled):  # fp32 sums in another order: bf16 rounding apart
        assert (_scores(e) - before).abs().max() < 0.03
    fp32_bytes = sum(4 * m.weight.numel() + (4 * m.bias.numel() if m.packed_weight.wide_bias is not None else 0)
                     for m in runners[wide]._packed_modules)
    assert runners[wide].weight_copies_nbytes() == fp32_bytes > runners[wide].weights_nbytes()  # counted
    assert runners[own].weight_copies_nbytes() == 0  # reads the weights in place
    panel_bytes = sum(m.packed_weight.panels.numel() * 4 for m in runners[tiled]._packed_modules)
    assert runners[tiled].weight_copies_nbytes() == panel_bytes >= sum(4 * m.weight.numel()
                                                                       for m in runners[tiled]._packed_modules)

    def same_after(change):
        for e in engines:
            res = change(e)
            assert res is None or res.success, res.message
        now = _outputs(base, prompts)
        assert now == _outputs(plain, prompts)
        plain_scores = _scores(plain)
        for e in (wide, own, tiled):
            assert (_scores(e) - plain_scores).abs().max() < 0.03
        assert runners[wide].copy_generation("fp32") == runners[wide].weights_generation  # rebuilt, not stale
        assert runners[tiled].copy_generation("tiled") == runners[tiled].weights_generation
        if BASE == "onednn":
            assert runners[base].copy_generation("onednn") == runners[base].weights_generation
        return now, plain_scores

    full = _state(qwen_path, 1.3)
    after_full, scores = same_after(lambda e: e.update_weights_from_tensor(list(full.items())))
    # the weights did change (by far more than rounding), and the copies followed
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
        assert e.worker.model_runner.weight_copies_nbytes() == 0  # copies are freed with the weights
        return e.resume_memory_occupation(["weights"])
    same_after(release_resume)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17, 64])
def test_own_bf16_gemm_is_fp32_accumulation_rounded_once(rows):
    """The C++ kernel against fp64 over the same bf16 values: within one bf16 rounding of the
    output, as F.linear is; odd shapes (a last tile of fewer rows, columns past the last vector)."""
    from rollout.kernels.cpu import ops as cpu_gemm

    assert cpu_gemm.load() is not None, "the C++ kernels did not build on this machine"
    g = torch.Generator().manual_seed(rows)
    for n, k in ((96, 64), (37, 131), (5, 8)):
        x = torch.randn(rows, k, generator=g).bfloat16()
        w = torch.randn(n, k, generator=g).bfloat16()
        b = torch.randn(n, generator=g).bfloat16()
        ref = x.double() @ w.double().T + b.double()
        ulp = ref.abs().clamp(min=1e-3) * 2 ** -8  # one bf16 rounding
        y = cpu_gemm.bf16_linear(x, w, b)
        assert y.dtype == torch.bfloat16 and ((y.double() - ref).abs() <= ulp).all()
        assert ((F.linear(x, w, b).double() - ref).abs() <= ulp).all()
        y32 = cpu_gemm.bf16_linear(x.float(), w, b.float())  # fp32 activations: fp32 out, no rounding
        assert y32.dtype == torch.float32 and ((y32.double() - ref).abs() <= 1e-5 * ref.abs().clamp(min=1)).all()
        w32 = torch.randn(n, k, generator=g)  # fp32 weights (an fp32 engine's small batches)
        ref32 = x.double() @ w32.double().T + b.double()
        y32 = cpu_gemm.bf16_linear(x.float(), w32, b.float())
        assert y32.dtype == torch.float32 and ((y32.double() - ref32).abs() <= 1e-5 * ref32.abs().clamp(min=1)).all()


def test_bf16_dot_product_gemm_is_one_rounding_from_fp64_and_a_rows_bits_are_its_own():
    """The ``avx512bf16`` variant's small-batch GEMM at five to eight bf16 rows (AVX512-BF16's dot
    products): within one bf16 rounding of fp64 over the same values, with a bias, odd N and K (a
    weight row paired with none, columns past the last vector); a row's bits are the same in every
    batch of five to eight rows and on one or two threads (each output summed in one order whatever
    its neighbours)."""
    from rollout.kernels.cpu import build as cpu_build

    cap = cpu_capability()
    if "avx512bf16" not in cap.runnable_isas:
        pytest.skip(f"needs AVX512-BF16 (avx512_bf16 with AVX-512 F/BW/VL); this CPU runs {', '.join(cap.runnable_isas)}")
    k = cpu_build.kernels_for("avx512bf16")
    g = torch.Generator().manual_seed(5)
    threads = torch.get_num_threads()
    try:
        for n, kk in ((96, 64), (37, 531), (5, 8), (300, 40), (41, 1536)):
            x = torch.randn(8, kk, generator=g).bfloat16()
            w = torch.randn(n, kk, generator=g).bfloat16()
            b = torch.randn(n, generator=g).bfloat16()
            ref = x.double() @ w.double().T + b.double()
            torch.set_num_threads(2)
            y = k.bf16_linear(x, w, b)
            assert y.dtype == torch.bfloat16 and ((y.double() - ref).abs() <= ref.abs().clamp(min=1e-3) * 2 ** -8).all()
            for rows in (5, 6, 7, 8):
                for t in (1, 2):
                    torch.set_num_threads(t)
                    assert torch.equal(k.bf16_linear(x[:rows], w, b), y[:rows]), (n, kk, rows, t)
                    assert torch.equal(k.bf16_linear(x[-rows:], w, b), y[-rows:]), (n, kk, rows, t)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_gemm_is_fp32_accumulation_rounded_once_and_batch_invariant(dtype):
    """The register-tiled kernel against fp64 over the same values (bf16: within one rounding of the
    output; fp32: fp32 sums), with bias, odd shapes (partial panels and tiles, k past a block); each
    row's result is bitwise the same whatever rows come with it (sums over k in order), below and
    above the row count where the weights' next block is prefetched in slices."""
    from rollout.kernels.cpu import ops as cpu_gemm

    assert cpu_gemm.load() is not None, "the C++ kernels did not build on this machine"
    g = torch.Generator().manual_seed(7)
    for n, k in ((96, 64), (37, 531), (5, 8), (300, 40)):
        w = torch.randn(n, k, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype)
        panels = cpu_gemm.tile_pack(w)
        assert panels.dtype == torch.float32 and torch.equal(
            panels.transpose(1, 2).reshape(-1, k)[:n], w.float())  # the weight's values, exactly
        x = torch.randn(67, k, generator=g).to(dtype)
        ref = x.double() @ w.double().T + b.double()
        y = cpu_gemm.tiled_linear(x, panels, n, b)
        assert y.dtype == dtype and y.shape == (67, n)
        if dtype == torch.bfloat16:
            assert ((y.double() - ref).abs() <= ref.abs().clamp(min=1e-3) * 2 ** -8).all()
        else:
            assert ((y.double() - ref).abs() <= 1e-5 * ref.abs().clamp(min=1) * (k / 64) ** 0.5).all()
        for rows in (1, 5, 6, 7, 13, 23, 60):
            assert torch.equal(cpu_gemm.tiled_linear(x[:rows], panels, n, b), y[:rows])
        assert torch.equal(cpu_gemm.tiled_linear(x.view(67, 1, k), panels, n, b), y.view(67, 1, n))
    with pytest.raises(RuntimeError, match="N does not fit the panels"):
        cpu_gemm.tiled_linear(x, panels, n + 64, b)
    with pytest.raises(RuntimeError, match="disagree on K"):
        cpu_gemm.tiled_linear(x[:, :-1], panels, n, b)


@pytest.mark.parametrize("kernel", ["tiled", "fp32", "onednn"])
def test_a_gemm_of_no_rows_reads_no_copy_whatever_the_plan_names_for_it(kernel):
    """A prefill chunk none of whose positions needs logits runs the LM head over 0 rows. Copies are
    built for the forward's row counts only, so a plan whose kernel at few rows reads a copy (seen on
    an AMD EPYC with AVX-512 bf16: SmolLM2's fp32 head, tiled up to 7 rows and oneDNN from 8) must not
    be asked for one there: the result is the empty product, from the weight itself."""
    from rollout.kernels.cpu.packing import GemmPlan, PackedWeight, pack_weight, packed_linear

    w = torch.randn(48, 32, dtype=torch.float32)
    plan = GemmPlan(((7, kernel), (1 << 62, "linear")))
    packed = PackedWeight(plan)  # as refresh_packed_weights(16) leaves it: nothing the plan needs at 16 rows
    y = packed_linear(torch.randn(0, 32), w, None, packed)
    assert y.shape == (0, 48) and packed.nbytes() == 0
    with pytest.raises(AssertionError, match="refresh_packed_weights was not called"):
        packed_linear(torch.randn(3, 32), w, None, packed)  # a real forward still insists on its copy
    pack_weight(w, None, plan, {kernel}, into=packed)
    x = torch.randn(3, 32)
    torch.testing.assert_close(packed_linear(x, w, None, packed), x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_rounds_where_the_torch_path_rounds(dtype):
    """The C++ RMSNorm against the torch path it replaces: the same values up to the order of the
    sum of squares (fp32: a few ulp; bf16: at most one bf16 rounding step apart, almost all equal)."""
    from rollout.layers.layernorm import RMSNorm

    g = torch.Generator().manual_seed(1)
    for rows, h in ((1, 576), (7, 64), (33, 131)):
        norm = RMSNorm(h, 1e-5, dtype)
        norm.weight.copy_(torch.randn(h, generator=g))
        x = (3 * torch.randn(rows, h, generator=g)).to(dtype)
        ref = norm(x)
        norm.fused = True
        out = norm(x)
        assert out.dtype == dtype and out.shape == ref.shape
        if dtype == torch.float32:
            assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
        else:
            apart = (out.float() - ref.float()).abs() > 0
            assert apart.float().mean() < 0.02
            assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-6).all()


def test_gemm_plans_take_the_fastest_measured_kernel_per_shape_and_honour_bounds(tmp_path, monkeypatch):
    from rollout.kernels.cpu import plan as cpu_plan

    monkeypatch.setenv("ROLLOUT_CACHE_DIR", str(tmp_path))
    shapes, head = [(96, 64), (64, 96)], (300, 64)
    plans = cpu_plan.plan_gemms(torch.bfloat16, shapes, 2, head_shape=head)
    assert [s for s, _ in plans.plans] == [*shapes, head]  # one plan per weight shape, the LM head's too
    def timed(shape, rows):
        return {k: t[rows] for k, t in plans.for_shape(shape).timings.items() if rows in t and (k != "own" or rows <= 64)}

    for shape in [*shapes, head]:
        plan = plans.for_shape(shape)
        assert plan.how == "measured" and set(plan.timings) == set(cpu_plan.candidates(torch.bfloat16, None, None))
        for k in set(plan.timings) - set(cpu_plan.PRUNABLE) - {"own"}:  # oneDNN's kernels: timed at every row count
            assert set(plan.timings[k]) == set(cpu_plan.CANDIDATE_ROWS), k
        for rows in cpu_plan.CANDIDATE_ROWS:  # the fastest timed kernel at each candidate row count, or for
            # a layer's linears the small-batch one where its time summed over them is within OWN_MARGIN of
            # the fastest kernels' sum (the stack needs it in every linear)
            layer = [timed(s, rows) for s in shapes]
            near = shape != head and all("own" in t for t in layer) and \
                sum(t["own"] for t in layer) <= (1 + cpu_plan.OWN_MARGIN) * sum(min(t.values()) for t in layer)
            alone = timed(shape, rows)
            assert plan.kernel_for(rows) == ("own" if near else min(alone, key=alone.get)), (shape, rows)
    again = cpu_plan.plan_gemms(torch.bfloat16, shapes, 2, head_shape=head)
    assert again.for_shape(head).how == "cached"  # one measurement per machine and shape, the same choice
    assert [p.segments for _, p in again.plans] == [p.segments for _, p in plans.plans]
    bounded = cpu_plan.plan_gemms(torch.bfloat16, shapes, 2, fp32_rows=0, small_rows=None)
    assert not {"fp32", "tiled"} & bounded.kernels  # no fp32 copies: neither oneDNN's nor the panels
    forced = cpu_plan.plan_gemms(torch.bfloat16, shapes, 2, head_shape=head, kernel="tiled")
    assert forced.kernels == {"tiled"} and forced.for_shape(head).kernel_for(1) == "tiled"
    with pytest.raises(ValueError, match="kernels.gemm=.fp32. cannot run for torch.float32"):
        cpu_plan.plan_gemms(torch.float32, shapes, 2, kernel="fp32")  # fp32 copies of fp32 weights: no such path
    fixed = cpu_plan.plan_gemms(torch.bfloat16, shapes, 2, 16, 4).for_shape(shapes[0])
    assert fixed.segments == ((4, "own"), (15, BASE), (1 << 62, "fp32")) and fixed.kernel_for(200) == "fp32"


def test_a_layers_linears_keep_the_small_batch_kernel_together_where_their_sum_is_near_the_fastest(tmp_path, monkeypatch):
    """The stack runs a decode step in one call only where every linear of a layer takes the small-batch
    kernel, so the plan keeps it for all of them at a row count where their summed time is within
    OWN_MARGIN of the fastest kernels' sum: one linear 12 % slower on it (a timing that moves by that much
    between measurements) no longer sends the whole step layer by layer; a layer 30 % slower, or an fp32
    engine, takes the fastest; the LM head always does."""
    from rollout.kernels.cpu import plan as cpu_plan

    if "own" not in cpu_plan.candidates(torch.bfloat16, None, None):
        pytest.skip("needs the C++ kernels built (the small-batch kernel is a candidate only then)")
    monkeypatch.setenv("ROLLOUT_CACHE_DIR", str(tmp_path))
    shapes, head = [(96, 64), (64, 96), (192, 64)], (300, 64)
    slower = {8: {(192, 64): 1.12, (300, 64): 1.05}, 16: {(96, 64): 1.3, (64, 96): 1.3, (192, 64): 1.3}}

    def measure(dtype, timed_shapes, kernels, rows_list=cpu_plan.CANDIDATE_ROWS):
        return {f"{o}x{i}": {k: {r: (slower.get(r, {}).get((o, i), 0.95) if k == "own" else 1.0 if k == "onednn" else 2.0)
                                 for r in rows_list if k != "own" or r <= cpu_plan.OWN_MAX_ROWS}
                             for k in kernels} for o, i, _ in timed_shapes}

    monkeypatch.setattr(cpu_plan, "measure", measure)
    for dtype in (torch.bfloat16, torch.float32):
        plans = cpu_plan.plan_gemms(dtype, shapes, 2, head_shape=head)
        for shape in shapes:
            plan = plans.for_shape(shape)
            if dtype == torch.bfloat16:
                assert plan.kernel_for(8) == "own", shape  # the layer's sum 4 % over the fastest: all keep it
                assert plan.kernel_for(16) == "onednn", shape  # 30 % over: the fastest
            else:
                assert plan.kernel_for(8) == ("onednn" if shape == (192, 64) else "own"), shape  # each the fastest
        assert plans.for_shape(head).kernel_for(8) == "onednn"  # the LM head: the fastest (5 % slower on own)


def test_every_isa_variant_this_cpu_runs_gives_the_same_results(monkeypatch):
    """One build holds the kernels for every ISA; each variant this CPU can run (an AVX-512 machine
    runs the AVX2 and generic ones too, an AVX2 machine the generic one) is within rounding of fp64,
    as the CPU's own variant is; ROLLOUT_CPU_ISA picks a lower variant, and none above the CPU's is
    ever given out (it would die on an illegal instruction)."""
    from rollout.kernels.cpu import build as cpu_build

    cap = cpu_capability()
    assert cpu_build.kernels() is not None, "the C++ kernels did not build on this machine"
    assert cpu_build.kernels().isa == cap.kernel_isa and cap.kernel_isa in cap.runnable_isas
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 200, generator=g).bfloat16(), torch.randn(40, 200, generator=g).bfloat16()
    ref = x.double() @ w.double().T
    ulp = ref.abs().clamp(min=1e-3) * 2 ** -8
    norm_w = torch.randn(200, generator=g).bfloat16()
    for isa in cap.runnable_isas:
        k = cpu_build.kernels_for(isa)
        assert ((k.bf16_linear(x, w, None).double() - ref).abs() <= ulp).all(), isa
        assert ((k.tiled_linear(x, k.tile_pack(w), 40, None).double() - ref).abs() <= ulp).all(), isa
        torch.testing.assert_close(k.rms_norm(x, norm_w, 1e-6), cpu_build.kernels().rms_norm(x, norm_w, 1e-6),
                                   atol=0, rtol=2 ** -7)
        for args, refs, sdpa in _paged_cases(torch.bfloat16):
            _check_paged(k.paged_decode(*args[:5], args[5], int(args[6] or 0)), refs, sdpa, torch.bfloat16)
    for isa in [i for i in KERNEL_ISAS if i not in cap.runnable_isas]:
        with pytest.raises(ValueError, match="no .* kernels on this CPU"):
            cpu_build.kernels_for(isa)
    lowest = cap.runnable_isas[0]
    monkeypatch.setenv("ROLLOUT_CPU_ISA", lowest)
    cpu_capability.cache_clear()
    try:
        assert cpu_capability().kernel_isa == lowest and cpu_build.kernels().isa == lowest
    finally:
        monkeypatch.delenv("ROLLOUT_CPU_ISA")
        cpu_capability.cache_clear()
    assert cpu_build.kernels().isa == cap.kernel_isa


def _paged_cases(dtype, windows=True):
    """Decode attention cases over a paged cache — GQA groups, partial last blocks, scattered block
    tables, a sliding window — with, per sequence, the fp64 reference over the same (cache-dtype)
    values and what SDPA in the cache dtype gives over the gathered context (the gather path)."""
    g = torch.Generator().manual_seed(3)
    shapes = [(9, 3, 64, 16, None), (4, 4, 32, 8, 5), (8, 1, 128, 16, None), (8, 2, 64, 16, None)]
    for hq, hkv, d, bs, window in [s for s in shapes if windows or s[4] is None]:
        nb, b = 120, 5
        kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
        vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
        lens = torch.tensor([1, bs, bs + 1, 7 * bs - 3, 10 * bs])
        tables = torch.randperm(nb, generator=g)[: b * 10].view(b, 10)
        q = (2 * torch.randn(b, hq, d, generator=g)).to(dtype)
        refs, sdpa = [], []
        for i in range(b):
            n = int(lens[i])
            pos = torch.arange(max(0, n - window) if window else 0, n)
            slots = tables[i][pos // bs] * bs + pos % bs
            k = kc.view(-1, hkv, d)[slots].transpose(0, 1).repeat_interleave(hq // hkv, 0)
            v = vc.view(-1, hkv, d)[slots].transpose(0, 1).repeat_interleave(hq // hkv, 0)
            qi = q[i].unsqueeze(1)
            refs.append(F.scaled_dot_product_attention(qi.double(), k.double(), v.double(), scale=d ** -0.5).squeeze(1))
            sdpa.append(F.scaled_dot_product_attention(qi, k, v, scale=d ** -0.5).squeeze(1))
        yield (q, kc, vc, tables, lens, d ** -0.5, window), refs, sdpa


def _check_paged(out, refs, sdpa, dtype, rounding=2 ** -8):
    for i, ref in enumerate(refs):
        err = (out[i].double() - ref).abs().max().item()
        if dtype == torch.float32:
            assert err < 1e-5
        else:  # as precise as SDPA in bf16 over the same values, up to one rounding of the output
            assert err <= (sdpa[i].double() - ref).abs().max().item() + rounding * ref.abs().max().item(), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_kernel_is_as_precise_as_sdpa_over_the_gathered_context(dtype):
    """The CPU kernel reads each sequence's blocks in place; against fp64 over the same values it
    is within what SDPA over the gathered context achieves."""
    from rollout.kernels.cpu.ops import load, paged_decode_attention

    assert load() is not None, "the C++ kernel did not build on this machine"
    for args, refs, sdpa in _paged_cases(dtype):
        _check_paged(paged_decode_attention(*args), refs, sdpa, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_paged_decode_kernel_under_the_interpreter(dtype):
    """The CUDA decode kernel (Triton) run by Triton's interpreter on this CPU, against the same
    reference as the C++ kernel (it has no sliding window: the engine keeps gather + SDPA there)."""
    pytest.importorskip("triton", reason="needs the test extra 'triton' (pip install -e '.[test]')")
    assert os.environ.get("TRITON_INTERPRET") == "1"  # set by conftest.py before triton is imported
    from rollout.kernels.triton.paged_decode import paged_decode_attention

    for args, refs, sdpa in _paged_cases(dtype, windows=False):
        # the interpreter truncates fp32 -> bf16 stores (a GPU rounds to nearest): one whole bf16 ulp
        _check_paged(paged_decode_attention(*args[:-1]), refs, sdpa, dtype, rounding=2 ** -7)


def _bf16_values_in_fp32(path, out):
    """The checkpoint at ``path`` with every weight rounded to bf16, stored as fp32: an fp32 engine
    over it computes in fp32 over exactly the values a bf16 engine holds."""
    out.mkdir()
    for f in os.listdir(path):
        if not f.endswith(".safetensors"):
            os.symlink(os.path.join(path, f), out / f)
    save_file({k: v.float() for k, v in _state(path, 1.0).items()}, str(out / "model.safetensors"))
    return str(out)


def test_bf16_decode_through_the_kernel_is_as_precise_as_the_gather_path(qwen_path, tmp_path):
    """Logprobs drawn while decoding in bf16, through the kernel and through gather + SDPA, each
    against an fp32 computation over the same bf16 weights: the kernel's error is the gather path's
    (both are bf16 rounding; a wrong block or softmax would be off by whole nats)."""
    prompts = random_prompts(300, [9, 30, 4], seed=2)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    drawn = {}
    for kernel in (True, False):
        unfused = () if kernel else ("paged_attention",)
        with RolloutEngine(qwen_path, dtype="bfloat16", kv_cache_tokens=1024, kernel_unfused=unfused) as e:
            assert e.worker.model_runner.use_paged_kernel == kernel
            drawn[kernel] = e.generate(input_ids=prompts, sampling_params=sp)
    worst, mean = {}, {}
    with RolloutEngine(_bf16_values_in_fp32(qwen_path, tmp_path / "ref"), dtype="float32", kv_cache_tokens=1024,
                       kernel_gemm="linear", kernel_unfused=("paged_attention",)) as ref:
        for kernel, outs in drawn.items():
            scored = ref.score(prompts, [o.output_token_ids for o in outs], SamplingParams(temperature=1.0),
                               return_sampling_mask=False)
            diffs = [abs(x - y) for o, r in zip(outs, scored) for x, y in zip(o.output_logprobs, r.output_logprobs)]
            worst[kernel], mean[kernel] = max(diffs), sum(diffs) / len(diffs)
    assert worst[True] < 0.15 and mean[True] < 1.3 * mean[False] + 0.002, (worst, mean)


def _torch_rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots, hq, hkv):
    """The torch path the fused call replaces (``LlamaAttention`` + ``PagedAttention`` at decode)."""
    from rollout.layers.rotary import apply_rotary

    t, d = qkv.shape[0], k_cache.shape[-1]
    qk = apply_rotary(qkv[:, : (hq + hkv) * d].view(t, -1, d), cos, sin)
    k_cache.view(-1, hkv, d).index_copy_(0, slots, qk[:, hq:])
    v_cache.view(-1, hkv, d).index_copy_(0, slots, qkv[:, (hq + hkv) * d:].view(t, hkv, d))
    return qk[:, :hq].contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rotary_and_kv_write_is_the_torch_path_bit_for_bit(dtype):
    """One C++ call rotates q and k and writes k and v into their slots: the same bits as the four
    rotary operators and two index_copy_ calls it replaces, in every ISA variant this CPU runs; a
    slot outside the cache is refused before anything is written."""
    from rollout.kernels.cpu import build as cpu_build
    from rollout.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(4)
    hq, hkv, d, blocks, bs = 9, 3, 64, 6, 4
    rotary = RotaryEmbedding(d, 256, 10000.0, None)
    for rows in (1, 5, 19):
        qkv = (3 * torch.randn(rows, (hq + 2 * hkv) * d, generator=g)).to(dtype)
        cos, sin = rotary.tables(torch.randint(0, 256, (rows,), generator=g), dtype)
        slots = torch.randperm(blocks * bs, generator=g)[:rows]
        caches = torch.randn(2, blocks, bs, hkv, d, generator=g).to(dtype)
        want = caches.clone()
        q_want = _torch_rope_and_cache(qkv, cos, sin, want[0], want[1], slots, hq, hkv)
        for isa in cpu_capability().runnable_isas:
            got = caches.clone()
            q = cpu_build.kernels_for(isa).rope_and_cache(qkv, cos, sin, got[0], got[1], slots, hq, hkv)
            assert torch.equal(q, q_want) and torch.equal(got, want), (isa, rows)
    bad = slots.clone()
    bad[-1] = blocks * bs
    before = caches.clone()
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_build.kernels().rope_and_cache(qkv, cos, sin, caches[0], caches[1], bad, hq, hkv)
    assert torch.equal(caches, before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_with_the_fused_rotary_is_bitwise_the_torch_path(qwen_path, dtype):
    """The engine's decode steps with the fused rotary + KV write and without: the same tokens and
    logprobs to the bit (q/k/v biases included)."""
    prompts = random_prompts(300, [9, 30, 4, 17], seed=3)
    outs = {}
    for fused in (True, False):
        with RolloutEngine(qwen_path, dtype=dtype, kv_cache_tokens=1024, kernel_unfused=() if fused else ("rope",)) as e:
            layers = e.worker.model_runner.model.model.layers
            assert all(layer.self_attn.fused_rope == fused for layer in layers)
            outs[fused] = _outputs(e, prompts)
    assert outs[True] == outs[False]


def _draw_cases():
    """Rows of logits of several vocabulary sizes (partial blocks of the draw's sums included), some
    with masked tokens (-inf: probability 0), and uniforms from 0 to the largest below 1."""
    g = torch.Generator().manual_seed(3)
    uniforms = torch.tensor([0.0, 0.3, 0.5, 0.77, 0.999, 1 - 2 ** -24])
    for vocab in (1, 5, 16, 17, 33, 1000, 40000):
        x = torch.randn(len(uniforms), vocab, generator=g) * 4
        if vocab > 2:
            x[1, ::2] = float("-inf")  # every other token masked (top-k / top-p leave such rows)
            x[2, 1:] = float("-inf")  # one token left
            x[3, -1] = 30.0  # the mass on the last token of a partial block
        yield x, uniforms


def test_fused_draw_is_the_inverse_cdf_of_its_uniform_and_its_replay_the_same_bits():
    """The C++ draw (rollout.kernels.cpu.ops), every ISA variant this CPU runs: the token is the one
    whose CDF interval (fp64 over the same logits) holds u, never one of probability 0, its logprob
    within 1e-5 of fp64's log-softmax; the replay (the token given) reports the same bits, and a row
    drawn alone gives what it gives in the batch. A NaN row reports NaN and leaves the others alone;
    ids outside the vocabulary are refused."""
    from rollout.kernels.cpu import build as cpu_build

    for isa in cpu_capability().runnable_isas:
        k = cpu_build.kernels_for(isa)
        for x, u in _draw_cases():
            ids = torch.empty(len(u), dtype=torch.long)
            lp = k.sample_rows(x, u, ids, True)
            ref = torch.log_softmax(x.double(), dim=-1)
            p = ref.exp()
            cdf = p.cumsum(-1)
            for r in range(len(u)):
                t = int(ids[r])
                assert p[r, t] > 0, (isa, x.shape, r)
                assert cdf[r, t] - p[r, t] - 1e-6 <= float(u[r]) <= cdf[r, t] + 1e-6, (isa, x.shape, r)
            assert (lp.double() - ref.gather(1, ids[:, None])[:, 0]).abs().max() <= 1e-5, (isa, x.shape)
            assert torch.equal(k.sample_rows(x, torch.empty(0), ids.clone(), False), lp)
            for r in range(len(u)):
                one = torch.empty(1, dtype=torch.long)
                assert torch.equal(k.sample_rows(x[r:r + 1], u[r:r + 1], one, True), lp[r:r + 1]) and one[0] == ids[r]
    x, u = torch.randn(3, 50), torch.tensor([0.1, 0.5, 0.9])
    want_ids = torch.empty(3, dtype=torch.long)
    want = cpu_build.kernels().sample_rows(x, u, want_ids, True)
    x[1, 7] = float("nan")
    ids = torch.empty(3, dtype=torch.long)
    lp = cpu_build.kernels().sample_rows(x, u, ids, True)
    assert torch.isnan(lp[1]) and torch.equal(lp[[0, 2]], want[[0, 2]]) and torch.equal(ids[[0, 2]], want_ids[[0, 2]])
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        cpu_build.kernels().sample_rows(x, torch.empty(0), torch.tensor([0, 50, 1]), False)
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_build.kernels().sample_rows(x.double(), u, ids, True)


def test_the_fused_sampler_draws_what_the_torch_path_draws(qwen_path):
    """The engine with the C++ draw (the default on CPU) and without it: the same tokens (temperature,
    top-k and top-p rows among greedy ones) with logprobs within 1e-5, and replayed scores within
    1e-5 of each other."""
    prompts = random_prompts(300, [9, 30, 4, 17], seed=4)
    sp = [SamplingParams(max_new_tokens=12, temperature=0.8, top_k=40, seed=2, n=2, ignore_eos=True),
          SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True),
          SamplingParams(max_new_tokens=12, temperature=1.0, seed=4, n=2, ignore_eos=True),
          SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)]
    got = {}
    for fused in (True, False):
        kw = {} if fused else dict(kernel_unfused=("sampler",))
        with RolloutEngine(qwen_path, dtype="float32", kv_cache_tokens=1024, **kw) as e:
            assert e.worker.model_runner.kernels.sampler == fused
            assert all(layer.mlp.fused_act for layer in e.worker.model_runner.model.model.layers)  # the default
            outs = e.generate(input_ids=prompts, sampling_params=sp)
            got[fused] = ([o.output_token_ids for o in outs], [o.output_logprobs for o in outs], _scores(e))
    assert got[True][0] == got[False][0]
    for a, b in zip(got[True][1], got[False][1]):
        assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5
    torch.testing.assert_close(got[True][2], got[False][2], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_mul_rounds_where_the_torch_path_rounds(dtype):
    """silu(gate) * up in one call (rollout.kernels.cpu.ops), every ISA variant this CPU runs: within
    2 fp32 ulps of fp64 before each rounding, so against ``F.silu(gate) * up`` an fp32 result moves by
    a few ulps and a bf16 one, in rare elements, by one bf16 ulp; row tails, large |gate| (exp's
    range ends) and batch invariance included."""
    from rollout.kernels.cpu import build as cpu_build

    g = torch.Generator().manual_seed(5)
    for rows, inter in ((1, 7), (5, 64), (3, 700), (130, 96)):
        gu = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
        gu[0, :4] = torch.tensor([-120.0, 95.0, 0.0, -0.0]).to(dtype)
        gate, up = gu.chunk(2, dim=-1)
        want = F.silu(gate) * up
        silu64 = gate.double() * torch.sigmoid(gate.double())
        for isa in cpu_capability().runnable_isas:
            got = cpu_build.kernels_for(isa).silu_mul(gu)
            assert got.dtype == dtype and got.shape == (rows, inter)
            if dtype == torch.float32:
                ref = silu64 * up.double()
                assert ((got.double() - ref).abs() <= ref.abs() * 2 ** -21 + 1e-30).all(), isa
            else:
                ulp = want.float().abs().clamp(min=1e-30) * 2 ** -7
                diff = (got.float() - want.float()).abs()
                assert (diff <= ulp).all() and (diff > 1e-30).float().mean() < 0.01, isa
            for r in (1, min(rows, 3)):
                assert torch.equal(cpu_build.kernels_for(isa).silu_mul(gu[:r]), got[:r])
    with pytest.raises(RuntimeError, match="2 I"):
        cpu_build.kernels().silu_mul(torch.randn(3, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_experts_kernel_is_the_per_expert_loop_of_the_same_kernels_bit_for_bit(dtype):
    """``moe_experts`` (csrc/moe.cpp, every ISA variant this CPU runs): the experts side by side over the
    threads give the bits of a Python loop over the experts in index order of the same GEMMs (the wing's below
    ``linear_rows`` rows an expert, ``F.linear`` from there) and ``silu_mul``, summed back with ``index_add_``;
    against the torch operators' block (``SparseMoe._per_expert``) they differ only by the GEMMs' order of
    sums. Experts routed nothing, one expert taking every token, a single token; bad routing refused."""
    from rollout.kernels.cpu import build as cpu_build
    from rollout.kernels.cpu import ops
    from rollout.layers.moe import SparseMoe

    def loop(x, w13, w2, experts, weights, linear_rows, k):
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token, scale = order // experts.shape[1], weights.reshape(-1)[order][:, None]
        out, start = torch.zeros_like(x), 0
        for e, n in enumerate(torch.bincount(flat, minlength=w13.shape[0]).tolist()):
            gemm = F.linear if n >= linear_rows else k.bf16_linear
            if n:
                rows = x[token[start:start + n]]
                y = gemm(k.silu_mul(gemm(rows, w13[e], None)), w2[e], None) * scale[start:start + n]
                out.index_add_(0, token[start:start + n], y)
            start += n
        return out

    g = torch.Generator().manual_seed(9)
    moe = SparseMoe(8, 2, 64, 48, True, dtype)
    moe.experts.w13.data = (torch.randn(8, 96, 64, generator=g) * 0.1).to(dtype)
    moe.experts.w2.data = (torch.randn(8, 64, 48, generator=g) * 0.1).to(dtype)
    w13, w2 = moe.experts.w13.data, moe.experts.w2.data
    for t, routing in ((37, "random"), (40, "one expert"), (1, "random"), (300, "random")):
        x = torch.randn(t, 64, generator=g).to(dtype)
        experts = torch.tensor([[3, 5]] * t) if routing == "one expert" else \
            torch.stack([torch.randperm(7, generator=g)[:2] for _ in range(t)])  # expert 7 routed nothing
        weights = torch.rand(t, 2, generator=g).to(dtype)
        for isa in cpu_capability().runnable_isas:
            k = cpu_build.kernels_for(isa)
            for linear_rows in (1 << 62, 9):
                got = k.moe_experts(x, w13, w2, experts, weights, linear_rows)
                assert torch.equal(got, loop(x, w13, w2, experts, weights, linear_rows, k)), (t, routing, isa)
        torch.testing.assert_close(got.float(), moe._per_expert(x, experts, weights).float(),
                                   atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-2)
    with pytest.raises(RuntimeError, match="expert 8 out of range"):
        ops.moe_experts(x[:1], w13, w2, torch.tensor([[8, 1]]), weights[:1])


def test_scatter_scaled_writes_what_copy_and_mul_write_and_counts_what_is_not_finite():
    """A received bucket into an adapter's places in one call (rollout.kernels.cpu.ops), every ISA
    variant this CPU runs: fp32, bf16 and fp16 pieces, narrowed sources (a TP rank's slice) and
    strided places (a block of ``b``), each scaled — bitwise ``dst.copy_(src); dst.mul_(scale)``; the
    non-finite values written are counted, an overflow of the scale's product too; a plan reaching
    outside a buffer is refused before anything is written."""
    from rollout.kernels.cpu import build as cpu_build
    from rollout.kernels.cpu.ops import scatter_plan

    g = torch.Generator().manual_seed(3)
    slot = torch.zeros(1 << 16, dtype=torch.uint8)
    shapes = [((16, 96), torch.float32, None, None), ((40, 8), torch.bfloat16, 1.7, None),
              ((8, 64), torch.float16, None, (1, 16, 32)), ((48, 8), torch.float32, 0.3, (0, 8, 24))]
    offset, srcs = 0, []
    for shape, dtype, _, narrow in shapes:
        n = shape[0] * shape[1] * dtype.itemsize
        t = slot[offset:offset + n].view(dtype).view(shape)
        t.copy_(torch.randn(shape, generator=g))
        srcs.append(t if narrow is None else t.narrow(*narrow))
        offset += -(-n // 64) * 64
    buffer = torch.full((4096,), -1.0)
    b = buffer[2048:].view(64, 32)  # the places: a contiguous run, then blocks of a wider matrix
    places = [buffer[:16 * 96].view(16, 96), b[:40, 3:11], buffer[1600:1600 + 8 * 32].view(8, 32), b[40:64, 20:28]]
    pieces = [(s, d, sc) for s, d, (_, _, sc, _) in zip(srcs, places, shapes)]
    want = buffer.clone()
    wplaces = [want[:16 * 96].view(16, 96), want[2048:].view(64, 32)[:40, 3:11], want[1600:1600 + 8 * 32].view(8, 32),
               want[2048:].view(64, 32)[40:64, 20:28]]
    for s, d, sc in zip(srcs, wplaces, [p[2] for p in shapes]):
        d.copy_(s)
        if sc is not None:
            d.mul_(sc)
    plan, scales = scatter_plan(slot, buffer, pieces)
    for isa in cpu_capability().runnable_isas:
        buffer.fill_(-1.0)
        assert int(cpu_build.kernels_for(isa).scatter_scaled(slot, buffer, plan, scales)) == 0
        assert torch.equal(buffer, want), isa
    srcs[0][2, 5] = float("nan")
    srcs[1][0, 0] = float("inf")
    srcs[3][1, 1] = 3.0e38  # finite, but not once scaled ... by 0.3: still finite
    pieces[3] = (srcs[3], places[3], 2.0)  # ... by 2: overflows
    plan, scales = scatter_plan(slot, buffer, pieces)
    assert int(cpu_build.kernels().scatter_scaled(slot, buffer, plan, scales)) == 3
    bad = plan.clone()
    bad[2, 5] = buffer.numel() - 10  # the place runs past the buffer's end
    buffer.fill_(-1.0)
    with pytest.raises(RuntimeError, match="outside a buffer"):
        cpu_build.kernels().scatter_scaled(slot, buffer, bad, scales)
    assert (buffer == -1.0).all()
    # a piece received in place (the bucket's bytes are its place's own): left as it is, and counted
    place = buffer[:16 * 96]
    place.copy_(torch.randn(16 * 96, generator=g))
    place[7], place[100] = float("nan"), float("-inf")
    before = buffer.clone()
    plan, scales = scatter_plan(place.view(torch.uint8), buffer, [(place.view(16, 96), place.view(16, 96), None)])
    for isa in cpu_capability().runnable_isas:
        assert int(cpu_build.kernels_for(isa).scatter_scaled(place.view(torch.uint8), buffer, plan, scales)) == 2
        torch.testing.assert_close(buffer, before, rtol=0, atol=0, equal_nan=True)
    # counted a vector at a time, then the rest one by one: rows back to back (185 values as one run) and rows
    # apart (20 of every 24), a non-finite value in a vector and in a row's last values; the largest finite
    # float is finite
    run, apart = buffer[2000:2185], buffer[3000:3096].as_strided((4, 20), (24, 1))
    run.copy_(torch.randn(185, generator=g))
    apart.copy_(torch.randn(4, 20, generator=g))
    run[3], run[180], run[184], run[100] = float("nan"), float("inf"), float("-inf"), 3.4028234663852886e38
    apart[0, 0], apart[3, 19], apart[1, 17], apart[2, 5] = float("-inf"), float("nan"), float("inf"), -3.4028234663852886e38
    before = buffer.clone()
    plan, scales = scatter_plan(buffer.view(torch.uint8), buffer, [(run.view(5, 37), run.view(5, 37), None),
                                                                  (apart, apart, None)])
    for isa in cpu_capability().runnable_isas:
        assert int(cpu_build.kernels_for(isa).scatter_scaled(buffer.view(torch.uint8), buffer, plan, scales)) == 6
        torch.testing.assert_close(buffer, before, rtol=0, atol=0, equal_nan=True)


def test_scatter_scaled_streams_aligned_fp32_rows_with_the_same_bits_and_counts():
    """Pieces whose places are whole aligned vectors take streaming stores (a rank-16 piece of a fused
    linear's ``b`` block: 16 columns of every 48-wide row; a 64-column piece at a row stride of 64),
    the rest the plain loop (a place one float off alignment, 12 columns): every ISA variant writes
    ``dst.copy_(src); dst.mul_(scale)``'s bits and counts the non-finite products, NaN, inf and an
    overflow of the scale among them."""
    from rollout.kernels.cpu import build as cpu_build
    from rollout.kernels.cpu.ops import scatter_plan

    g = torch.Generator().manual_seed(5)
    slot = torch.zeros(1 << 17, dtype=torch.uint8)
    flat = slot.view(torch.float32)
    srcs = [flat[0:64 * 16].view(64, 16), flat[2048:2048 + 32 * 64].view(32, 64), flat[8192:8192 + 20 * 16].view(20, 16),
            flat[12288:12288 + 24 * 12].view(24, 12)]
    for t in srcs:
        t.copy_(torch.randn(t.shape, generator=g))
    buffer = torch.full((16384,), -1.0)
    assert buffer.data_ptr() % 64 == 0
    block = buffer[:64 * 48].view(64, 48)
    places = [block[:, 16:32], buffer[4096:4096 + 32 * 64].view(32, 64), buffer[8193:8193 + 20 * 16].view(20, 16),
              buffer[12288:12288 + 24 * 48].view(24, 48)[:, 36:48]]
    scales = [0.125, 1.7, 0.3, 2.0]
    srcs[0][3, 7], srcs[1][0, 63], srcs[2][5, 2] = float("nan"), float("inf"), 3.0e38  # 3e38 * 0.3: finite
    srcs[1][9, 9] = 3.0e38  # times 1.7: overflows
    want = buffer.clone()
    for s, d, sc in zip(srcs, places, scales):
        w = want[d.storage_offset():].as_strided(d.shape, d.stride())
        w.copy_(s)
        w.mul_(sc)
    plan, sc_t = scatter_plan(slot, buffer, list(zip(srcs, places, scales)))
    for isa in cpu_capability().runnable_isas:
        buffer.fill_(-1.0)
        assert int(cpu_build.kernels_for(isa).scatter_scaled(slot, buffer, plan, sc_t)) == 3, isa
        torch.testing.assert_close(buffer, want, rtol=0, atol=0, equal_nan=True)


def test_scatter_scaled_splits_a_large_bucket_between_threads_with_the_same_bits_and_count():
    """A bucket past 2^17 values a thread is cut into runs of whole pieces, one per thread torch allows (the last
    bucket of an adapter push, nothing left on the wire, takes every core): each piece is written by one
    thread, so one thread and two write the same bits, and the non-finite values each thread met add
    up (NaNs in the first piece, the middle and the last)."""
    from rollout.kernels.cpu import build as cpu_build
    from rollout.kernels.cpu.ops import scatter_plan

    g = torch.Generator().manual_seed(7)
    rows, cols, n = 128, 16, 160  # B pieces of a fused linear: 16 of every 48 columns, 2.5 * 2^17 values
    slot = torch.randn(n * rows * cols, generator=g).view(torch.uint8)
    srcs = [slot.view(torch.float32)[i * rows * cols:(i + 1) * rows * cols].view(rows, cols) for i in range(n)]
    for i in (0, n // 2, n // 2 + 1, n - 1):
        srcs[i][i % rows, i % cols] = float("nan")
    buffer = torch.full((n * rows * 48,), -1.0)
    blocks = buffer.view(n, rows, 48)
    pieces = [(s, blocks[i][:, 16 * (i % 3):16 * (i % 3) + 16], 0.5 + i / n) for i, s in enumerate(srcs)]
    plan, scales = scatter_plan(slot, buffer, pieces)
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for isa in cpu_capability().runnable_isas:
                buffer.fill_(-1.0)
                assert int(cpu_build.kernels_for(isa).scatter_scaled(slot, buffer, plan, scales)) == 4, (t, isa)
                outs.append(buffer.clone())
    finally:
        torch.set_num_threads(threads)
    want = torch.full_like(buffer, -1.0)
    for (s, d, sc) in pieces:
        w = want[d.storage_offset():].as_strided(d.shape, d.stride())
        w.copy_(s)
        w.mul_(sc)
    for out in outs:
        torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_decode_layer_in_one_cpp_call_gives_the_module_paths_bits(model_dir, arch, monkeypatch):
    """``rollout.kernels.cpu.fused``: every decoder layer of a plain decode step in one C++ call, and the
    whole stack in one call where every linear takes the small-batch kernel, with each GEMM kernel
    this machine offers (forced) in both dtypes, and with q/k/v biases (Qwen2): the tokens and
    logprobs of the module path bit for bit, and each fused path really taken where it applies."""
    from rollout.kernels.cpu import fused
    from rollout.kernels.cpu.plan import candidates

    path = model_dir(f"{arch}-fused-layer", arch)
    calls: dict[str, list] = {"decode_layer": [], "decode_stack": []}
    for name in calls:
        def counted(*args, real=getattr(fused, name), seen=calls[name]):
            out = real(*args)
            seen.append(out is not None)
            return out
        monkeypatch.setattr(fused, name, counted)
    prompts = [[3, 5, 7, 9, 11], [4, 2]]
    modes = {"stack": {}, "layer": dict(kernel_fusion="layer"), "module": dict(kernel_fusion="ops")}
    for dtype in (torch.float32, torch.bfloat16):
        for kernel in [None, *dict.fromkeys(["linear", *candidates(dtype, None, None)])]:
            outs = []
            for mode, kw in modes.items():
                for seen in calls.values():
                    seen.clear()
                with RolloutEngine(path, dtype=str(dtype).removeprefix("torch."), kv_cache_tokens=1024,
                                   kernel_gemm=kernel, **kw) as e:
                    got = [e.generate(input_ids=prompts, sampling_params=sp) for sp in SP]
                outs.append([[(o.output_token_ids, o.output_logprobs) for o in g] for g in got])
                stacked, layered = any(calls["decode_stack"]), any(calls["decode_layer"])
                where = (dtype, kernel, mode)
                if mode == "module":
                    assert not calls["decode_layer"] and not calls["decode_stack"], where
                elif mode == "layer":
                    assert layered and all(calls["decode_layer"]) and not calls["decode_stack"], where
                elif kernel == "own":  # every row count of these steps: the whole stack, never a layer alone
                    assert stacked and all(calls["decode_stack"]) and not calls["decode_layer"], where
                elif kernel is not None:  # a kernel with weight copies: layer by layer
                    assert layered and not stacked, where
            assert outs[0] == outs[1] == outs[2], (dtype, kernel)

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_decode_layer_adds_adapters_low_rank_terms_with_the_module_paths_bits(model_dir, arch, tmp_path, monkeypatch):
    """Adapters each on one run of a decode step's rows (one adapter on every row; an adapter beside
    base rows; two adapters; on every linear, or on q/v/down only at rank 4): each layer's C++ call adds
    the linears' low-rank terms as ``LoraSlots.add`` does — tokens and logprobs the module path's bit
    for bit, fp32 and bf16, with q/k/v biases (Qwen2) — and the call is really taken; an adapter whose
    rows are scattered over the batch takes the module path."""
    from rollout.kernels.cpu import fused
    from rollout.layers.lora import LoraBatch
    from rollout.tools.tiny import make_tiny_adapter

    assert LoraBatch([(2, None)]).runs(5) == ((2, 0, 5),)
    assert LoraBatch([(0, slice(0, 2)), (1, slice(3, 5))]).runs(5) == ((0, 0, 2), (1, 3, 2))
    assert LoraBatch([(0, slice(0, 2)), (1, torch.tensor([2, 4]))]).runs(5) is None  # scattered: the module path

    path = model_dir(f"{arch}-fused-layer", arch)
    adapters = {"all": make_tiny_adapter(path, str(tmp_path / "all"), r=8, seed=1),
                "some": make_tiny_adapter(path, str(tmp_path / "some"), r=4, seed=2,
                                          target_modules=["q_proj", "v_proj", "down_proj"])}
    seen: list = []

    def counted(*args, real=fused.decode_layer):
        out = real(*args)
        seen.append((len(args[5]) if len(args) > 5 else 0, out is not None))
        return out

    monkeypatch.setattr(fused, "decode_layer", counted)
    prompts = [[3, 5, 7, 9, 11], [4, 2], [8, 6, 4]]
    cases = {"one": "all", "other": "some", "beside base": ["all", "all", None], "two": ["some", "all", "all"],
             "scattered": ["all", None, "all"]}
    for dtype in ("float32", "bfloat16"):
        outs = {}
        for mode, kw in {"layer": {}, "module": dict(kernel_fusion="ops")}.items():
            got = {}
            with RolloutEngine(path, dtype=dtype, kv_cache_tokens=1024, **kw) as e:
                for name, folder in adapters.items():
                    assert e.load_lora_adapter(name, folder).success
                for case, lora_path in cases.items():
                    for i, sp in enumerate(SP):
                        seen.clear()
                        outs_ = e.generate(input_ids=prompts, sampling_params=sp, lora_path=lora_path)
                        got[case, i] = [(o.output_token_ids, o.output_logprobs) for o in outs_]
                        with_lora = [ok for n, ok in seen if n]
                        if mode == "module":
                            assert not seen, (dtype, case)
                        elif case != "scattered":  # (the scheduler's row order decides whether these are)
                            assert with_lora and all(with_lora), (dtype, case, i)
            outs[mode] = got
        assert outs["layer"] == outs["module"], dtype
        assert outs["layer"]["one", 0] != outs["layer"]["other", 0]  # the two adapters say different things


def _layer_weights(g, dtype, h, hq, hkv, d, inter, biases):
    """One decoder layer's tensors for ``decode_stack`` (12) with random values of a trained model's scale."""
    def w(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(dtype)

    def b(n):
        return (0.1 * torch.randn(n, generator=g)).to(dtype) if biases else torch.empty(0)
    qkv = (hq + 2 * hkv) * d
    return [1 + 0.1 * w(h), 1 + 0.1 * w(h), None, None, w(qkv, h), b(qkv), w(h, hq * d), b(h), w(2 * inter, h),
            b(2 * inter), w(h, inter), b(h)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_whole_stack_in_one_call_is_decode_layer_after_decode_layer_bit_for_bit(dtype):
    """``decode_stack`` (every layer of a 1-9 row decode step with one team of threads meeting at
    barriers) against ``decode_layer`` called layer after layer with the small-batch kernel: the same
    hidden states and the same K/V written, bit for bit, on each ISA variant this CPU runs, on one and
    two threads, with waits that spin and with waits that sleep at once; GQA groups of 3, 1 and 8,
    biases on every linear (Qwen2's q/k/v ones and row-parallel o/down ones), a sliding window, ragged
    contexts over scattered blocks."""
    from rollout.kernels.cpu import build as cpu_build

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(11)
    threads = torch.get_num_threads()
    cases = [(9, 3, 64, True, 0), (4, 4, 32, False, 5), (8, 1, 128, True, 0)]
    try:
        for hq, hkv, d, biases, window in cases:
            h, inter, layers, bs, nb = 96, 160, 3, 8, 64
            weights = [_layer_weights(g, dtype, h, hq, hkv, d, inter, biases) for _ in range(layers)]
            caches = [tuple(torch.randn(nb, bs, hkv, d, generator=g).to(dtype) for _ in "kv") for _ in range(layers)]
            for rows in (1, 2, 3, 4, 5, 8, 9):
                lens = torch.randint(1, 6 * bs, (rows,), generator=g)
                tables = torch.randperm(nb, generator=g)[: rows * 6].view(rows, 6)
                slots = tables.gather(1, ((lens - 1) // bs).view(-1, 1)).view(-1) * bs + (lens - 1) % bs
                angle = torch.rand(rows, 1, d, generator=g) * 6
                cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
                hidden = torch.randn(rows, h, generator=g).to(dtype)
                for isa in cpu_capability().runnable_isas:
                    k = cpu_build.kernels_for(isa)
                    for n, spins in ((1, 2000), (2, 2000), (2, 0)):  # 0: every wait at a barrier sleeps
                        torch.set_num_threads(n)
                        ref_caches = [(kc.clone(), vc.clone()) for kc, vc in caches]
                        ref = hidden
                        none = torch.empty(0)
                        for (n1, n2, _, _, wq, bq, wo, bo, wg, bg, wd, bd), (kc, vc) in zip(weights, ref_caches):
                            t = [n1, n2, cos, sin, kc, vc, slots, tables, lens, bo, bd,
                                 wq, bq, none, none, wo, none, none, none, wg, bg, none, none, wd, none, none, none]
                            ref = k.decode_layer(ref, t, [0, 0, 0, 0], hq, hkv, 1e-5, d ** -0.5, window, [])
                        got_caches = [(kc.clone(), vc.clone()) for kc, vc in caches]
                        flat = [x for wts, kv in zip(weights, got_caches) for x in (wts[:2] + list(kv) + wts[4:])]
                        got = k.decode_stack(hidden, flat, cos, sin, slots, tables, lens, hq, hkv, 1e-5, d ** -0.5, window,
                                             spins)
                        where = (hq, hkv, d, rows, isa, n, spins)
                        assert torch.equal(got, ref), where
                        assert all(torch.equal(a, b) for x, y in zip(got_caches, ref_caches) for a, b in zip(x, y)), where
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="layer 1: q/k/v, o, gate/up and down weights"):
        flat[12 + 4] = flat[12 + 4][:, :-1].contiguous()  # a layer whose q/k/v weight lost a column
        cpu_build.kernels().decode_stack(hidden, flat, cos, sin, slots, tables, lens, hq, hkv, 1e-5, d ** -0.5, window, 0)


def test_the_stacks_barriers_wait_as_long_as_libgomps_threads():
    """``decode_stack``'s spin count is libgomp's, read as libgomp reads its environment."""
    from rollout.kernels.cpu.fused import FOREVER, LIBGOMP_SPINS, spin_count

    assert spin_count({}) == LIBGOMP_SPINS == 300_000
    assert spin_count({"GOMP_SPINCOUNT": "2000"}) == 2000 and spin_count({"GOMP_SPINCOUNT": "20k"}) == 20_000
    assert spin_count({"GOMP_SPINCOUNT": "3M", "OMP_WAIT_POLICY": "passive"}) == 3_000_000
    assert spin_count({"GOMP_SPINCOUNT": "INFINITE"}) == FOREVER == spin_count({"OMP_WAIT_POLICY": "ACTIVE"})
    assert spin_count({"OMP_WAIT_POLICY": "passive"}) == 0
    assert spin_count({"GOMP_SPINCOUNT": "lots"}) == LIBGOMP_SPINS
