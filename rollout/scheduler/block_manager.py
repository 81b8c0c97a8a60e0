"""KV block accounting: allocation, reference counts, prefix sharing and the prefix cache.

CPU-only bookkeeping; the KV tensors live in the model runner. A block is shared by bumping its
reference count (the ``n`` samples of a prompt share its full blocks). Full prompt blocks are
registered under a chained hash of (parent hash, block tokens, weight version): a later request
with the same prefix under the same weights reuses them, and KV computed under other weights is
never matched. Unreferenced cached blocks stay matchable until evicted in LRU order.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Optional


@dataclass
class PrefixCacheStats:
    num_queries: int = 0  # prompt tokens looked up
    num_hit_tokens: int = 0  # prompt tokens served from the cache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[Optional[int]] = [None] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with refcount 0, LRU first
        self.stats = PrefixCacheStats()

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    def block_hashes(self, token_ids: list[int], num_blocks: int, version: str) -> list[int]:
        hashes, parent = [], hash(("kv", version))
        bs = self.block_size
        for i in range(num_blocks):
            parent = hash((parent, tuple(token_ids[i * bs:(i + 1) * bs])))
            hashes.append(parent)
        return hashes

    def match_prefix(self, token_ids: list[int], max_tokens: int, version: str) -> list[int]:
        """Reference and return the cached blocks covering the longest prefix of ``max_tokens``."""
        self.stats.num_queries += len(token_ids)
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for h in self.block_hashes(token_ids, max_tokens // self.block_size, version):
            b = self.cached.get(h)
            if b is None:
                break
            self._ref(b)
            blocks.append(b)
        self.stats.num_hit_tokens += len(blocks) * self.block_size
        return blocks

    def allocate(self, n: int) -> Optional[list[int]]:
        if n > self.num_free_blocks:
            return None
        out = []
        for _ in range(n):
            if self.free_blocks:
                b = self.free_blocks.popleft()
            else:
                b, _ = self.evictable.popitem(last=False)
                del self.cached[self.block_hash[b]]
                self.block_hash[b] = None
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def _ref(self, b: int) -> None:
        if self.ref_counts[b] == 0:
            self.evictable.pop(b, None)
        self.ref_counts[b] += 1

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            self._ref(b)

    def free(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # tail blocks are evicted first
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0, f"block {b} freed twice"
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is not None:
                    self.evictable[b] = None
                else:
                    self.free_blocks.append(b)

    def register(self, block: int, h: int) -> None:
        """Make a full, computed block matchable under hash ``h``."""
        if not self.enable_prefix_caching or self.block_hash[block] is not None or h in self.cached:
            return
        self.block_hash[block] = h
        self.cached[h] = block

    def flush(self) -> None:
        """Forget every cached prefix (blocks in use stay allocated)."""
        for b in list(self.cached.values()):
            self.block_hash[b] = None
            if self.ref_counts[b] == 0:
                self.evictable.pop(b, None)
                self.free_blocks.append(b)
        self.cached.clear()
