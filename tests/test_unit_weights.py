"""The weight path's parts without an engine: the wire layout's invariants, the loader's
rejections, safetensors checks, the typed messages and results, and one rank's ``RankWeights``
on a real ``ModelRunner``."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import struct

import pytest
import torch

from rollout.config import EngineConfig
from rollout.executor.model_runner import ModelRunner
from rollout.executor.param_storage import flatten_parameters
from rollout.models import ModelConfig, build_model
from rollout.outputs import WeightResult
from rollout.weights.loader import WeightLoadError, load_named_tensors, plan_load, weight_name_map
from rollout.weights.safetensors_io import FolderNotAllowed, PinnedFolder, SafetensorsFolder
from rollout.worker.messages import (
    WEIGHT_MESSAGES,
    AbortTransaction,
    ApplyTensors,
    BeginTransaction,
    CommitTransaction,
    ReadWeight,
    ReleaseMemory,
    ResumeMemory,
    StageTensors,
    WeightsChecksum,
)
from weight_sync.layout import (
    ALIGN,
    FIRST_BUCKET_BYTES,
    aligned_nbytes,
    bucket_layouts,
    bucket_specs,
    contiguous_run,
    layout,
    wire_order,
)

QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "tie_word_embeddings": False}


def hf_order(cfg: dict) -> list[str]:
    """Names in a trainer's own order (transformers' state_dict of the same config)."""
    import transformers

    hf_cfg = transformers.Qwen2Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("meta"):
        return list(transformers.AutoModelForCausalLM.from_config(hf_cfg).state_dict())


@pytest.fixture(scope="module")
def engine_model():
    """Our model on CPU, parameters laid out as the runner lays them (one flat buffer per dtype)."""
    cfg = ModelConfig.from_dict(QWEN2)
    with torch.device("meta"):
        model = build_model(cfg, torch.float32)
    flatten_parameters(model, torch.device("cpu"))
    return model, weight_name_map(model)


# ---------------------------------------------------------------------------------------------
# wire layout


def test_wire_order_is_a_stable_permutation_with_biases_last_in_each_layer():
    names = ["embed.weight", "model.layers.0.q.weight", "model.layers.0.q.bias", "model.layers.0.k.weight",
             "model.layers.0.k.bias", "model.layers.1.q.bias", "model.layers.1.q.weight", "norm.weight"]
    order = wire_order(names)
    assert sorted(order) == list(range(len(names)))
    got = [names[i] for i in order]
    assert got == ["embed.weight", "model.layers.0.q.weight", "model.layers.0.k.weight", "model.layers.0.q.bias",
                   "model.layers.0.k.bias", "model.layers.1.q.weight", "model.layers.1.q.bias", "norm.weight"]


def test_buckets_cover_wire_order_within_their_limits():
    specs = [(f"model.layers.{i // 3}.w{i}.{'bias' if i % 3 == 2 else 'weight'}", torch.float32, (1000 + 37 * i,))
             for i in range(30)]
    bucket_bytes = 20_000
    buckets = list(bucket_specs(specs, bucket_bytes))
    flat = [s for b in buckets for s in b]
    assert [s[0] for s in flat] == [specs[i][0] for i in wire_order([s[0] for s in specs])]
    for i, b in enumerate(buckets):
        size = sum(aligned_nbytes(d, s) for _, d, s in b)
        limit = min(bucket_bytes, FIRST_BUCKET_BYTES) if i == 0 else bucket_bytes
        assert size <= limit or len(b) == 1
    big = [("a", torch.float32, (10_000,)), ("b", torch.float32, (10,))]
    assert [len(b) for b in bucket_specs(big, 1024)] == [1, 1]  # a tensor larger than a bucket goes alone


def test_an_adapters_buckets_break_where_its_a_tensors_end():
    """A LoRA call in ``rollout.weights.lora.wire_order`` (every A, then every B): no bucket holds both, so
    the A buckets can land in place in the engine's adapter buffer; the first bucket is not held to
    ``FIRST_BUCKET_BYTES`` (an adapter is sent from the one buffer its trainer holds it in)."""
    from rollout.weights.lora import wire_order as lora_order

    big = FIRST_BUCKET_BYTES // 4  # fp32 values: two A tensors already pass the first-bucket limit
    names = [f"base_model.model.model.layers.{i}.self_attn.{m}_proj.lora_{ab}.weight"
             for i in range(3) for m in "qv" for ab in "AB"]
    specs = [(n, torch.float32, (big // 4, 4) if ".lora_A." in n else (64, 16)) for n in names]
    specs = [specs[i] for i in lora_order(names)]
    n_a = sum(".lora_A." in n for n in names)
    buckets = list(bucket_specs(specs, 64 << 20))
    assert [len(b) for b in buckets] == [n_a, len(names) - n_a]  # A (past FIRST_BUCKET_BYTES), then B
    for bucket_bytes in (3 * big * 4 // 2, 4096):  # smaller buckets: never an A beside a B
        buckets = list(bucket_specs(specs, bucket_bytes))
        assert [s for b in buckets for s in b] == specs
        assert all(len({".lora_A." in s[0] for s in b}) == 1 for b in buckets), [[s[0][-15:] for s in b] for b in buckets]
    # a full model's call keeps its small first bucket
    full = [(f"model.layers.{i}.mlp.up_proj.weight", torch.float32, (big // 4, 4)) for i in range(3)]
    assert [len(b) for b in bucket_specs(full, 64 << 20)] == [1, 2]


def test_call_specs_reuse_the_last_calls_tuples_only_while_the_lists_are_equal():
    """``RolloutEngine``'s distributed calls convert names / dtypes / shapes once per distinct list: equal
    lists give the very same tuples (the ranks then skip parsing them), a list changed in place does not."""
    import numpy as np

    from rollout.engine.engine import CallSpecs

    calls = CallSpecs()
    names, dtypes, shapes = ["a.weight", "b.weight"], ["float32", "bfloat16"], [[2, 3], torch.Size([4])]
    first = calls(names, dtypes, shapes)
    assert first == (("a.weight", "b.weight"), ("float32", "bfloat16"), ((2, 3), (4,)))
    assert calls(list(names), list(dtypes), [[2, 3], torch.Size([4])]) is first  # equal lists: the same tuples
    assert calls(tuple(names), tuple(dtypes), tuple(shapes)) is first
    shapes[0][1] = 5  # changed in place: converted again
    assert calls(names, dtypes, shapes)[2] == ((2, 5), (4,))
    dtypes[1] = "float16"
    assert calls(names, dtypes, shapes)[1] == ("float32", "float16")
    arr = calls(np.array(names), dtypes, [np.array([2, 5]), np.array([4])])  # arrays: converted, never kept
    assert arr == (("a.weight", "b.weight"), ("float32", "float16"), ((2, 5), (4,)))
    assert calls(np.array(names), dtypes, [np.array([2, 5]), np.array([4])]) == arr
    with pytest.raises(ValueError, match="lists of ints"):
        calls(names, dtypes, [[2, "x"], [4]])


def test_layout_offsets_are_aligned_and_disjoint():
    metas, total = layout([("a", torch.bfloat16, (3,)), ("b", torch.float32, (17, 2)), ("c", torch.int8, (1,))])
    assert [m.offset % ALIGN for m in metas] == [0, 0, 0]
    for m, nxt in zip(metas, metas[1:]):
        assert m.offset + m.nbytes <= nxt.offset
    assert total == sum(aligned_nbytes(torch.bfloat16 if m.dtype == "bfloat16" else torch.float32
                                       if m.dtype == "float32" else torch.int8, m.shape) for m in metas)


def test_contiguous_run_accepts_only_tensors_lying_as_the_bucket_lays_them():
    buf = torch.zeros(64, dtype=torch.float32)  # 256 bytes
    metas, total = layout([("a", torch.float32, (16,)), ("b", torch.float32, (16,))])
    a, b = buf[:16], buf[16:32]
    run = contiguous_run([a, b], metas, total)
    assert run is not None and run.numel() == total and run.data_ptr() == a.data_ptr()
    assert contiguous_run([a, buf[32:48]], metas, total) is None  # a gap
    assert contiguous_run([a, torch.zeros(16)], metas, total) is None  # another storage
    assert contiguous_run([buf.view(16, 4)[:, 0], b], metas, total) is None  # not contiguous
    odd, odd_total = layout([("a", torch.float32, (16,)), ("b", torch.float32, (3,))])  # last one padded
    assert contiguous_run([a, buf[16:19]], odd, odd_total) is not None  # a sender may send the padding
    assert contiguous_run([a, buf[16:19]], odd, odd_total, tail_padding_ok=False) is None  # a receiver must not


def test_a_trainers_order_lands_in_the_engines_parameter_memory_in_place(engine_model):
    model, name_map = engine_model
    names = hf_order(QWEN2)
    specs = [(n, torch.float32, tuple(name_map[n].slice.dst.shape)) for n in names]
    for bucket_bytes in (4 << 10, 64 << 10, 1 << 30):
        for metas, total in bucket_layouts(specs, bucket_bytes):
            dsts = [name_map[m.name].slice.dst for m in metas]
            assert contiguous_run(dsts, metas, total, tail_padding_ok=False) is not None, [m.name for m in metas]
    # the alphabetical order of a safetensors file does not
    shuffled = sorted(specs)
    assert any(contiguous_run([name_map[m.name].slice.dst for m in metas], metas, total, tail_padding_ok=False) is None
               for metas, total in bucket_layouts(shuffled, 64 << 10))


# ---------------------------------------------------------------------------------------------
# loader


def full_set(name_map) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(n, torch.randn(t.slice.dst.shape, generator=g)) for n, t in name_map.items()]


@pytest.mark.parametrize("change, why", [
    (lambda ts: ts + [("model.nope.weight", torch.zeros(2))], "unknown weight name 'model.nope.weight'"),
    (lambda ts: ts + [ts[0]], "given twice"),
    (lambda ts: [(ts[0][0], torch.zeros(3, 3))] + ts[1:], "does not match the model's"),
    (lambda ts: [(ts[0][0], ts[0][1].double())] + ts[1:], "dtype torch.float64 does not match"),
    (lambda ts: [(ts[0][0], ts[0][1].long())] + ts[1:], "dtype torch.int64"),
    (lambda ts: [(ts[0][0], torch.full_like(ts[0][1], float("nan")))] + ts[1:], "contains NaN or Inf"),
    (lambda ts: ts[1:], "missing weights"),
    (lambda ts: [(ts[0][0], [1.0, 2.0])] + ts[1:], "expected a tensor, got list"),
    (lambda ts: [(7, ts[0][1])] + ts[1:], "weight names must be strings"),
    (lambda ts: ["not a pair"] + ts, "expected (name, tensor) pairs"),
])
def test_plan_load_rejects_with_the_reason(engine_model, change, why):
    _, name_map = engine_model
    with pytest.raises(WeightLoadError) as info:
        plan_load(name_map, change(full_set(name_map)), strict_dtype=True, check_finite=True)
    assert why in str(info.value) and "nothing was loaded" in str(info.value)


def test_plan_load_lists_every_problem_and_accepts_partial_sets(engine_model):
    _, name_map = engine_model
    ts = full_set(name_map)
    bad = [("x.weight", torch.zeros(1)), (ts[0][0], torch.zeros(2, 2))]
    with pytest.raises(WeightLoadError) as info:
        plan_load(name_map, bad)
    message = str(info.value)
    assert "unknown weight name 'x.weight'" in message and "does not match" in message and "missing" in message
    plan = plan_load(name_map, ts[:2] + [("model.rotary_emb.inv_freq", torch.zeros(3))], require_complete=False)
    assert [n for n, _, _ in plan.items] == [ts[0][0], ts[1][0]]  # derived buffers are skipped


def test_load_named_tensors_copies_in_place(engine_model):
    model, name_map = engine_model
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    ts = full_set(name_map)
    report = load_named_tensors(model, ts)
    assert report.num_tensors == len(ts)
    for name, t in ts:
        sl = name_map[name].slice
        assert torch.equal(sl.dst, t)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before  # storage never moved


# ---------------------------------------------------------------------------------------------
# safetensors checks


def write_raw(path: str, header: object, data: bytes = b"") -> str:
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize("header, why", [
    ([1, 2], "header must be a JSON object"),
    ({"w": "x"}, "expected an object"),
    ({"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, "unsupported dtype"),
    ({"w": {"dtype": "F32", "shape": ["1"], "data_offsets": [0, 4]}}, "shape must be a list of non-negative"),
    ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, "shape must be a list of non-negative"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, "data_offsets must be [begin, end]"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, "bad offsets"),
])
def test_malformed_headers_are_refused_with_the_reason(tmp_path, header, why):
    write_raw(str(tmp_path / "model.safetensors"), header, b"\0" * 4)
    with pytest.raises(WeightLoadError) as info:
        folder_tensors(tmp_path)
    assert why in str(info.value)


def folder_files(path) -> list[str]:
    with PinnedFolder.open(path) as folder, SafetensorsFolder(folder) as files:
        return files.file_names()


def folder_tensors(path, follow_links: bool = False) -> dict[str, torch.Tensor]:
    with PinnedFolder.open(path) as folder, SafetensorsFolder(folder, follow_links) as files:
        return {name: lazy.read() for name, lazy in files.tensors()}


def test_tensors_are_read_through_the_pin_as_safetensors_wrote_them(tmp_path):
    from safetensors.torch import save_file

    state = {"a": torch.randn(3, 5), "b": torch.arange(6, dtype=torch.int64).view(2, 3),
             "c": torch.randn(4).to(torch.bfloat16), "empty": torch.zeros(0, 7), "scalar": torch.tensor(2.5)}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    got = folder_tensors(tmp_path)
    assert got.keys() == state.keys()
    for name, t in state.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name


def test_a_pinned_folder_reads_what_it_pinned_whatever_the_path_names_later(tmp_path):
    from safetensors.torch import save_file

    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "ckpt").mkdir()
    save_file({"w": torch.ones(2)}, str(allowed / "ckpt" / "model.safetensors"))
    save_file({"w": torch.full((2,), 7.0)}, str(outside / "model.safetensors"))
    roots = [os.path.realpath(allowed)]
    with pytest.raises(FolderNotAllowed, match="outside --allowed-weight-dirs"):
        PinnedFolder.open(outside, roots)
    os.symlink(outside, allowed / "sneaky")  # inside by name, outside where it lies
    with pytest.raises(FolderNotAllowed):
        PinnedFolder.open(allowed / "sneaky", roots)
    with PinnedFolder.open(allowed / "ckpt", roots) as folder:
        os.rename(allowed / "ckpt", allowed / "old")  # the checked path now names the outside model
        os.symlink(outside, allowed / "ckpt")
        with SafetensorsFolder(folder) as files:
            assert torch.equal(dict(files.tensors())["w"].read(), torch.ones(2))
        lazy = None
        with SafetensorsFolder(folder) as files:
            lazy = dict(files.tensors())["w"]
        with pytest.raises(WeightLoadError, match="closed"):  # never a descriptor number it gave back
            lazy.read()
    with pytest.raises(ValueError, match="closed"):
        folder.real_path()
    with PinnedFolder.open(allowed / "old") as folder:
        # a passed descriptor shares its directory offset with every rank it went to: one rank's
        # listing (here: a scan left at the end) must not change what another lists
        scan = os.scandir(folder.fd)
        next(scan)
        with SafetensorsFolder(folder) as files:
            assert files.file_names() == ["model.safetensors"]
        scan.close()
    with pytest.raises(TypeError, match="send_handle"):
        pickle.dumps(PinnedFolder.open(allowed / "old"))
    for bad, why in [(tmp_path / "missing", "not a folder"), (allowed / "old" / "model.safetensors", "not a folder"),
                     ("a\0b", "NUL")]:
        with pytest.raises(WeightLoadError, match=why):
            PinnedFolder.open(bad)


def test_index_files_are_checked_and_confined_to_the_folder(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    index = folder / "model.safetensors.index.json"
    for body, why in [({"metadata": {}}, "weight_map"), ([], "not a JSON object"), ({"weight_map": {"w": 3}}, "file names"),
                      ({"weight_map": {"w": "../outside.safetensors"}}, "outside the model folder"),
                      ({"weight_map": {"w": "sub/inner.safetensors"}}, "in a subfolder"),
                      ({"weight_map": {"w": ".."}}, "file names in the model folder itself"),
                      ({"weight_map": {"w": "missing.safetensors"}}, "do not exist")]:
        index.write_text(json.dumps(body))
        with pytest.raises(WeightLoadError) as info:
            folder_tensors(folder)
        assert why in str(info.value), body
    write_raw(str(tmp_path / "outside.safetensors"), {})
    os.symlink(tmp_path / "outside.safetensors", folder / "link.safetensors")
    index.write_text(json.dumps({"weight_map": {"w": "link.safetensors"}}))
    with pytest.raises(WeightLoadError, match="symbolic link"):
        folder_tensors(folder)
    os.mkfifo(folder / "fifo.safetensors")  # opened without blocking, refused as not a file
    index.write_text(json.dumps({"weight_map": {"w": "fifo.safetensors"}}))
    with pytest.raises(WeightLoadError, match="not a regular file"):
        folder_tensors(folder)
    os.unlink(folder / "fifo.safetensors")
    index.unlink()
    assert folder_files(folder) == ["link.safetensors"]
    with pytest.raises(WeightLoadError, match="symbolic link"):  # a symlinked file, no index
        folder_tensors(folder)
    assert folder_tensors(folder, follow_links=True) == {}  # the operator's own model may link (a hub snapshot)


# ---------------------------------------------------------------------------------------------
# typed messages and results


def test_messages_are_frozen_plain_data():
    for cls in WEIGHT_MESSAGES:
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
    msg = ReleaseMemory(("weights",), True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.backup_weights = False
    assert pickle.loads(pickle.dumps(msg)) == msg  # crosses a pipe to a spawned rank


def test_weight_result_is_built_in_one_place_and_reads_like_a_dict():
    ok = WeightResult.ok("loaded 3 tensors", num_bytes=12, receive_s=0.5)
    assert ok.success and ok["success"] and ok["num_bytes"] == 12 and ok["receive_s"] == 0.5
    assert ok.get("commit_s") is None and "receive_s" in ok
    with pytest.raises(KeyError):
        ok["commit_s"]
    published = ok.published("v7", 1.25)
    assert (published.weight_version, published.seconds, published.message) == ("v7", 1.25, "loaded 3 tensors")
    merged = WeightResult.merge([ok, WeightResult.fail("bad name"), WeightResult.fail("other")])
    assert not merged.success and merged.message == "TP rank 1: bad name"
    assert WeightResult.merge([ok, ok]) is ok


# ---------------------------------------------------------------------------------------------
# one rank's weights on a real runner (no engine, no scheduler)


@pytest.fixture(scope="module")
def rank(model_dir):
    from rollout.layers.parallel_state import TpState, tp_state_context
    from rollout.worker.rank_weights import RankWeights

    path = model_dir("unit-rank", "qwen2", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2)
    cfg = EngineConfig(model_path=path, kv_cache_tokens=64)
    state = TpState()
    with tp_state_context(state):
        runner = ModelRunner(cfg, ModelConfig.from_pretrained(path), torch.device("cpu"), torch.float32, 64)
    return RankWeights(runner, state, torch.device("cpu"))


def test_rank_applies_reads_and_refuses_while_released(rank):
    name = "model.layers.0.self_attn.k_proj.weight"  # a packed shard of qkv
    new = torch.full(rank.full_weight(name).shape, 0.25)
    assert rank.handle(ApplyTensors(((name, new),), partial=True)).success
    read = rank.handle(ReadWeight(name, 5))
    assert read.success and read.value == [0.25] * 5
    assert not rank.handle(ReadWeight("model.nope", 5)).success
    assert rank.handle(ReleaseMemory(("weights",), backup_weights=True)).detail["freed_bytes"] > 0
    for msg in (ReadWeight(name, 5), WeightsChecksum(), ApplyTensors(((name, new),), partial=True)):
        result = rank.handle(msg)
        assert not result.success and "released" in result.message, msg
    assert rank.handle(ResumeMemory(("weights",))).success
    assert rank.handle(ReadWeight(name, 3)).value == [0.25] * 3


def test_rank_transaction_commits_all_or_nothing(rank):
    name = "model.norm.weight"
    before = rank.handle(ReadWeight(name, 4)).value
    assert rank.handle(BeginTransaction()).success
    assert rank.handle(StageTensors(((name, torch.full((64,), 3.0)),))).success
    assert not rank.handle(StageTensors((("model.nope", torch.zeros(1)),))).success  # poisons the transaction
    result = rank.handle(CommitTransaction(partial=True))
    assert not result.success and "transaction discarded" in result.message
    assert rank.handle(ReadWeight(name, 4)).value == before
    assert not rank.handle(CommitTransaction()).success  # nothing open any more
    rank.handle(BeginTransaction())
    rank.handle(StageTensors(((name, torch.full((64,), 3.0)),)))
    assert rank.handle(AbortTransaction()).success
    assert rank.handle(ReadWeight(name, 4)).value == before
    with pytest.raises(TypeError, match="not a weight message"):
        rank.handle("apply_named_tensors")


def test_the_operators_model_may_link_its_files_an_update_may_not(rank, model_dir, tmp_path):
    """A Hugging Face cache snapshot is a folder of symlinks to blobs elsewhere: the model an engine
    starts with may be one (the operator chose it); an update's files must be the folder's own."""
    from rollout.layers.parallel_state import TpState, tp_state_context
    from rollout.worker.messages import ApplyDisk

    path = rank.runner.config.model_path
    snapshot, blobs = tmp_path / "snapshot", tmp_path / "blobs"
    snapshot.mkdir()
    blobs.mkdir()
    for name in os.listdir(path):
        blob = blobs / f"sha-{name}"
        with open(os.path.join(path, name), "rb") as f:
            blob.write_bytes(f.read())
        os.symlink(blob, snapshot / name)
    with tp_state_context(TpState()):
        linked = ModelRunner(EngineConfig(model_path=str(snapshot), kv_cache_tokens=64),
                             ModelConfig.from_pretrained(str(snapshot)), torch.device("cpu"), torch.float32, 64)
    assert linked.load_report.num_tensors == rank.runner.load_report.num_tensors
    with PinnedFolder.open(snapshot) as folder:
        result = rank.handle(ApplyDisk(str(snapshot), folder=folder))
    assert not result.success and "symbolic link" in result.message
    with PinnedFolder.open(path) as folder:
        assert rank.handle(ApplyDisk(path, folder=folder)).success
    assert not rank.handle(ApplyDisk(path)).success  # a message without its pinned folder reads nothing
