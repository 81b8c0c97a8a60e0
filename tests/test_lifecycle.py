"""The weight-update lifecycle, walked on a real engine through its one owner (``rollout.engine.lifecycle``):
each route family's own sequence (the routes are thin adapters over these calls; their HTTP sequences are the
compat tests'), a failure in every state and what it leaves behind, a second start while one is open, recovery
after the idle timeout, and publishes that abort nothing unless asked."""

import os

import pytest
from safetensors.torch import load_file

from rollout.engine.lifecycle import Opener, State, TransactionError

NAME = "model.layers.0.mlp.down_proj.weight"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def engine(llama_path, module_engines):
    return module_engines(llama_path, dtype="float32", kv_cache_tokens=512, max_num_seqs=4,
                          weight_update_timeout_s=60.0)


@pytest.fixture(scope="module")
def weights(llama_path):
    files = [f for f in os.listdir(llama_path) if f.endswith(".safetensors")]
    tensors = {k: v for f in files for k, v in load_file(os.path.join(llama_path, f)).items()}
    return tensors[NAME]


@pytest.fixture
def life(engine, weights):
    """The engine's lifecycle on a clock of the test's, back to the checkpoint's weights and nothing open."""
    lifecycle = engine.weight_update_lifecycle
    lifecycle.clock = Clock()
    yield lifecycle
    engine.abort_weight_update()
    assert engine.update_weights_from_tensor([(NAME, weights)], weight_version="default", partial=True).success
    lifecycle.clock, lifecycle.expired = __import__("time").monotonic, None


def _value(engine) -> float:
    return engine.get_weights_by_name(NAME, 1)[0]


def test_each_family_stages_its_calls_and_publishes_them_together(engine, life, weights):
    for step, by in enumerate((Opener.API, Opener.SGLANG, Opener.VLLM, Opener.TRL), start=1):
        if by is Opener.TRL:  # TRL's first parameter call opens the transaction: nothing of its own open yet
            assert not engine.claim_weight_update(Opener.TRL)
        assert engine.begin_weight_update(f"v{step}", owner=by).success
        assert life.state is State.OPEN and engine.open_weight_update() is by
        if by is not Opener.API:
            assert engine.claim_weight_update(by)  # the family's update calls stage into its own
        before = _value(engine)
        assert engine.update_weights_from_tensor([(NAME, weights * (step + 1))], transaction=True).success
        assert _value(engine) == before and life.current().calls == 1  # staged only: the old weights serve
        result = engine.commit_weight_update(partial=True, by=None if by is Opener.API else by)
        assert result.success and result.weight_version == f"v{step}", result.message
        assert _value(engine) == pytest.approx(weights.flatten()[0].item() * (step + 1))
        assert life.state is State.IDLE and engine.open_weight_update() is None
    # slime / AReaL: pause, plain update calls (staged: the paused engine opens the transaction), continue
    engine.pause_generation("abort")
    assert engine.update_weights_from_tensor([(NAME, weights * 7)], weight_version="paused").success
    assert engine.open_weight_update() is Opener.PAUSED and _value(engine) != pytest.approx(weights.flatten()[0] * 7)
    result = engine.continue_generation()
    assert result.success and result.weight_version == "paused" and engine.open_weight_update() is None
    assert _value(engine) == pytest.approx(weights.flatten()[0].item() * 7)


