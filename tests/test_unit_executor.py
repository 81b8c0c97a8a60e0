"""The executor's memory objects without an engine: ``ParameterStorage`` (flat buffers, the
shadow, release/resume) and ``KvPool`` (one buffer for all layers, block copies, release/resume)."""

import pytest
import torch
from torch import nn

from rollout.executor.kv_pool import KvPool, kv_bytes_per_token, num_kv_blocks
from rollout.executor.param_storage import ParameterStorage


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.o = nn.Linear(4, 2)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block()])
        self.head = nn.Linear(2, 5, bias=False, dtype=torch.bfloat16)


def _storage():
    with torch.device("meta"):
        model = _Net()
    return model, ParameterStorage(model, torch.device("cpu"))


def test_parameters_become_views_of_one_buffer_per_dtype_in_wire_order():
    model, store = _storage()
    assert set(store.buffers) == {torch.float32, torch.bfloat16}
    f32 = store.buffers[torch.float32]
    assert f32.numel() == 16 + 4 + 8 + 2 and store.buffers[torch.bfloat16].numel() == 10
    assert store.nbytes() == f32.numel() * 4 + 10 * 2
    base = f32.untyped_storage().data_ptr()
    offsets = {n: (p.data_ptr() - base) // 4 for n, p in model.named_parameters() if p.dtype == torch.float32}
    # the wire order: a layer's weights, then its biases
    assert offsets == {"layers.0.q.weight": 0, "layers.0.o.weight": 16, "layers.0.q.bias": 24, "layers.0.o.bias": 28}
    with torch.no_grad():
        model.layers[0].o.weight.fill_(2.0)
    assert torch.equal(f32[16:24], torch.full((8,), 2.0)) and f32[:16].eq(0).all()  # a parameter writes its buffer


def test_the_shadow_takes_an_update_and_becomes_live_only_at_commit():
    model, store = _storage()
    q, head = model.layers[0].q, model.head
    with torch.no_grad():
        q.weight.fill_(1.0)
        head.weight.fill_(3.0)
    store.prepare_shadow()
    store.shadow_view(q.weight).fill_(7.0)
    assert q.weight.eq(1.0).all()  # live untouched until the commit
    last = model.layers[0].o.bias  # the buffer's last 2 floats
    raw = store.shadow_bytes(last, 8)
    assert raw is not None and raw.numel() == 8 and store.shadow_bytes(last, 9) is None  # past the end
    store.commit_shadow()
    assert q.weight.eq(7.0).all() and head.weight.eq(3.0).all()  # the prepared rest carried over


@pytest.mark.parametrize("backup", [True, False])
def test_release_frees_every_buffer_and_resume_brings_back_the_backup_or_invalid_zeros(backup):
    model, store = _storage()
    o = model.layers[0].o
    with torch.no_grad():
        o.weight.fill_(5.0)
    freed = store.release(backup=backup)
    assert freed == store.nbytes() and store.released
    assert all(b.untyped_storage().nbytes() == 0 for b in store.buffers.values())
    assert store.release(backup=backup) == 0  # twice: nothing more to free
    store.resume()
    assert not store.released and store.valid is backup
    assert o.weight.eq(5.0 if backup else 0.0).all()  # the same parameter objects, storage regrown


def test_kv_pool_is_one_buffer_with_a_scratch_block_and_copies_blocks_in_every_layer():
    pool = KvPool(num_layers=3, num_blocks=4, block_size=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16,
                  device=torch.device("cpu"))
    assert pool.buffer.shape == (3, 2, 5, 2, 2, 8) and pool.scratch_block == 4 and pool.max_total_num_tokens == 8
    assert pool.nbytes() == 3 * 2 * 5 * 2 * 2 * 8 * 2 == kv_bytes_per_token(3, 2, 8, torch.bfloat16) * 5 * 2
    k1, v1 = pool.caches[1]
    assert k1.data_ptr() == pool.buffer[1, 0].data_ptr() and v1.shape == (5, 2, 2, 8)
    for layer, (k, v) in enumerate(pool.caches):
        k[0].fill_(layer + 1)
        v[0].fill_(-(layer + 1))
    pool.copy_blocks([(0, 3)])
    for layer, (k, v) in enumerate(pool.caches):
        assert k[3].eq(layer + 1).all() and v[3].eq(-(layer + 1)).all() and k[2].eq(0).all()
    assert pool.release() == pool.nbytes() and pool.buffer.untyped_storage().nbytes() == 0 and pool.release() == 0
    pool.resume()
    assert not pool.released and pool.buffer.eq(0).all()  # regrown zeroed: padding reads no NaN


def test_kv_blocks_are_sized_from_tokens_or_from_free_memory_within_the_bound():
    per_token = kv_bytes_per_token(2, 1, 4, torch.float32)
    assert per_token == 2 * 2 * 1 * 4 * 4
    assert num_kv_blocks(33, 16, per_token, torch.device("cpu"), 0.5, 10**9) == 3  # rounded up to whole blocks
    assert num_kv_blocks(1, 16, per_token, torch.device("cpu"), 0.5, 10**9) == 2  # at least two
    assert num_kv_blocks(None, 16, per_token, torch.device("cpu"), 0.5, 64) == 4  # free memory, capped by the bound
