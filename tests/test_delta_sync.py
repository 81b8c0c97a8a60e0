"""Delta weight pushes (``weight_sync.delta``, ``RolloutEngine.update_weights_from_delta``,
``trainer_bridge.push.push_delta``): only the changed elements travel, against a named base, checked before and
after, all or nothing.

The trainer's step is simulated the way an optimizer step moves bf16 weights: fp32 master weights nudged by a
tiny relative amount each step, pushed cast to bf16, whose bits change only where a master weight crossed a
rounding boundary: a few percent of the elements a step."""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
from helpers import random_prompts

from rollout import RolloutEngine, SamplingParams
from rollout.outputs import WeightResult
from weight_sync.delta import (
    DeltaTracker,
    WeightDelta,
    fingerprint,
    fingerprint_at,
    moved_by,
    name_salt,
    save_patch,
    wrap64,
)
from weight_sync.layout import bucket_layouts, contiguous_run


def _hf_state(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {n: t.to(dtype) for n, t in load_file(f"{path}/model.safetensors").items()}


def _master(path: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 master weights of a bf16 checkpoint as after some training: each anywhere within the rounding
    interval of its bf16 value (0.2 of a bf16 ulp either side), so that cast back they are the checkpoint."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in _hf_state(path, torch.bfloat16).items():
        up = t.clone()
        up.view(torch.int16).add_(1)  # the next bf16 value away from zero: one ulp
        ulp = (up.float() - t.float()).abs()
        out[n] = t.float() + (torch.rand(t.shape, generator=g) - 0.5) * 0.4 * ulp  # (the ulp below: >= half)
        assert torch.equal(out[n].to(torch.bfloat16), t)
    return out


def _step(master: dict[str, torch.Tensor], seed: int, lr: float = 1e-3) -> dict[str, torch.Tensor]:
    """The fp32 master weights after an optimizer step: each moved by ~lr relative."""
    g = torch.Generator().manual_seed(seed)
    return {n: t.float() * (1 + lr * torch.randn(t.shape, generator=g)) for n, t in master.items()}


def _pushed(master: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16) for n, t in master.items()}


def _weights(engine: RolloutEngine, names) -> dict[str, torch.Tensor]:
    return {n: torch.tensor(engine.get_weights_by_name(n, truncate_size=10**9)) for n in names}


def test_the_fingerprint_sums_over_any_split_and_moves_with_each_changed_element():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(37, 53, generator=g).to(dtype)
        whole, salt = fingerprint("w", t), name_salt("w")
        flat = t.reshape(-1)
        perm = torch.randperm(flat.numel(), generator=g)
        parts = [fingerprint_at(flat[p], p, salt) for p in perm.chunk(3)]  # three "ranks", scattered elements
        assert wrap64(sum(parts)) == whole
        assert fingerprint("v", t) != whole  # the name salts it
        changed = flat.clone()
        changed[[5, 900]] = changed[[900, 5]]  # two elements swapped
        assert fingerprint("w", changed) != whole or bool(flat[5] == flat[900])
        one = flat.clone()
        one.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)[17] += 1  # the last bit of one element
        pos = torch.tensor([17])
        assert fingerprint("w", one) == wrap64(whole + moved_by("w", pos, flat[pos], one[pos])) != whole


