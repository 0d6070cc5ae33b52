"""A pool of fixed-size K/V blocks: which block ids are free, shared, or cached. Knows nothing
about sequences.

Allocation takes the lowest free ids (a heap), so a sequence running alone keeps consecutive
blocks even through rollbacks (a truncated block is the next one handed out); the runner then
reads its K/V as one slice of the cache instead of gathering slot by slot.

Prefix caching (prefix_cache.py) adds two things here: reference counts (a full block of
committed prompt tokens may sit in several sequences' tables: `share`), and cached blocks whose
last user freed them: they keep their K/V and their key (`cache_key`) in an LRU list, count as
free, and are evicted (their key dropped) only when the free heap is empty.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict


class OutOfBlocks(RuntimeError):
    """The pool cannot satisfy an allocation; the scheduler answers by preempting."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks))  # a heap
        self._refs: dict[int, int] = {}  # block -> tables holding it (blocks in use only)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unused blocks, least recent first
        self.cache_key: dict[int, object] = {}  # block -> the key it is cached under (PrefixCache)
        self.on_evict = None  # callable(block, key): the prefix cache forgets the block

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a cached prefix (in use or evictable)."""
        return len(self.cache_key)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = heapq.heappop(self._free)
            else:  # evict the least recently used cached block
                b, _ = self._evictable.popitem(last=False)
                key = self.cache_key.pop(b)
                if self.on_evict is not None:
                    self.on_evict(b, key)
            self._refs[b] = 1
            out.append(b)
        return out

    def share(self, block: int) -> None:
        """One more table holds `block` (a cached block found by its key)."""
        if block in self._evictable:
            del self._evictable[block]
            self._refs[block] = 1
        else:
            self._refs[block] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            n = self._refs.get(b, 1) - 1
            if n > 0:
                self._refs[b] = n
                continue
            self._refs.pop(b, None)
            if b in self.cache_key:
                self._evictable[b] = None  # most recently used last
            else:
                heapq.heappush(self._free, b)
