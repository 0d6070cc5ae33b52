"""Block tables for one model's paged K/V cache.

Each sequence owns a list of block ids; token position `i` lives in slot
`table[i // block_size] * block_size + i % block_size` of the flat cache tensor.
Capacity grows by `reserve` before a forward (the lookahead slots for K proposals plus one) and
shrinks by `truncate` after verification, which frees only blocks that became empty. Rolling
back rejected proposals is therefore bookkeeping: the stale K/V stays in place, is never attended
(positions beyond the committed length are masked) and is overwritten later.

With `prefix_caching`, `match_prefix` starts a new sequence's table with the cached blocks of its
longest cached prefix and `cache_committed` registers its completed committed blocks
(prefix_cache.py); freeing a shared block only drops a reference.
"""
from __future__ import annotations

import torch

from .block_pool import BlockPool
from .prefix_cache import PrefixCache


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.tables: dict[int, list[int]] = {}
        self.prefix_cache = PrefixCache(self.pool) if prefix_caching else None
        self.free_hooks: list = []  # called with the seq_id when a sequence's blocks are freed
        self._offsets = torch.arange(block_size)  # a block's slot offsets, for `slots`
        self._rows: dict[int, tuple[list[int], torch.Tensor]] = {}  # seq_id -> (its blocks, their slots)
        # the last batch's slots: (seq_ids, blocks wide, `_epoch` then, their tables, [B, blocks * block_size])
        self._matrix: tuple[list[int], int, int, list[list[int]], torch.Tensor] | None = None
        self._epoch = 0  # counts changes to any table (`_slot_matrix` reuses its matrix while it stays)

    def match_prefix(self, seq_id: int, tokens: list[int]) -> int:
        """A new sequence (no table yet): share the cached blocks of its longest cached prefix.
        Returns the positions whose K/V are thereby valid (0 without prefix caching)."""
        if self.prefix_cache is None or seq_id in self.tables:
            return 0
        blocks = self.prefix_cache.match(seq_id, tokens)
        if blocks:
            self.tables[seq_id] = blocks
            self._epoch += 1
        return len(blocks) * self.block_size

    def cache_committed(self, seq_id: int, tokens, num_computed: int) -> None:
        """Register the sequence's blocks wholly within its first num_computed (committed)
        positions; `tokens` is a callable giving its token ids, called only when a block is new."""
        table = self.tables.get(seq_id)
        pc = self.prefix_cache
        if pc is not None and table and num_computed // self.block_size > pc.num_registered(seq_id):
            pc.register(seq_id, table, tokens(), num_computed)

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        have = len(self.tables.get(seq_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_reserve(self, seq_id: int, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= self.pool.num_free

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Make room for positions [0, num_tokens). Raises OutOfBlocks (and allocates nothing)."""
        n = self.blocks_needed(seq_id, num_tokens)
        if n:
            self.tables.setdefault(seq_id, []).extend(self.pool.allocate(n))
            self._epoch += 1

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep positions [0, num_tokens); free blocks that hold none of them."""
        table = self.tables.get(seq_id)
        if table is None:
            return
        keep = -(-num_tokens // self.block_size)
        if keep < len(table):
            self.pool.free(table[keep:])
            del table[keep:]
            self._epoch += 1

    def free(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)
        table = self.tables.pop(seq_id, None)
        self._epoch += 1
        if table:
            self.pool.free(table)
        if self.prefix_cache is not None:
            self.prefix_cache.forget(seq_id)
        for hook in self.free_hooks:  # e.g. a hybrid model's recurrent state slot
            hook(seq_id)

    def contiguous_start(self, seq_id: int, length: int) -> int | None:
        """First slot of `seq_id` if its positions 0..length-1 lie on consecutive slots, else None."""
        t = self.tables.get(seq_id)
        nb = -(-length // self.block_size)
        if not t or nb > len(t):
            return None
        first = t[0]
        for i in range(1, nb):
            if t[i] != first + i:
                return None
        return first * self.block_size

    def slots(self, seq_ids: list[int], lengths: list[int], device="cpu") -> torch.Tensor:
        """Slot of every position 0..L-1 of each sequence: `[B, max(lengths)]` (padding -> 0).
        Several sequences: a view of the first L columns of a matrix kept while the same
        sequences' tables stay the same (its rows `SLOT_COLUMNS_STEP` blocks wide: a decode step
        adds one position; never written once returned, a changed table gets a new matrix)."""
        L = max(lengths) if lengths else 0
        nb = -(-L // self.block_size)
        if not seq_ids:
            return torch.zeros(0, 0, dtype=torch.long, device=device)
        if len(seq_ids) == 1:
            slots = self._slot_row(seq_ids[0], nb)[None, :L]
        else:
            slots = self._slot_matrix(seq_ids, nb)[:, :L]
        return slots if str(device) == "cpu" else slots.to(device)

    SLOT_COLUMNS_STEP = 4  # blocks: the batch matrix's width grows in these steps

    def _slot_matrix(self, seq_ids: list[int], nb: int) -> torch.Tensor:
        """`[B, nbc * block_size]` slots of the sequences' first nbc >= nb blocks (nbc a multiple of
        SLOT_COLUMNS_STEP; missing blocks -> slot 0). Kept between calls: at 8 decoding rows,
        building it afresh each step (a row per sequence, stacked) was ~70 us of a ~6 ms step,
        ~110 with the rows' lengths out of step (each row's new block at another step). Reused
        while the same sequences' tables are unchanged: no table of this manager changed since
        (`_epoch`), or, where some did, the tables it was built from compare equal."""
        nbc = -(-max(nb, 1) // self.SLOT_COLUMNS_STEP) * self.SLOT_COLUMNS_STEP
        hit = self._matrix
        tables = None
        if hit is not None and hit[1] == nbc and hit[0] == seq_ids:
            if hit[2] == self._epoch:
                return hit[4]
            tables = [self.tables.get(sid, [])[:nbc] for sid in seq_ids]
            if tables == hit[3]:
                self._matrix = (hit[0], nbc, self._epoch, tables, hit[4])
                return hit[4]
            # some rows' blocks changed (a decode step's new block: one per row, at most): a copy
            # with those blocks' slots written (a caller may still hold the last matrix)
            m, bs = hit[4].clone(), self.block_size
            for i, (t, old) in enumerate(zip(tables, hit[3])):
                if t == old:
                    continue
                for j in range(max(len(t), len(old))):
                    b = t[j] if j < len(t) else None
                    if j < len(old) and b == old[j]:
                        continue
                    if b is None:
                        m[i, j * bs : (j + 1) * bs] = 0
                    else:
                        m[i, j * bs : (j + 1) * bs] = self._offsets + b * bs
        else:
            tables = [self.tables.get(sid, [])[:nbc] for sid in seq_ids]
            m = self._expand(tables, nbc)
        self._matrix = (list(seq_ids), nbc, self._epoch, tables, m)
        return m

    def _slot_row(self, seq_id: int, nb: int) -> torch.Tensor:
        """The slots of a sequence's first nb blocks ([nb * block_size]; missing blocks -> slot 0),
        kept while its table's first nb blocks stay the same (a decode step adds one position to
        the same blocks: ~40 us a step to rebuild, ~1 to compare)."""
        t = self.tables.get(seq_id, [])[:nb]
        hit = self._rows.get(seq_id)
        if hit is not None and hit[0] == t and hit[1].numel() == nb * self.block_size:
            return hit[1]
        row = self._expand([t], nb)[0]
        self._rows[seq_id] = (t, row)
        return row

    def _expand(self, tables: list[list[int]], nb: int) -> torch.Tensor:
        """`[len(tables), nb * block_size]`: each table's first nb blocks as slots (missing -> 0)."""
        tab = torch.tensor([t + [0] * (nb - len(t)) for t in tables], dtype=torch.long)  # [B, nb]
        return (tab[:, :, None] * self.block_size + self._offsets).reshape(len(tables), -1)