def test_a_tracker_sends_only_the_changed_elements_and_commits_them(monkeypatch):
    """The trainer's side, with the C++ passes and without them (the torch path a GPU's tensors take, its base
    kept on the device): the same delta, bit for bit."""
    g = torch.Generator().manual_seed(1)
    master = {"a": torch.randn(64, 32, generator=g), "b": torch.randn(100, generator=g)}
    base = _pushed(master)
    tracker = DeltaTracker()
    tracker.record(base.items(), "v0")
    new = _pushed(_step(master, 2))
    new["b"] = -base["b"]  # every element changed: sent dense
    delta = tracker.diff(new.items(), "v1")
    assert delta.base_version == "v0" and set(delta.entries) == {"a", "b"}
    assert delta.entries["b"].dense is not None and delta.entries["a"].dense is None
    assert 0 < delta.entries["a"].num_changed < 0.25 * 64 * 32
    back = WeightDelta.from_parts(delta.header(), delta.named_tensors())
    assert back.header() == delta.header() and set(back.entries) == {"a", "b"}
    # its sparse tensors lie as a weight bucket lays them: they go on the wire from where they are, no copy
    sparse = [(n, t) for n, t in delta.named_tensors() if not n.startswith("b")]
    (metas, total), = bucket_layouts([(n, t.dtype, tuple(t.shape)) for n, t in sparse], 1 << 20)
    assert contiguous_run([t for _, t in sparse], metas, total) is not None
    # the diff wrote the new words into the base (the same pass); refused, they go back; diffed again, kept
    assert all(torch.equal(tracker.base[n], new[n].reshape(-1)) for n in new)
    tracker.rollback()
    assert all(torch.equal(tracker.base[n], base[n].reshape(-1)) for n in base) and tracker.version == "v0"
    delta = tracker.diff(new.items(), "v1")
    tracker.diff(_pushed(_step(master, 3)).items(), "v1-other")  # diffed over it, never sent: the first commits
    tracker.commit(delta)
    assert tracker.version == "v1" and all(torch.equal(tracker.base[n], new[n].reshape(-1)) for n in new)
    assert tracker.fingerprints == {n: fingerprint(n, new[n]) for n in new}
    with pytest.raises(ValueError, match="lack tensors of the base"):
        tracker.diff([("a", new["a"])], "v2")
    with pytest.raises(ValueError, match="names it changed but carries no"):
        WeightDelta.from_parts(delta.header(), [])
    import weight_sync.delta as wd

    fp32_master = _step(master, 2)
    fp32_master["b"] = -master["b"]
    for source in (new, fp32_master):  # bf16 tensors, and fp32 ones cast as they are compared
        with_kernels = DeltaTracker()
        with_kernels.record(base.items(), "v0")
        want = with_kernels.diff(source.items(), "v1")
        with monkeypatch.context() as m:
            m.setattr(wd, "kernel_ops", lambda: None)
            torch_path = DeltaTracker(on_device=True)
            torch_path.record(base.items(), "v0")
            got = torch_path.diff(source.items(), "v1")
            torch_path.commit(got)
        assert got.header() == want.header()
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got.named_tensors(), want.named_tensors()))
        assert torch_path.fingerprints == {n: fingerprint(n, new[n]) for n in new}


