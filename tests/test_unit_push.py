"""``push_weights`` without an engine: what a target is handed (names, order, dtype, buckets) and what
it ends up holding, through ``FakeTarget``, on a real (tiny) Hugging Face model."""

import pytest
import torch
from fakes import FakeTarget
from transformers import LlamaConfig, LlamaForCausalLM

from trainer_bridge.push import push_weights


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def _names(target: FakeTarget) -> list[str]:
    return [n for bucket in target.transactions[-1][1] for n, _, _ in bucket]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_push_hands_every_parameter_once_in_model_order_cast_to_the_targets_dtype(model, dtype):
    target = FakeTarget(dtype)
    stats = push_weights(model, target, version="v1", bucket_bytes=8 << 10)
    assert stats.result.success and target.version == "v1"
    assert _names(target) == [n for n, _ in model.named_parameters()]
    assert {d for bucket in target.transactions[-1][1] for _, d, _ in bucket} == {dtype}
    for name, p in model.named_parameters():
        assert torch.equal(target.weights[name], p.detach().to(dtype).float()), name
    item = torch.empty((), dtype=dtype).element_size()
    sizes = [[item * torch.Size(s).numel() for _, _, s in bucket] for bucket in target.transactions[-1][1]]
    assert all(sum(b) <= 8 << 10 or len(b) == 1 for b in sizes)  # cut at the bucket size; big ones alone
    assert len(sizes) == stats.num_buckets > 1 and stats.num_bytes == sum(map(sum, sizes))
    # the sampled values verify_pushed reads back: first, middle and last parameter, as pushed
    assert all(torch.equal(v, target.weights[n].flatten()[: v.numel()]) for n, v in stats.samples.items())


def test_per_parameter_pushes_one_tensor_a_bucket_and_tied_heads_are_left_out(model):
    target = FakeTarget()
    stats = push_weights(model, target, version="v2", per_parameter=True, tie_word_embeddings=True)
    names = [n for n, _ in model.named_parameters() if n != "lm_head.weight"]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert target.transactions[-1][1] == [[(n, torch.float32, shapes[n])] for n in names]
    assert stats.num_buckets == len(names) and "lm_head.weight" not in target.weights


def test_pooled_buffers_carry_each_push_values_not_the_last_ones(model):
    """A target's BucketPool is reused from push to push: the second push's buckets reuse the first
    one's memory, and each commit holds that push's values."""
    target = FakeTarget(torch.bfloat16, pooled=True)
    push_weights(model, target, version="a", bucket_bytes=8 << 10)
    first = {n: t.clone() for n, t in target.weights.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    try:
        push_weights(model, target, version="b", bucket_bytes=8 << 10)
        for name, p in model.named_parameters():
            assert torch.equal(target.weights[name], p.detach().bfloat16().float()), name
            assert not torch.equal(target.weights[name], first[name])
    finally:
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(1.0)


def test_a_refused_commit_is_reported_and_leaves_the_target_as_it_was(model):
    target = FakeTarget()
    assert push_weights(model, target, version="ok").result.success
    target.refuse = "the engine refused: shapes differ"
    before = {n: t.clone() for n, t in target.weights.items()}
    with torch.no_grad():
        model.model.norm.weight.add_(3.0)
    try:
        stats = push_weights(model, target, version="bad")
    finally:
        with torch.no_grad():
            model.model.norm.weight.sub_(3.0)
    assert stats.result.success is False and "shapes differ" in stats.result.message and target.version == "ok"
    assert all(torch.equal(before[n], target.weights[n]) for n in before)
