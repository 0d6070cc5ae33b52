"""A pool of fixed-size K/V blocks: which block ids are free. Knows nothing about sequences.

Allocation takes the lowest free ids (a heap), so a sequence running alone keeps consecutive
blocks even through rollbacks (a truncated block is the next one handed out); the runner then
reads its K/V as one slice of the cache instead of gathering slot by slot.
"""
from __future__ import annotations

import heapq


class OutOfBlocks(RuntimeError):
    """The pool cannot satisfy an allocation; the scheduler answers by preempting."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks))  # a heap

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        return [heapq.heappop(self._free) for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            heapq.heappush(self._free, b)
