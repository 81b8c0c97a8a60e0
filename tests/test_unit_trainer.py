"""The trainer side's seams without engines: the router as a ``RolloutService`` over replicas that
answer like servers, and typed failure kinds on ``WeightResult``."""

import pytest
import torch
from fakes import FakeReplica

from rollout.outputs import WeightResult
from rollout.sampling_params import SamplingParams
from trainer_bridge.grpo import GRPOConfig, run_grpo
from trainer_bridge.router import ReplicaRouter


def test_the_router_is_a_rollout_service_over_its_replicas():
    a, b = FakeReplica("a", 100), FakeReplica("bb", 20)
    router = ReplicaRouter([a, b])
    assert router.dtype == torch.bfloat16 and router.tp_size == 1 and router.serving_replicas() == 2
    assert router.release_memory_occupation(["kv_cache"]).detail["freed_bytes"] == 120  # both replicas'
    assert router.resume_memory_occupation().success and router.health()
    outs = router.generate(input_ids=[[1, 2], [3], [4]], sampling_params=SamplingParams(n=2))
    assert [(o.prompt_index, o.sample_index) for o in outs] == [(i, j) for i in range(3) for j in range(2)]
    assert router.take_replica_failures() == []
    b.broken = True
    outs = router.generate(input_ids=[[1], [2], [3], [4]], sampling_params=SamplingParams(n=1))
    assert len(outs) == 4 and all(o.output_token_ids == [1] for o in outs)  # b's prompts ran on a
    failures = router.take_replica_failures()
    assert len(failures) == 1 and "bb" in failures[0] and router.take_replica_failures() == []  # once
    assert router.serving_replicas() == 1


def test_a_request_a_replica_refuses_as_bad_input_is_the_caller_s_error_not_a_replica_failure():
    """A 400 (the request's fault: every replica would refuse it) reaches the caller as it is; no replica is
    marked down for it. A replica that is gone still is."""
    from rollout.server.client import RolloutServerError

    class Refuses(FakeReplica):
        def generate(self, input_ids, sampling_params, **kw):
            if kw.get("top_logprobs_num", 0) > 20:
                raise RolloutServerError(400, "top_logprobs_num must be <= 20 on this server")
            return super().generate(input_ids, sampling_params, **kw)

    router = ReplicaRouter([Refuses("a", 1), Refuses("b", 1)])
    with pytest.raises(RolloutServerError, match="top_logprobs_num"):
        router.generate(input_ids=[[1], [2]], sampling_params=SamplingParams(), top_logprobs_num=100)
    assert router.serving_replicas() == 2 and router.take_replica_failures() == []
    assert len(router.generate(input_ids=[[1], [2]], sampling_params=SamplingParams())) == 2


def test_a_replica_refusing_a_release_is_named_in_the_routers_result():
    class Refuses(FakeReplica):
        def release_memory_occupation(self, tags=None, backup_weights=False):
            return WeightResult.fail("memory is pinned")

    router = ReplicaRouter([FakeReplica("a", 1), Refuses("b", 1)])
    out = router.release_memory_occupation()
    assert not out.success and "replica 1 (b)" in out.message and "memory is pinned" in out.message


def test_run_grpo_without_a_target_needs_an_in_process_engine():
    with pytest.raises(ValueError, match="needs its target"):
        run_grpo(GRPOConfig(release_memory=False, steps=1), None, ReplicaRouter([FakeReplica("a", 1)]), [[1]],
                 lambda p, c: 0.0)


def test_a_failure_kind_is_a_field_that_travels_with_the_result():
    broke = WeightResult.fail("receive failed", kind=WeightResult.GROUP)
    refused = WeightResult.fail("bad dtype")
    assert broke.error_kind == WeightResult.GROUP and refused.error_kind is None
    merged = WeightResult.merge([WeightResult.ok("fine"), broke])
    assert merged.error_kind == WeightResult.GROUP and merged.message.startswith("TP rank 1")
    assert broke.published("v1", 0.5).error_kind == WeightResult.GROUP
    with pytest.warns(DeprecationWarning):
        assert broke["success"] is False
