"""Unit tier for the paged K/V bookkeeping: `BlockPool` (free ids) and `KVManager` (block tables).

No tensors of K/V here: reserve (lookahead), truncate (rollback frees only emptied blocks), block
reuse, consecutive slots for a lone sequence, and the slot map the attention reads.
"""
import pytest
import torch

from draftwise.kv import BlockPool, KVManager, OutOfBlocks


def test_pool_hands_out_the_lowest_free_ids():
    pool = BlockPool(6, 4)
    assert pool.allocate(3) == [0, 1, 2]
    pool.free([1])
    assert pool.allocate(2) == [1, 3]  # the freed id first, then the next never used
    assert (pool.num_free, pool.num_used) == (2, 4)


def test_pool_out_of_blocks_allocates_nothing():
    pool = BlockPool(3, 4)
    pool.allocate(2)
    with pytest.raises(OutOfBlocks, match="need 2 blocks, 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    assert pool.allocate(1) == [2]


@pytest.mark.parametrize("blocks, size", [(0, 4), (4, 0)])
def test_pool_rejects_empty_shapes(blocks, size):
    with pytest.raises(ValueError):
        BlockPool(blocks, size)


def test_blocks_needed_rounds_up_and_counts_what_is_held():
    kv = KVManager(8, 4)
    assert [kv.blocks_needed(0, n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    kv.reserve(0, 6)
    assert [kv.blocks_needed(0, n) for n in (0, 6, 8, 9, 13)] == [0, 0, 0, 1, 2]


def test_reserve_grows_and_never_shrinks():
    kv = KVManager(8, 4)
    kv.reserve(0, 0)
    assert 0 not in kv.tables  # nothing to hold: no table
    kv.reserve(0, 5)
    assert kv.tables[0] == [0, 1]
    kv.reserve(0, 3)  # fewer positions than held: reserve is not truncate
    assert kv.tables[0] == [0, 1]
    kv.reserve(0, 8)
    assert kv.tables[0] == [0, 1]
    kv.reserve(0, 9)
    assert kv.tables[0] == [0, 1, 2]


def test_can_reserve_at_the_edge_and_a_failed_reserve_changes_nothing():
    kv = KVManager(4, 4)
    kv.reserve(0, 4)  # 1 block held, 3 free
    assert kv.can_reserve(0, 16)  # 3 more blocks: exactly what is free
    assert not kv.can_reserve(0, 17)
    assert kv.can_reserve(1, 12) and not kv.can_reserve(1, 13)  # a new sequence holds nothing yet
    with pytest.raises(OutOfBlocks):
        kv.reserve(0, 17)
    assert kv.tables[0] == [0] and kv.pool.num_free == 3
    kv.reserve(0, 16)
    assert kv.tables[0] == [0, 1, 2, 3] and kv.pool.num_free == 0
    assert kv.can_reserve(0, 16) and kv.can_reserve(1, 0) and not kv.can_reserve(1, 1)


def test_truncate_frees_a_block_only_when_it_becomes_empty():
    kv = KVManager(8, 4)
    kv.reserve(0, 12)  # blocks 0, 1, 2: positions 0-3, 4-7, 8-11
    kept = []
    for n in (12, 9, 8, 5, 4, 1, 0):
        kv.truncate(0, n)
        kept.append(list(kv.tables[0]))
    assert kept == [[0, 1, 2], [0, 1, 2], [0, 1], [0, 1], [0], [0], []]
    assert kv.pool.num_free == 8
    kv.truncate(42, 3)  # an unknown sequence: nothing to do
    assert kv.pool.num_free == 8


def test_a_rolled_back_block_is_the_next_one_handed_out():
    """Rollback then growth: the lone sequence gets its own block back and stays consecutive."""
    kv = KVManager(8, 4)
    kv.reserve(0, 12)
    kv.truncate(0, 5)  # block 2 emptied and freed
    assert kv.pool.num_free == 6
    kv.reserve(0, 12)
    assert kv.tables[0] == [0, 1, 2]
    assert kv.contiguous_start(0, 12) == 0


def test_free_returns_every_block_for_reuse():
    kv = KVManager(4, 4)
    kv.reserve(0, 8)
    kv.reserve(1, 8)
    kv.free(0)
    assert 0 not in kv.tables and kv.pool.num_free == 2
    kv.reserve(2, 8)
    assert kv.tables[2] == [0, 1]
    kv.free(0)  # twice, or never reserved: no error, nothing freed twice
    assert kv.pool.num_free == 0


def test_contiguous_start_for_a_lone_sequence_only():
    kv = KVManager(8, 4)
    assert kv.contiguous_start(0, 1) is None  # no table
    kv.reserve(0, 4)  # block 0
    kv.reserve(1, 4)  # block 1
    kv.reserve(0, 8)  # block 2: sequence 0 now holds [0, 2]
    assert kv.contiguous_start(0, 4) == 0  # its first block alone is consecutive
    assert kv.contiguous_start(0, 5) is None  # positions 4.. sit in block 2, not 1
    assert kv.contiguous_start(1, 4) == 4  # the first slot of block 1
    assert kv.contiguous_start(1, 5) is None  # more positions than its table holds
    kv.reserve(3, 10)
    assert kv.tables[3] == [3, 4, 5] and kv.contiguous_start(3, 10) == 12


def test_slots_follow_the_block_tables():
    kv = KVManager(8, 4)
    kv.reserve(0, 4)
    kv.reserve(1, 3)
    kv.reserve(0, 6)  # sequence 0: blocks [0, 2]; sequence 1: [1]
    slots = kv.slots([0, 1], [6, 3])  # [B, max(lengths)]; a shorter row's tail is padding (never read)
    assert tuple(slots.shape) == (2, 6)
    assert slots[0].tolist() == [0, 1, 2, 3, 8, 9]
    assert slots[1, :3].tolist() == [4, 5, 6]
    assert kv.slots([1], [2]).tolist() == [[4, 5]]
    assert tuple(kv.slots([], []).shape) == (0, 0)


def test_slots_stay_true_as_the_tables_change():
    """`slots` keeps a sequence's slots while its first blocks stay the same: growing, rolled back,
    freed and reused tables still give the slots of their current blocks."""
    kv = KVManager(16, 4)
    kv.reserve(0, 5)  # blocks [0, 1]
    assert kv.slots([0], [5]).tolist() == [[0, 1, 2, 3, 4]]
    assert kv.slots([0], [6]).tolist() == [[0, 1, 2, 3, 4, 5]]  # one more position, the same blocks
    kv.reserve(1, 4)  # block 2
    kv.reserve(0, 9)  # a third block, 3
    assert kv.slots([0], [9]).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 12]]
    kv.truncate(0, 4)
    kv.reserve(2, 4)
    kv.reserve(0, 9)  # rolled back and grown again: its later blocks may differ
    want = [b * 4 + i for b in kv.tables[0] for i in range(4)][:9]
    assert kv.slots([0], [9]).tolist() == [want]
    kv.free(0)
    kv.reserve(0, 3)  # a new sequence with the same id
    assert kv.slots([0], [3]).tolist() == [[kv.tables[0][0] * 4 + i for i in range(3)]]
    assert kv.slots([1, 0], [4, 3])[0].tolist() == [8, 9, 10, 11]


def test_batch_slots_match_the_tables_through_random_changes():
    """The batch matrix `slots` keeps between calls (rows written where a table changed) gives,
    after any sequence of reserve / truncate / free, every position's slot from the current
    tables, and a matrix returned earlier is never written afterwards."""
    import random

    rng = random.Random(0)
    kv = KVManager(64, 4)
    lengths = {sid: 0 for sid in range(5)}
    held = []
    for step in range(400):
        sid = rng.randrange(5)
        op = rng.random()
        if op < 0.55:
            lengths[sid] += rng.choice([1, 1, 1, 3, 5])
            kv.reserve(sid, lengths[sid])
        elif op < 0.85:
            lengths[sid] = max(0, lengths[sid] - rng.randrange(6))
            kv.truncate(sid, lengths[sid])
        elif op < 0.9:
            kv.free(sid)
            lengths[sid] = 0
        ids = [s for s in range(5) if lengths[s] > 0][: rng.randint(2, 5)]
        if len(ids) < 2:
            continue
        ends = [lengths[s] for s in ids]
        got = kv.slots(ids, ends)
        for row, s, n in zip(got.tolist(), ids, ends):
            want = [kv.tables[s][p // 4] * 4 + p % 4 for p in range(n)]
            assert row[:n] == want
        held.append((got, got.clone()))
    assert held and all(torch.equal(a, b) for a, b in held)
