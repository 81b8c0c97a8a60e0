"""Fuzzing the public API with ``hypothesis``: sampling parameters and request shapes, control calls
in random orders from several threads, malformed checkpoint files. Every trial must end in a
clear error (``ValueError`` / ``RuntimeError`` with a message, or ``success=False`` with one) or a
well-formed result, and afterwards the same engine must still generate exactly what it did before.

Bounded by default (``ROLLOUT_FUZZ_EXAMPLES``, 25 examples per test); ``pytest --fuzz-long`` runs
400 per test.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
from helpers import random_prompts
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from rollout import RolloutEngine, SamplingParams

EXAMPLES = int(os.environ.get("ROLLOUT_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 25,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
GREEDY = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
PROMPTS = random_prompts(300, [7, 4], seed=90)


@pytest.fixture(scope="module")
def model(model_dir):
    a = model_dir("fuzz-a", "qwen2", seed=5)
    b = model_dir("fuzz-b", "qwen2", seed=6)
    return a, list(load_file(os.path.join(a, "model.safetensors")).items()), \
        list(load_file(os.path.join(b, "model.safetensors")).items())


@pytest.fixture(scope="module")
def engine(model):
    with RolloutEngine(model[0], dtype="float32", kv_cache_tokens=1024, request_timeout_s=120) as e:
        e.reference = [o.output_token_ids for o in e.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
        yield e


def serves_reference(engine) -> bool:
    return [o.output_token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == engine.reference


# ---------------------------------------------------------------------------------------------
# sampling parameters and request shapes

junk = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.integers(-(2**80), 2**80),
                 st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 2), st.text(max_size=3),
                 st.lists(st.integers(-3, 400), max_size=4),
                 st.dictionaries(st.integers(-3, 400), st.floats(allow_nan=True, allow_infinity=True), max_size=3))
FIELDS = {
    "max_new_tokens": st.one_of(st.integers(-2, 6), junk), "min_new_tokens": st.one_of(st.integers(-1, 4), junk),
    "n": st.one_of(st.integers(-1, 3), junk), "temperature": st.one_of(st.floats(0, 3), st.just(1e-300), junk),
    "top_p": st.one_of(st.floats(0, 1), junk), "top_k": st.one_of(st.integers(-1, 400), junk),
    "min_p": st.one_of(st.floats(0, 1), junk), "seed": junk, "stop": st.one_of(st.text(max_size=2), junk),
    "stop_token_ids": junk, "ignore_eos": junk, "frequency_penalty": junk, "presence_penalty": junk,
    "repetition_penalty": st.one_of(st.floats(0.5, 2), junk), "logit_bias": junk,
    "allowed_token_ids": st.one_of(st.lists(st.integers(0, 300), min_size=1, max_size=4), junk),
}
token = st.one_of(st.integers(0, 299), st.integers(-5, 400), st.booleans(), st.floats(0, 5))
prompt_shapes = st.one_of(st.lists(st.integers(0, 299), min_size=1, max_size=6),
                          st.lists(st.lists(st.integers(0, 299), min_size=1, max_size=5), min_size=1, max_size=3),
                          st.lists(token, max_size=5), st.lists(st.lists(token, max_size=4), max_size=3),
                          st.text(max_size=3), st.none(), st.integers())


VALID = {  # in range, edge values included: these requests run
    "max_new_tokens": st.integers(0, 6), "min_new_tokens": st.integers(0, 2), "n": st.integers(1, 3),
    "temperature": st.sampled_from([0.0, 1e-300, 1e-40, 1e-6, 0.3, 1.0, 7.0, 3e38]),
    "top_p": st.sampled_from([1e-300, 1e-9, 0.5, 0.95, 1.0]), "top_k": st.sampled_from([-1, 0, 1, 5, 299, 300, 2**63]),
    "min_p": st.sampled_from([0.0, 0.05, 0.99, 1.0]), "seed": st.integers(-(2**70), 2**70),
    "stop_token_ids": st.lists(st.integers(0, 299), max_size=3), "ignore_eos": st.booleans(),
    "frequency_penalty": st.floats(-2, 2), "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.sampled_from([1e-30, 0.5, 1.0, 1.3, 3e38]),
    "logit_bias": st.dictionaries(st.integers(0, 299), st.sampled_from([-1e30, -100.0, 0.0, 5.0, 1e30]), max_size=3),
    "allowed_token_ids": st.lists(st.integers(0, 299), min_size=1, max_size=4),
}


@FUZZ
@given(params=st.one_of(st.fixed_dictionaries({}, optional=FIELDS), st.fixed_dictionaries({}, optional=VALID)),
       ids=prompt_shapes,
       top_logprobs=st.one_of(st.integers(-1, 4), junk), start=st.one_of(st.integers(-2, 4), junk))
def test_fuzz_sampling_params_and_request_shapes(engine, params, ids, top_logprobs, start):
    vocab = engine.model_config.vocab_size
    try:
        outs = engine.generate(input_ids=ids, sampling_params=params, top_logprobs_num=top_logprobs,
                               logprob_start_len=start)
    except ValueError as exc:
        assert str(exc)
        event("refused")
    else:
        event("generated")
        sp = SamplingParams.from_dict(params)
        prompts = ids if isinstance(ids[0], list) else [ids]
        assert len(outs) == sp.n * len(prompts)
        for o in outs:
            assert len(o.output_token_ids) <= sp.max_new_tokens
            assert all(0 <= t < vocab for t in o.output_token_ids)
            assert len(o.output_logprobs) == len(o.output_token_ids)
            assert all(lp == lp and lp <= 1e-5 for lp in o.output_logprobs), o.output_logprobs
            assert all(lp is None or (lp == lp and lp <= 1e-5) for lp in o.input_logprobs)
            if sp.allowed_token_ids:
                assert set(o.output_token_ids) <= set(sp.allowed_token_ids)
    assert serves_reference(engine)


# ---------------------------------------------------------------------------------------------
# control calls in any order, from two threads

TAGS = st.lists(st.sampled_from(["weights", "kv_cache", "cuda_graph"]), unique=True, max_size=3)
OPS = st.one_of(
    st.tuples(st.just("release"), TAGS, st.booleans()), st.tuples(st.just("resume"), TAGS),
    st.tuples(st.just("pause"), st.sampled_from(["abort", "retract", "in_place"])), st.just(("continue",)),
    st.just(("update_a",)), st.just(("update_b",)), st.just(("update_partial",)), st.just(("update_bad",)),
    st.just(("abort_all",)), st.just(("flush",)), st.just(("generate",)), st.just(("read",)),
    st.just(("transaction",)), st.tuples(st.just("version"), st.text(max_size=4)),
)


def _op(engine, model, op, background: list):
    _, tensors_a, tensors_b = model
    kind = op[0]
    if kind == "release":
        return engine.release_memory_occupation(op[1] or None, backup_weights=op[2])
    if kind == "resume":
        return engine.resume_memory_occupation(op[1] or None)
    if kind == "pause":
        return engine.pause_generation(op[1])
    if kind == "continue":
        return engine.continue_generation()
    if kind == "update_a":
        return engine.update_weights_from_tensor(tensors_a, weight_version="a")
    if kind == "update_b":
        return engine.update_weights_from_tensor(tensors_b, weight_version="b")
    if kind == "update_partial":
        return engine.update_weights_from_tensor(tensors_b[:2], partial=True)
    if kind == "update_bad":
        return engine.update_weights_from_tensor([(tensors_a[0][0], tensors_a[1][1])])
    if kind == "abort_all":
        return engine.abort_request(abort_all=True)
    if kind == "flush":
        return engine.flush_cache()
    if kind == "read":
        return engine.get_weights_by_name(tensors_a[0][0], 4)
    if kind == "transaction":
        engine.begin_weight_update("t")
        engine.update_weights_from_tensor(tensors_a[:3], transaction=True)
        return engine.commit_weight_update(partial=True)
    if kind == "version":
        return engine.update_weight_version(op[1] or "v")
    if kind == "generate":  # in the background: a paused engine holds it until continue
        box: dict = {}

        def run():
            try:
                box["out"] = engine.generate(input_ids=PROMPTS, sampling_params=SamplingParams(
                    max_new_tokens=12, temperature=0.8, seed=1, ignore_eos=True))
            except (ValueError, RuntimeError) as exc:
                box["error"] = exc
            except BaseException as exc:  # noqa: BLE001 - reported as a failure below
                box["unexpected"] = exc

        t = threading.Thread(target=run)
        t.start()
        background.append((t, box))
        return None
    raise AssertionError(kind)


def _run_ops(engine, model, ops, failures: list, background: list):
    for op in ops:
        try:
            result = _op(engine, model, op, background)
            if hasattr(result, "success") and not result.success:
                assert result.message, op
        except (ValueError, RuntimeError) as exc:
            if not str(exc):
                failures.append((op, "empty error message"))
        except BaseException as exc:  # noqa: BLE001 - collected and reported by the test
            failures.append((op, repr(exc)))


def _check_control_orders(engine, model, first, second):
    failures: list = []
    background: list = []
    threads = [threading.Thread(target=_run_ops, args=(engine, model, ops, failures, background))
               for ops in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a control call hung"
    # back to a known state: serving weights A under any version
    engine.continue_generation()
    assert engine.resume_memory_occupation().success
    assert engine.update_weights_from_tensor(model[1], weight_version="a").success
    for t, box in background:
        t.join(120)
        assert not t.is_alive(), "a generate call hung"
        assert "unexpected" not in box, box
        for o in box.get("out", []):
            assert all(lp == lp and lp <= 1e-5 for lp in o.output_logprobs)
            assert len(o.output_weight_versions) == len(o.output_token_ids)
    assert not failures, failures
    assert serves_reference(engine)


@FUZZ
@given(first=st.lists(OPS, min_size=1, max_size=6), second=st.lists(OPS, max_size=6))
def test_fuzz_control_calls_in_any_order_from_two_threads(engine, model, first, second):
    _check_control_orders(engine, model, first, second)


@pytest.fixture(scope="module")
def engine_tp2(model):
    with RolloutEngine(model[0], dtype="float32", kv_cache_tokens=1024, tp_size=2, tp_timeout_s=30,
                       request_timeout_s=120) as e:
        e.reference = [o.output_token_ids for o in e.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
        yield e


@settings(FUZZ, max_examples=max(5, EXAMPLES // 3))
@given(first=st.lists(OPS, min_size=1, max_size=5), second=st.lists(OPS, max_size=5))
def test_fuzz_control_calls_at_tp2(engine_tp2, model, first, second):
    _check_control_orders(engine_tp2, model, first, second)


# ---------------------------------------------------------------------------------------------
# malformed checkpoint folders

json_values = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=4),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                           max_leaves=8)
entries = st.fixed_dictionaries({}, optional={
    "dtype": st.one_of(st.sampled_from(["F32", "BF16", "I64", "F8", ""]), json_values),
    "shape": st.one_of(st.lists(st.integers(-2, 4), max_size=3), json_values),
    "data_offsets": st.one_of(st.lists(st.integers(-4, 80), max_size=3), json_values)})
headers = st.one_of(json_values, st.dictionaries(st.sampled_from(["model.norm.weight", "lm_head.weight", "x",
                                                                  "__metadata__"]), st.one_of(entries, json_values),
                                                 max_size=3))


@FUZZ
@given(header=headers, data=st.binary(max_size=96), length_delta=st.sampled_from([0, 0, 0, -3, 5, 2**40]),
       index=st.one_of(st.none(), json_values, st.fixed_dictionaries({"weight_map": json_values})))
def test_fuzz_malformed_checkpoint_files(engine, tmp_path_factory, header, data, length_delta, index):
    folder = tmp_path_factory.mktemp("ckpt")
    raw = json.dumps(header).encode()
    with open(folder / "model.safetensors", "wb") as f:
        f.write(max(0, len(raw) + length_delta).to_bytes(8, "little") + raw + data)
    if index is not None:
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    result = engine.update_weights_from_disk(str(folder), weight_version="never")
    assert not result.success and result.message
    assert engine.get_weight_version() != "never"
    assert serves_reference(engine)