def test_a_failure_in_every_state_leaves_the_old_weights_serving(engine, life, weights):
    before, version = _value(engine), engine.get_weight_version()
    # idle: a publish with nothing open is refused; nothing changes
    refused = engine.commit_weight_update(partial=True, by=Opener.VLLM)
    assert not refused.success and "no weight update to finish" in refused.message and life.state is State.IDLE
    assert engine.abort_weight_update().success  # nothing to abort: fine, and still nothing open
    # open: a call that fails (a wrong shape) marks the transaction failed; it stays open, its publish fails
    assert engine.begin_weight_update("bad", owner=Opener.SGLANG).success
    bad = engine.update_weights_from_tensor([(NAME, weights[:, :3])], transaction=True)
    assert not bad.success and life.state is State.OPEN and life.current().error == bad.message
    assert engine.update_weights_from_tensor([(NAME.replace("down", "up"), weights.T * 2)], transaction=True).success
    failed = engine.commit_weight_update(partial=True, by=Opener.SGLANG)
    assert not failed.success and life.state is State.IDLE  # published: nothing; the transaction is gone
    # publishing: a NaN found at the publish; the ranks drop the transaction, nothing of it serves
    assert engine.begin_weight_update("nan", owner=Opener.VLLM).success
    nan = weights.clone()
    nan[0, 0] = float("nan")
    assert engine.update_weights_from_tensor([(NAME, nan)], transaction=True, check_finite=False).success
    failed = engine.commit_weight_update(partial=True, by=Opener.VLLM)
    assert not failed.success and "NaN" in failed.message and life.state is State.IDLE
    assert _value(engine) == before and engine.get_weight_version() == version


def test_a_second_start_is_refused_naming_the_open_one_and_aborts_nothing(engine, life, weights):
    assert engine.begin_weight_update("first", owner=Opener.SGLANG).success
    assert engine.update_weights_from_tensor([(NAME, weights * 3)], transaction=True).success
    for by in (Opener.VLLM, Opener.SGLANG, Opener.API):
        second = engine.begin_weight_update("second", owner=by)
        assert not second.success and "/begin_weight_update" in second.message and "still open" in second.message
    # another opener's publish is refused too, and aborts nothing
    other = engine.commit_weight_update(partial=True, by=Opener.VLLM)
    assert not other.success and "nothing was aborted" in other.message
    assert engine.open_weight_update() is Opener.SGLANG and life.current().calls == 1
    # a continue publishes only what the paused engine opened: an explicit transaction stays open
    engine.pause_generation("abort")
    assert engine.continue_generation() is None and engine.open_weight_update() is Opener.SGLANG
    result = engine.commit_weight_update(partial=True, by=Opener.SGLANG)
    assert result.success and result.weight_version == "first"
    assert _value(engine) == pytest.approx(weights.flatten()[0].item() * 3)
    with pytest.raises(ValueError, match="Opener"):
        engine.begin_weight_update("typed", owner="vllm")  # an owner is an Opener, never a string


def test_update_calls_of_a_protocol_without_a_start_supersede_a_transaction_left_open(engine, life, weights):
    assert engine.begin_weight_update("left", owner=Opener.VLLM).success
    assert not engine.claim_weight_update(Opener.TRL)  # TRL's first call: vLLM's left transaction aborted
    assert engine.open_weight_update() is None
    late = engine.commit_weight_update(partial=True, by=Opener.VLLM)
    assert not late.success and "no weight update to finish" in late.message


def test_recovery_after_the_idle_timeout(engine, life, weights):
    before = _value(engine)
    assert engine.begin_weight_update("slow", owner=Opener.VLLM).success
    assert engine.update_weights_from_tensor([(NAME, weights * 5)], transaction=True).success
    life.clock.now += 59  # each call restarts the idle clock: not yet
    assert engine.open_weight_update() is Opener.VLLM
    life.clock.now += 2
    # the opener's next call learns its transaction expired (nothing applied, nothing published) ...
    with pytest.raises(TransactionError, match="idle past 60 s"):
        engine.claim_weight_update(Opener.VLLM)
    assert engine.open_weight_update() is None and _value(engine) == before
    # ... and a start goes through again
    assert engine.begin_weight_update("again", owner=Opener.VLLM).success
    assert engine.update_weights_from_tensor([(NAME, weights * 5)], transaction=True).success
    assert engine.commit_weight_update(partial=True, by=Opener.VLLM).success
    assert _value(engine) == pytest.approx(weights.flatten()[0].item() * 5)
    # a start after another opener's transaction timed out: the expired one is aborted, the new one opens
    assert engine.begin_weight_update("forgotten", owner=Opener.SGLANG).success
    life.clock.now += 120
    assert engine.begin_weight_update("fresh", owner=Opener.TRL).success
    assert engine.open_weight_update() is Opener.TRL
    assert engine.abort_weight_update(by=Opener.TRL).success and engine.open_weight_update() is None
