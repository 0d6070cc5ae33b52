"""Prefix caching: full blocks of committed tokens are found again by their content.

Block i of a sequence is keyed by (key of block i-1, its block_size token ids): a chain, so a
block matches only after the same whole prefix. Only blocks whose every position holds K/V of a
committed token (`num_computed` covers the block) are registered, so a block holding unverified
proposals is never hashed or shared; shared blocks are never written again (a sequence writes
only at positions >= its num_computed, and a match ends on a block boundary). The dictionary
compares the token ids themselves, not only a hash: a collision cannot share a wrong block.

`match` (at admission): the longest cached prefix of a sequence's tokens, at most all but the
last token (the last one must be fed to get logits), whole blocks only. `register` (after each
step): the sequence's newly completed committed blocks. Unused cached blocks stay in the pool's
LRU list until evicted (block_pool.py). Hit statistics: tokens looked up and tokens matched.
"""
from __future__ import annotations

from .block_pool import BlockPool


class PrefixCache:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        # (parent's id, the block's token ids) -> (block, this prefix's id); id 0 = the empty prefix
        self._blocks: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}
        self._ids: dict[int, list[int]] = {}  # seq_id -> prefix ids of its cached blocks, in order
        self._next_id = 1
        self.queried_tokens = 0
        self.hit_tokens = 0
        pool.on_evict = self._evicted

    def _evicted(self, block: int, key: tuple) -> None:
        if self._blocks.get(key, (None,))[0] == block:
            del self._blocks[key]

    def match(self, seq_id: int, tokens: list[int]) -> list[int]:
        """Cached blocks for the longest prefix of `tokens` (all but the last token at most); each
        is shared (its reference count raised). The caller puts them first in the table."""
        bs = self.block_size
        self.queried_tokens += len(tokens)
        blocks, ids, parent = [], [], 0
        for i in range((len(tokens) - 1) // bs):
            entry = self._blocks.get((parent, tuple(tokens[i * bs : (i + 1) * bs])))
            if entry is None:
                break
            block, parent = entry
            self.pool.share(block)
            blocks.append(block)
            ids.append(parent)
        self._ids[seq_id] = ids
        self.hit_tokens += len(blocks) * bs
        return blocks

    def register(self, seq_id: int, table: list[int], tokens: list[int], num_computed: int) -> None:
        """Cache the sequence's blocks that lie wholly within its first `num_computed` positions."""
        bs = self.block_size
        ids = self._ids.setdefault(seq_id, [])
        parent = ids[-1] if ids else 0
        for i in range(len(ids), min(num_computed // bs, len(table))):
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
            entry = self._blocks.get(key)
            if entry is None:  # new content: this block is its cached copy
                entry = (table[i], self._next_id)
                self._next_id += 1
                self._blocks[key] = entry
                self.pool.cache_key[table[i]] = key
            parent = entry[1]
            ids.append(parent)

    def num_registered(self, seq_id: int) -> int:
        return len(self._ids.get(seq_id, ()))

    def forget(self, seq_id: int) -> None:
        """The sequence left (finished or preempted); its cached blocks stay cached."""
        self._ids.pop(seq_id, None)