def test_the_cpp_passes_give_the_torch_sums_and_indices_on_every_isa_this_cpu_runs():
    """``delta.cpp`` (every ISA variant this CPU runs) against the int64-tensor arithmetic it replaces: a
    tensor's fingerprint and a TP shard's part of it, the diff of bf16 / fp32 words and of fp32 values against a
    bf16 base (rounded as torch casts, infinities among them), a sparse entry written into a shard with
    its undo, and the entry checks."""
    from rollout.kernels.cpu import build
    from rollout.kernels.cpu.capability import cpu_capability

    g = torch.Generator().manual_seed(5)
    n, salt = 7 * 1429, name_salt("w")
    for isa in cpu_capability().runnable_isas:
        k = build.kernels_for(isa)
        out = torch.empty(2, dtype=torch.long)

        def diff_one(now, was, moved, in_place=False):  # one tensor through the many-tensor pass (align 8)
            return k.delta_diff_many([now], [was], torch.tensor([salt]), moved, torch.empty(1, 4, dtype=torch.long),
                                     8, int(in_place))

        def apply_one(dst, idx, vals, old, counts, info):  # one entry into the shard (a lone entry: every core)
            k.delta_apply_many([dst], [idx], [vals], [old], torch.tensor([[salt, 600, 1, 1429, 300, int(counts)]]),
                               info.view(1, 2))

        for dtype, word in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
            base = torch.randn(n, generator=g).to(dtype)
            k.delta_fingerprint(base.view(word), salt, 1, n, 1, n, 0, out)
            assert int(out[0]) == fingerprint_at(base.float().to(dtype).clone().cpu(), torch.arange(n), salt) \
                == wrap64(int((base.view(word).to(torch.int64) & (0xFFFF if word == torch.int16 else 0xFFFFFFFF))
                              .mul(((torch.arange(n) ^ salt) * -7046029254386353131 + 0x2545F4914F6CDD1D) | 1).sum()))
            full = base.reshape(7, 1429, 1)[:, 300:900].contiguous()  # a shard: rows 300..899 of the middle dim
            where = (torch.arange(7)[:, None] * 1429 + torch.arange(300, 900)[None, :]).reshape(-1)
            k.delta_fingerprint(full.view(word), salt, 7, 600, 1, 1429, 300, out)
            assert int(out[0]) == fingerprint_at(full, where, salt)
            master = base.float() * (1 + 0.01 * torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.1))
            if dtype == torch.bfloat16:  # infinities, NaNs (cast as torch's scalar cast: 0x7FC0), a denormal, ties
                master[[5, 77, 78, 79, 80, 81, 82]] = torch.tensor([float("inf"), -float("inf"), float("nan"),
                                                                    -float("nan"), 1e-40, 0.0, 0.0])
                master[[81, 82]] = torch.tensor([0x3F808000, 0x3F818000], dtype=torch.int32).view(torch.float32)
            for now in ((master.to(dtype), master) if dtype == torch.bfloat16 else (master,)):
                moved = torch.empty(1, dtype=torch.long)
                arg = now if now.dtype == torch.float32 and dtype == torch.bfloat16 else now.view(word)
                raw = diff_one(arg, base.view(word), moved)
                cast = master.to(dtype)
                if arg.dtype == torch.float32 and dtype == torch.bfloat16:  # (a bf16 ``now``'s NaNs: its own bits)
                    cast[torch.isnan(master)] = torch.tensor(0x7FC0, dtype=torch.int16).view(torch.bfloat16)
                want = torch.nonzero(cast.view(word) != base.view(word)).reshape(-1)
                count, size = want.numel(), base.element_size()
                at_words = (4 * count + 7) // 8 * 8
                assert torch.equal(raw[: 4 * count].view(torch.int32).long(), want)
                assert torch.equal(raw[at_words: at_words + size * count].view(word), cast.view(word)[want])
                assert wrap64(int(moved[0])) == moved_by("w", want, base[want], cast[want])
                # in place: the base takes the new words, the old ones come after the wire's bytes
                staged = base.clone()
                again = diff_one(arg, staged.view(word), moved, in_place=True)
                wire = (at_words + size * count + 7) // 8 * 8
                assert torch.equal(again[:wire], raw[:wire]) and torch.equal(staged.view(word), cast.view(word))
                assert torch.equal(again[wire: wire + size * count].view(word), base.view(word)[want])
                # the same in one call with other tensors (one parallel region over chunks of all of them),
                # each tensor's blocks at multiples of 64 bytes (a weight bucket's layout)
                moves, blocks = torch.empty(2, dtype=torch.long), torch.empty(2, 4, dtype=torch.long)
                many = k.delta_diff_many([arg] * 2, [base.view(word)] * 2, torch.tensor([salt, salt + 1]), moves,
                                         blocks, 64, 0)
                words64 = (4 * count + 63) // 64 * 64
                second = (words64 + size * count + 63) // 64 * 64
                for at in (0, second):
                    assert torch.equal(many[at: at + 4 * count], raw[: 4 * count])
                    assert torch.equal(many[at + words64: at + words64 + size * count],
                                       raw[at_words: at_words + size * count])
                assert int(moves[0]) == int(moved[0]) and blocks[:, 0].tolist() == [count, count]
                assert blocks[:, 1:3].tolist() == [[0, words64], [second, second + words64]]
            # a sparse entry into the shard: written where it falls, the move summed, undone by the old words
            idx = torch.nonzero(torch.rand(n, generator=g) < 0.05).reshape(-1).to(torch.int32)
            vals = torch.randn(idx.numel(), generator=g).to(dtype)
            shard, old, info = full.clone(), torch.empty_like(vals), torch.empty(2, dtype=torch.long)
            apply_one(shard.view(word), idx, vals.view(word), old.view(word), True, info)
            mine = ((idx.long() % 1429) >= 300) & ((idx.long() % 1429) < 900)
            loc = (idx.long() // 1429) * 600 + idx.long() % 1429 - 300
            expect = full.clone().reshape(-1)
            expect[loc[mine]] = vals[mine]
            assert torch.equal(shard.reshape(-1).view(word), expect.view(word)) and int(info[1]) == int(mine.sum())
            assert wrap64(int(info[0])) == moved_by("w", idx.long()[mine], full.reshape(-1)[loc[mine]], vals[mine])
            apply_one(shard.view(word), idx, old.view(word), vals.view(word), False, info)
            assert torch.equal(shard, full)
            # the same in one call with another entry (one parallel region over the entries)
            other, olds, infos = full.clone(), [torch.empty_like(vals), torch.empty_like(vals)], torch.empty(2, 2).long()
            k.delta_apply_many([shard.view(word), other.view(word)], [idx, idx], [vals.view(word)] * 2,
                               [o.view(word) for o in olds], torch.tensor([[salt, 600, 1, 1429, 300, 1]] * 2), infos)
            assert torch.equal(shard, other) and torch.equal(shard.reshape(-1).view(word), expect.view(word))
            assert int(infos[0, 1]) == int(mine.sum())
            assert wrap64(int(infos[0, 0])) == moved_by("w", idx.long()[mine], full.reshape(-1)[loc[mine]], vals[mine])
            shard = full.clone()
            exponent = 0x7F80 if dtype == torch.bfloat16 else 0x7F800000
            cases = ((idx, vals, 0), (idx.flip(0), vals, 2), (idx + n, vals, 1),
                     (idx, torch.cat([vals[:-1], torch.tensor([float("inf")]).to(dtype)]), 3))
            checks = torch.empty(len(cases), 2, dtype=torch.long)
            k.delta_check_many([c[0].contiguous() for c in cases], [c[1].view(word) for c in cases],
                               torch.tensor([[n, exponent]] * len(cases)), checks)
            assert checks[:, 0].tolist() == [c[2] for c in cases]
            assert checks[2, 1] == 0 and checks[3, 1] == idx.numel() - 1


@pytest.fixture(scope="module")
def bf16_llama(model_dir):
    return model_dir("delta-llama", "llama", seed=31, dtype=torch.bfloat16)


def test_a_delta_push_leaves_the_engine_bitwise_where_a_full_push_leaves_it(bf16_llama):
    """TP=1, bf16: three steps as deltas into one engine, the same steps in full into another; after each, every
    tensor equal bit for bit, the same checksum, the same greedy tokens; a few percent of the elements sent (a
    tensor that changed throughout, whole)."""
    master = _master(bf16_llama)
    state = _pushed(master)
    prompts = random_prompts(256, [7, 12], seed=3)
    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    kw = dict(dtype="bfloat16", kv_cache_tokens=512)
    with RolloutEngine(bf16_llama, **kw) as by_delta, RolloutEngine(bf16_llama, **kw) as in_full:
        tracker = DeltaTracker()
        tracker.record(state.items(), by_delta.get_weight_version())
        for step in range(1, 4):
            master = _step(master, step)
            if step == 2:  # a tensor changed throughout: sent whole
                master["model.layers.0.self_attn.o_proj.weight"] *= -1
            state = _pushed(master)
            delta = tracker.diff(state.items(), f"step-{step}")
            assert (delta.entries["model.layers.0.self_attn.o_proj.weight"].dense is not None) == (step == 2)
            fraction = sum(e.num_changed for e in delta.entries.values()) / sum(t.numel() for t in state.values())
            assert 0.001 < fraction < 0.2, fraction
            result = by_delta.update_weights_from_delta(delta)
            assert result.success and result.weight_version == f"step-{step}", result.message
            tracker.commit(delta)
            assert in_full.update_weights_from_tensor(list(state.items()), weight_version=f"step-{step}").success
            assert by_delta.get_weights_checksum() == in_full.get_weights_checksum()
            got = by_delta.generate(input_ids=prompts, sampling_params=sp)
            want = in_full.generate(input_ids=prompts, sampling_params=sp)
            assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
        names = sorted(state)
        assert all(torch.equal(a, b) for a, b in zip(_weights(by_delta, names).values(), _weights(in_full, names).values()))


def test_a_delta_against_another_base_or_with_a_corrupted_value_is_refused_and_the_old_weights_serve(bf16_llama):
    master = _master(bf16_llama)
    with RolloutEngine(bf16_llama, dtype="bfloat16", kv_cache_tokens=512) as engine:
        before = engine.get_weights_checksum()
        tracker = DeltaTracker()
        tracker.record(_pushed(master).items(), engine.get_weight_version())
        new = _pushed(_step(master, 7))
        delta = tracker.diff(new.items(), "v1")
        # another version named as the base: refused at once, by version
        wrong = copy.copy(delta)
        wrong.base_version = "v0"
        r = engine.update_weights_from_delta(wrong)
        assert not r.success and r.error_kind == WeightResult.BASE and "serves version 'default'" in r.message
        # the right version's name over other bits (a full push that kept the name): refused by fingerprint
        wrong = copy.copy(delta)
        wrong.base_fingerprint = wrap64(delta.base_fingerprint + 1)
        r = engine.update_weights_from_delta(wrong)
        assert not r.success and r.error_kind == WeightResult.BASE and "not the delta's base" in r.message
        # a value corrupted on the way: applied, found different from the trainer's, every change undone
        name = next(n for n, e in delta.entries.items() if e.values is not None and e.values.numel() > 2)
        bad = copy.deepcopy(delta)
        bad.entries[name].values[1] = bad.entries[name].values[1] * 2 + 1
        r = engine.update_weights_from_delta(bad)
        assert not r.success and r.error_kind is None and name in r.message and "undone" in r.message
        # a short delta (a tensor's entry lost) and a NaN: refused by name before anything is written
        short = copy.deepcopy(delta)
        del short.entries[name]
        r = engine.update_weights_from_delta(short)
        assert not r.success and name in r.message
        nan = copy.deepcopy(delta)
        nan.entries[name].values[0] = float("nan")
        r = engine.update_weights_from_delta(nan)
        assert not r.success and "NaN" in r.message and name in r.message
        assert engine.get_weights_checksum() == before and engine.get_weight_version() == "default"
        # the trainer's next push against the same base goes through
        r = engine.update_weights_from_delta(delta)
        assert r.success and r.weight_version == "v1", r.message
        assert engine.get_weights_checksum() != before


def test_a_delta_at_tp2_lands_on_each_rank_as_at_tp1(model_dir, tmp_path):
    """TP=2 (spawned ranks, each writing and fingerprinting only its shard at the full tensors' indices; the
    router and norms replicated): a Qwen2-MoE in bf16 — column- and row-parallel linears, q/k/v biases, fused
    expert tensors split over their intermediate dimension, a shared expert — takes two deltas in process, one over
    a weight group (both ranks receive it) and one from a patch folder; every tensor then equals a TP=1 engine's
    after the same steps in full, bit for bit."""
    path = model_dir("delta-qwen2moe", "qwen2_moe", seed=32, dtype=torch.bfloat16, hidden_size=64,
                     intermediate_size=96, num_layers=2, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=64, shared_expert_intermediate_size=80, decoder_sparse_step=1,
                     mlp_only_layers=[])
    master = _master(path)
    kw = dict(dtype="bfloat16", kv_cache_tokens=512)
    with RolloutEngine(path, tp_size=2, **kw) as tp2, RolloutEngine(path, **kw) as tp1:
        tracker = DeltaTracker()
        tracker.record(_pushed(master).items(), tp2.get_weight_version())
        for step in (1, 2):
            master = _step(master, 40 + step)
            if step == 2:  # whole tensors split over the ranks, sent dense
                master = {n: -t if "experts" in n or "q_proj" in n else t for n, t in master.items()}
            state = _pushed(master)
            delta = tracker.diff(state.items(), f"step-{step}")
            result = tp2.update_weights_from_delta(delta)
            assert result.success, result.message
            tracker.commit(delta)
            assert tp1.update_weights_from_tensor(list(state.items()), weight_version=f"step-{step}").success
        bad = copy.deepcopy(tracker.diff(_pushed(_step(master, 50)).items(), "step-3"))
        name = next(n for n, e in bad.entries.items() if "experts" in n and e.values is not None)
        bad.entries[name].values[-1] = -bad.entries[name].values[-1] + 1  # lands on one rank only: both undo
        r = tp2.update_weights_from_delta(bad)
        assert not r.success and name in r.message
        names = sorted(state)
        assert tp2.get_weights_checksum() == tp1.get_weights_checksum()
        assert all(torch.equal(a, b) for a, b in zip(_weights(tp2, names).values(), _weights(tp1, names).values()))
        # a delta over a weight group to both ranks, and one from a patch folder: as tp1's full pushes
        sender = _group(tp2, "sparse", timeout_s=20, ranks=2)
        for step, how in ((3, "group"), (4, "disk")):
            master = _step(master, 40 + step)
            state = _pushed(master)
            delta = tracker.diff(state.items(), f"step-{step}")
            if how == "group":
                result = _over_group(tp2, sender, delta, lambda named, b: sender.send(named, bucket_bytes=b))
            else:
                result = tp2.update_weights_from_delta(save_patch(delta, str(tmp_path / "patch")))
            assert result.success and result.weight_version == f"step-{step}", result.message
            tracker.commit(delta)
            assert tp1.update_weights_from_tensor(list(state.items()), weight_version=f"step-{step}").success
            assert tp2.get_weights_checksum() == tp1.get_weights_checksum()
        # vLLM's sparse patches (no base: the weights held) over a group to both ranks, one unsorted: as tp1's
        # full tensors patched the same way; an index past its tensor's end: refused, nothing written
        g = torch.Generator().manual_seed(9)
        patches, patched = [], {}
        for name in [n for n in names if "experts" in n or "q_proj.weight" in n][:6]:
            full = state[name].reshape(-1).clone()
            idx = torch.nonzero(torch.rand(full.numel(), generator=g) < 0.1).reshape(-1).to(torch.int32)
            idx = idx.flip(0) if not patches else idx
            vals = torch.randn(idx.numel(), generator=g).to(torch.bfloat16)
            full[idx.long()] = vals
            patches.append((name, idx, vals))
            patched[name] = full.reshape(state[name].shape)
        assert tp1.update_weights_from_tensor(list(patched.items()), partial=True, weight_version="patched").success
        for sent, ok in ((patches, True), ([(patches[0][0], patches[0][1] + 10**7, patches[0][2])], False)):
            r = _sparse_over_group(tp2, sender, sent, [list(state[n].shape) for n, _, _ in sent])
            assert r.success == ok, r.message
            if not ok:
                assert patches[0][0] in r.message and "outside the tensor" in r.message
            assert tp2.get_weights_checksum() == tp1.get_weights_checksum()
        sender.close()


def test_the_trainer_pushes_deltas_and_falls_back_to_a_full_push_where_the_engine_holds_another_base(bf16_llama):
    """``push_delta`` from a trainer's model (bf16 parameters) into a colocated engine: the first push whole
    (kept as the base), then deltas; an engine whose weights changed behind the trainer's back (another
    writer, under the same version name) refuses the next delta by fingerprint and gets a full push, after which
    deltas go again. After each push the engine's tensors are the model's, bit for bit."""
    from transformers import AutoModelForCausalLM

    from trainer_bridge.push import push_delta
    from trainer_bridge.targets import ColocatedTarget

    model = AutoModelForCausalLM.from_pretrained(bf16_llama, dtype=torch.bfloat16)
    master = {n: p.detach().float() for n, p in model.named_parameters()}
    tracker = DeltaTracker()
    with RolloutEngine(bf16_llama, dtype="bfloat16", kv_cache_tokens=512) as engine:
        target = ColocatedTarget(engine)
        kinds = []
        for step in range(1, 5):
            master = _step(master, 60 + step)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(master[n])
            if step == 3:  # someone else writes a weight, keeping the version's name
                name = "model.norm.weight"
                assert engine.update_weights_from_tensor([(name, -model.get_parameter(name).detach())],
                                                         partial=True, weight_version=f"step-{step - 1}").success
            stats = push_delta(model, target, f"step-{step}", tracker)
            assert stats.result.success, stats.result.message
            kinds.append("delta" if stats.phases["delta"] else "fell back" if stats.phases["fell_back"] else "full")
            if step == 3:
                assert "not the delta's base" in stats.phases["refused"]
            want = {n: p.detach() for n, p in model.named_parameters()}
            bad = [n for n, t in want.items() if not torch.equal(_weights(engine, [n])[n].to(torch.bfloat16), t.reshape(-1))]
            assert not bad, (step, bad)
            assert engine.get_weight_version() == f"step-{step}"
        assert kinds == ["full", "delta", "fell back", "delta"]


def test_a_patch_folder_over_the_servers_route_under_the_allowed_dirs_only(bf16_llama, make_server, tmp_path):
    """prime-rl-style filesystem sync: ``save_patch`` writes a patch folder (``delta.json`` naming its base,
    ``delta.safetensors``); ``/update_weights_from_delta`` reads it only under ``--allowed-weight-dirs`` (403
    outside), pinned and checked as checkpoint folders are, and applies it all or nothing: the weights then are
    the full push's bit for bit (the checksum of an engine given the same step in full); a patch against
    another base is refused 400 with ``error_kind: "base"``; a folder with no patch in it, 400 naming it."""
    from weight_sync.delta import save_patch

    allowed = tmp_path / "patches"
    master = _master(bf16_llama)
    tracker = DeltaTracker()
    tracker.record(_pushed(master).items(), "default")
    state = _pushed(_step(master, 80))
    delta = tracker.diff(state.items(), "step-1")
    server = make_server(bf16_llama, "--dtype", "bfloat16", "--kv-cache-tokens", "512", "--allowed-weight-dirs",
                         str(allowed))
    with server.client() as client:
        outside = save_patch(delta, str(tmp_path / "elsewhere"))
        r = client.http.post("/update_weights_from_delta", json={"path": outside})
        assert r.status_code == 403 and "allowed-weight-dirs" in r.text
        wrong = copy.copy(delta)
        wrong.base_fingerprint = wrap64(delta.base_fingerprint - 1)
        r = client.http.post("/update_weights_from_delta", json={"path": save_patch(wrong, str(allowed / "wrong"))})
        assert r.status_code == 400 and r.json()["error_kind"] == "base"
        (allowed / "empty").mkdir()
        r = client.http.post("/update_weights_from_delta", json={"path": str(allowed / "empty")})
        assert r.status_code == 400 and "delta" in r.json()["message"]
        before = client.http.post("/weights_checker", json={"action": "checksum"}).json()["checksum"]
        result = client.update_weights_from_delta(save_patch(delta, str(allowed / "step-1")))
        assert result.success and result.weight_version == "step-1", result.message
        after = client.http.post("/weights_checker", json={"action": "checksum"}).json()["checksum"]
    with RolloutEngine(bf16_llama, dtype="bfloat16", kv_cache_tokens=512) as full:
        assert full.get_weights_checksum() == before != after
        assert full.update_weights_from_tensor(list(state.items())).success
        assert full.get_weights_checksum() == after


def _group(engine: RolloutEngine, name: str, timeout_s: float, ranks: int = 1):
    """A bare weight-update group: this process's sender (rank 0) and ``engine``'s ``ranks`` (1 on)."""
    import threading

    from weight_sync.distributed import WeightUpdateSender
    from weight_sync.process_group import free_port

    port, joined = free_port(), []
    join = threading.Thread(target=lambda: joined.append(engine.init_weights_update_group(
        "127.0.0.1", port, 1, 1 + ranks, name, "gloo", timeout_s)))
    join.start()
    sender = WeightUpdateSender("127.0.0.1", port, 1 + ranks, name, "gloo", timeout_s)
    join.join(timeout_s + 10)
    assert joined and joined[0].success
    return sender


def _over_group(engine: RolloutEngine, sender, delta: WeightDelta, send, bucket_bytes: int = 1 << 14) -> WeightResult:
    """``engine`` receives ``delta`` over ``sender``'s group while ``send(named, bucket_bytes)`` sends (or fails to)."""
    import threading

    from weight_sync.distributed import WeightUpdateSender

    named = delta.named_tensors()
    names, dtypes, shapes = WeightUpdateSender.describe(named)
    out = []
    call = threading.Thread(target=lambda: out.append(engine.update_weights_from_delta_distributed(
        delta.header(), names, dtypes, shapes, sender.group_name, bucket_bytes=bucket_bytes)))
    call.start()
    with contextlib.suppress(Exception):  # a send that fails: the engine's result says what became of the push
        send(named, bucket_bytes)
    call.join(60)
    return out[0]


def _sparse_over_group(engine: RolloutEngine, sender, patches, shapes) -> WeightResult:
    """vLLM's sparse_nccl wire: per (name, int32 indices, values), the indices then the values, each broadcast."""
    import threading

    out = []
    call = threading.Thread(target=lambda: out.append(engine.update_weights_from_sparse_distributed(
        [n for n, _, _ in patches], [str(v.dtype).split(".")[-1] for _, _, v in patches], shapes,
        [i.numel() for _, i, _ in patches], sender.group_name)))
    call.start()
    sender.send([(f"{n}{s}", t) for n, i, v in patches for s, t in (("#indices", i), ("#values", v))],
                load_format="direct")
    call.join(60)
    return out[0]


def test_over_the_group_a_replica_behind_gets_a_full_push_alone_and_wire_faults_leave_a_named_version(bf16_llama):
    """Two replicas on one weight group (``DistributedTarget``), a trainer with fp32 master weights (cast to bf16
    as they are diffed): the first push whole, then deltas. Replica 1's weights are replaced behind the trainer's
    back: it refuses the next delta by its base while replica 0 takes it, and gets that version in full, sent
    point to point to it alone; the next push is a delta to both. Then on a bare group: a value corrupted on the
    wire, a short bucket, a trainer that stops after one bucket of two, a duplicated delta and one from the
    future each leave the engine on the version it had, saying why; the next delta goes through."""
    from transformers import AutoModelForCausalLM

    from trainer_bridge import DistributedTarget
    from trainer_bridge.push import push_delta

    model = AutoModelForCausalLM.from_pretrained(bf16_llama, dtype=torch.float32)
    tied = bool(model.config.tie_word_embeddings)
    master = {n: p.detach().clone() for n, p in model.named_parameters()}
    kw = dict(dtype="bfloat16", kv_cache_tokens=256)
    with RolloutEngine(bf16_llama, **kw) as first, RolloutEngine(bf16_llama, **kw) as second:
        target = DistributedTarget([first, second], timeout_s=20)
        tracker, kinds = DeltaTracker(), []
        for step in range(4):
            if step:
                master = _step(master, 80 + step, lr=3e-3)
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(master[n])
            if step == 2:  # replica 1 takes other weights under another name
                assert second.update_weights_from_tensor([("model.norm.weight", torch.ones(64, dtype=torch.bfloat16))],
                                                         partial=True, weight_version="elsewhere").success
            stats = push_delta(model, target, f"step-{step}", tracker, tie_word_embeddings=tied)
            assert stats.result.success, stats.result.message
            kinds.append(("delta" if stats.phases["delta"] else "full") + (" + catch-up" * ("caught_up" in stats.phases)))
            if step == 2:
                assert "replica 1" in stats.phases["caught_up"] and "serves version 'elsewhere'" in stats.phases["caught_up"]
            want = _checksum(model)
            assert [e.get_weight_version() for e in (first, second)] == [f"step-{step}"] * 2
            assert first.get_weights_checksum() == second.get_weights_checksum() == want
        assert kinds == ["full", "delta", "delta + catch-up", "delta"]
        target.close()

        sender = _group(first, "faults", timeout_s=3)
        master = _step(master, 90, lr=3e-4)
        delta = tracker.diff(_pushed(master).items(), "step-4")
        before = first.get_weights_checksum()

        def corrupted(named, bucket_bytes):
            named = [(n, t.clone()) for n, t in named]
            i = next(i for i, (n, t) in enumerate(named) if n.endswith("#values") and t.numel() > 1)
            named[i][1][0] = named[i][1][0] * 2 + 1
            sender.send(named, bucket_bytes=bucket_bytes)

        r = _over_group(first, sender, delta, corrupted)
        assert not r.success and "corrupted" in r.message and "undone" in r.message
        assert first.get_weights_checksum() == before and first.get_weight_version() == "step-3"

        def short(named, bucket_bytes):  # the last tensor half lost: the last bucket is fewer bytes than announced
            name, last = named[-1]
            assert last.numel() * last.element_size() >= 64, (name, last.numel())
            sender.send([*named[:-1], (name, last[: last.numel() // 2])], bucket_bytes=bucket_bytes)

        r = _over_group(first, sender, delta, short)
        assert not r.success and r.error_kind is None and "fewer than its" in r.message, r.message
        assert first.get_weights_checksum() == before and first.get_weight_version() == "step-3"
        # the trainer stops after the first bucket (it died, or the rest was lost): the receive times out
        r = _over_group(first, sender, delta, lambda named, b: sender.send(named[: len(named) // 2], bucket_bytes=b))
        assert not r.success and r.error_kind == WeightResult.GROUP and "torn down" in r.message, r.message
        assert first.get_weights_checksum() == before and first.get_weight_version() == "step-3"
        sender.close()
        sender = _group(first, "faults", timeout_s=3)  # the group is rebuilt, as a trainer's heal() does
        assert _over_group(first, sender, delta, lambda named, b: sender.send(named, bucket_bytes=b)).success
        after = first.get_weights_checksum()
        master = _step(master, 91, lr=3e-4)
        tracker.commit(delta)
        ahead = tracker.diff(_pushed(master).items(), "step-5")
        for stale in (delta, copy.copy(ahead)):  # the same delta again; one whose base is a version not yet here
            if stale is not delta:
                stale.base_version = "step-4b"
            r = _over_group(first, sender, stale, lambda named, b: sender.send(named, bucket_bytes=b))
            assert not r.success and r.error_kind == WeightResult.BASE and "serves version 'step-4'" in r.message
            assert first.get_weights_checksum() == after
        assert _over_group(first, sender, ahead, lambda named, b: sender.send(named, bucket_bytes=b)).success
        assert first.get_weight_version() == "step-5"
        sender.close()


def _checksum(model) -> str:
    from weight_sync.checksum import checksum_named_tensors

    tied = model.config.tie_word_embeddings
    return checksum_named_tensors([(n, t) for n, t in model.state_dict().items()
                                   if not (tied and n == "lm_head.weight")], dtype=torch.bfloat16)


def test_the_delta_benchmark_pushes_both_ways_from_both_trainers_through_the_cli(tmp_path):
    """``rollout bench weight-sync --delta`` at a tiny size: after real Adam steps of an fp32 trainer and of a bf16
    one (fp32 master weights, ``MasterAdam``), each step pushed in full and as a delta over a weight group; the
    delta moves fewer bytes than the full push after the first step, and both engines end on the same weights."""
    import json

    from rollout.cli import main as cli_main

    assert cli_main(["bench", "weight-sync", "--delta", "--models", "tiny", "--lrs", "1e-4", "--steps", "2",
                     "--out-dir", str(tmp_path), "--workdir", str(tmp_path / "m")]) == 0
    res = json.load(open(tmp_path / "weight_sync_delta.json"))
    runs = res["models"][0]["delta"]
    assert sorted(runs) == ["0.0001", "0.0001, bfloat16 trainer"]
    for run in runs.values():
        assert run["same_weights"] and len(run["steps"]) == 2 and run["held_bytes"] == res["models"][0]["bytes"]
        for row in run["steps"]:
            assert row["delta_went"] and 0 < row["changed_fraction"] < 1 and row["full_s"] > 0 and row["diff_s"] > 0
        assert run["steps"][1]["bytes_ratio"] < 1
    assert os.path.isfile(tmp_path / "weight_sync_delta.png")
