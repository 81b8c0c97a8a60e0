"""``KvPool``: one rank's paged KV cache, one buffer for every layer.

``[layers, 2 (k, v), num_blocks + 1, block_size, kv_heads, head_dim]``: the last block is a scratch
block past the pool (padding rows of CUDA graphs write there, never a sequence's). Each layer's
``(k, v)`` are views of the one buffer, so releasing the buffer's storage frees the whole cache
and resuming regrows it under the same tensor objects.
"""

from __future__ import annotations

from typing import Optional

import torch


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V of one token over every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def num_kv_blocks(tokens: Optional[int], block_size: int, bytes_per_token: int, device: torch.device,
                  memory_fraction: float, max_tokens: int) -> int:
    """Blocks for ``tokens`` of KV, or (None) for ``memory_fraction`` of the device's free memory,
    at most ``max_tokens``; at least two blocks."""
    if tokens is None:
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
        else:
            import psutil

            free = psutil.virtual_memory().available
        tokens = min(int(free * memory_fraction) // bytes_per_token, max_tokens)
    return max(2, -(-tokens // block_size))


def kv_tokens_for_utilization(device: torch.device, utilization: float, bytes_per_token: int,
                              reserve_bytes: int) -> int:
    """CUDA: the KV tokens that fit in ``utilization`` of the device's memory once what is allocated now
    (weights, by this and any other process) and ``reserve_bytes`` (activations, graphs) are counted; at least
    one block's worth is left to the caller's minimum."""
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * utilization) - (total - free) - reserve_bytes
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization}: {total * utilization / 2**30:.1f} GiB of this "
                         f"{total / 2**30:.1f} GiB device leave no room for a KV cache: {(total - free) / 2**30:.1f} "
                         f"GiB are in use and {reserve_bytes / 2**30:.1f} GiB are kept for activations; raise it "
                         "or set kv_cache_tokens")
    return budget // bytes_per_token


class KvPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, top_k: int = 0):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_block = num_blocks  # one block past the pool
        self.buffer = torch.zeros(num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim, dtype=dtype,
                                  device=device)
        self.caches = [(self.buffer[i, 0], self.buffer[i, 1]) for i in range(num_layers)]
        # top_k > 0 (enable_return_routed_experts): each slot's routed experts per layer, beside its K/V
        # (rollout.layers.moe.RoutingRecord); copied with the blocks, kept when the K/V storage is released
        self.experts = torch.zeros((num_blocks + 1) * block_size, num_layers, top_k, dtype=torch.int32,
                                   device=device) if top_k else None
        self.released = False

    @property
    def max_total_num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy block ``src`` to ``dst`` in every layer, for each ``(src, dst)`` (copy-on-write forks)."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=self.buffer.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=self.buffer.device)
        self.buffer.index_copy_(2, dst, self.buffer.index_select(2, src))
        if self.experts is not None:
            rows = self.experts.view(self.num_blocks + 1, self.block_size, *self.experts.shape[1:])
            rows.index_copy_(0, dst, rows.index_select(0, src))

    def release(self) -> int:
        """Return the buffer's storage; the bytes freed (0 if it was released already)."""
        if self.released:
            return 0
        freed = self.nbytes()
        self.buffer.untyped_storage().resize_(0)
        self.released = True
        return freed

    def resume(self) -> None:
        """Regrow the storage, zeroed (masked attention multiplies padding by 0: it must hold no NaN)."""
        if not self.released:
            return
        self.buffer.untyped_storage().resize_(self.nbytes())
        self.buffer.zero_()
        self.released = False
