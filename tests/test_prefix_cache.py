"""Prefix caching: full blocks of committed tokens shared between requests, by content.

Unit tier (pool reference counts, LRU eviction, the key chain, never a block beyond the committed
positions) and the engine: greedy outputs identical with and without the cache, under preemption
and speculation; a shared prefix is not prefilled again; every block free at the end.
"""
import pytest

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.kv import BlockPool, KVManager


def test_pool_shares_and_evicts_cached_blocks_last():
    pool = BlockPool(4, 2)
    a, b = pool.allocate(2)
    pool.cache_key[a] = "key-a"
    pool.share(a)
    pool.free([a])
    assert pool.num_free == 2  # a still held once
    pool.free([a, b])
    assert pool.num_free == 4 and pool.num_cached == 1  # a: free but cached (evictable)
    evicted = []
    pool.on_evict = lambda blk, key: evicted.append((blk, key))
    assert pool.allocate(3) == [1, 2, 3]  # uncached blocks first
    assert not evicted
    assert pool.allocate(1) == [a] and evicted == [(a, "key-a")] and pool.num_cached == 0


def test_match_follows_the_whole_chain_and_register_stops_at_committed():
    kv = KVManager(16, 4, prefix_caching=True)
    tokens = list(range(100, 114))  # 14 tokens: blocks [0:4] [4:8] [8:12] + 2
    kv.reserve(1, 14)
    kv.cache_committed(1, lambda: tokens, 9)  # positions 0..8 committed: two whole blocks
    assert kv.prefix_cache.num_registered(1) == 2
    assert kv.match_prefix(2, tokens) == 8  # the third block was never registered
    assert kv.tables[2] == kv.tables[1][:2]
    assert kv.match_prefix(3, tokens[:4] + [0] + tokens[5:]) == 4  # a change in block 2: one block
    assert kv.match_prefix(4, [7] + tokens[1:]) == 0  # a change in block 1: nothing (the chain)
    assert kv.match_prefix(5, tokens[:8]) == 4  # at most all but the last token
    for sid in (1, 2, 3, 4, 5):
        kv.free(sid)
    assert kv.pool.num_free == 16
    assert kv.prefix_cache.hit_tokens == 8 + 4 + 4


def test_off_by_default_in_the_kv_manager():
    kv = KVManager(8, 4)
    kv.reserve(1, 8)
    kv.cache_committed(1, lambda: list(range(8)), 8)
    assert kv.match_prefix(2, list(range(9))) == 0 and kv.prefix_cache is None


PREFIX = [(7 * i) % 97 + 5 for i in range(70)]  # a long shared prefix (several 16-token blocks)


@pytest.mark.parametrize("method", [None, "draft"])
def test_greedy_outputs_identical_with_and_without_the_cache(target_dir, draft_dir, method):
    prompts = [PREFIX + [20 + i, 3, 4] for i in range(6)] + [PREFIX[:40] + [9]]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    kw = dict(draft=str(draft_dir), spec=SpecConfig(method=method, k=3)) if method else {}
    off = LLM(str(target_dir), enable_prefix_caching=False, **kw)
    on = LLM(str(target_dir), **kw)
    want = [o.token_ids for o in off.generate(prompts, sp)]
    assert [o.token_ids for o in on.generate(prompts[:1], sp)] == want[:1]  # fills the cache
    got = [o.token_ids for o in on.generate(prompts, sp)]
    assert got == want
    st = on.engine.stats
    assert st.prefix_cache_hit_tokens >= 6 * 64  # the shared 64 tokens of blocks found each time
    assert on.engine.occupancy()["kv"]["target"]["used"] == 0


def test_a_cached_prefix_is_not_prefilled_again(target_dir):
    llm = LLM(str(target_dir))
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([PREFIX + [1, 2]], sp)
    eng = llm.engine
    seq = eng.add_request("again", PREFIX + [3, 4], sp)
    sched = eng.scheduler.schedule()
    assert sched.scheduled[0].num_new_tokens == len(PREFIX) + 2 - 64  # 4 blocks of 16 were cached
    eng.scheduler.finish(seq)


def test_preemption_with_shared_blocks_keeps_outputs(target_dir):
    prompts = [PREFIX + [20 + i] for i in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(target_dir), enable_prefix_caching=False).generate(prompts, sp)]
    tight = LLM(str(target_dir), num_kv_blocks=24)  # 8 x 110 tokens do not fit: preemptions
    got = [o.token_ids for o in tight.generate(prompts, sp)]
    assert got == want
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.runner.kv.pool.num_free == 24


def _fed_tokens(llm) -> list[int]:
    """Spy on the drafter's forwards: the tokens fed in each call go into the returned list."""
    fed, run = [], llm.engine.proposer.runner.run

    def spy(seq_ids, feeds, *a, **k):
        fed.append(sum(len(f) for f in feeds))
        return run(seq_ids, feeds, *a, **k)

    llm.engine.proposer.runner.run = spy
    llm.engine.proposer.fused_steps = False  # every drafter forward through run
    return fed


def test_the_drafter_finds_a_cached_prefix_too(target_dir, draft_dir):
    """A prompt whose prefix the drafter's cache holds is not fed to the drafter again."""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    counts = {}
    for caching in (False, True):
        llm = LLM(str(target_dir), draft=str(draft_dir), spec=SpecConfig(method="draft", k=3),
                  enable_prefix_caching=caching)
        llm.generate([PREFIX + [1, 2]], sp)
        fed = _fed_tokens(llm)
        out = llm.generate([PREFIX + [3, 4]], sp)[0].token_ids
        counts[caching] = (sum(fed), out)
        assert llm.engine.occupancy()["kv"]["draft"]["used"] == 0
    assert counts[True][1] == counts[False][1]
    assert counts[False][0] - counts[True][0] == 64  # the 4 cached blocks of 16 prompt tokens
    assert llm.engine.proposer.kv.prefix_cache.hit_tokens >= 64
    # reported beside the target's (stats, the lab's metrics, /metrics read the same keys)
    st = llm.engine.stats.snapshot()
    assert st["draft_prefix_cache_hit_tokens"] == llm.engine.proposer.kv.prefix_cache.hit_tokens >= 64
    assert st["draft_prefix_cache_queried_tokens"] >= st["draft_prefix_cache_hit_tokens"] + 2


def test_the_drafter_caches_committed_blocks_only(target_dir, draft_dir):
    """After every step, the drafter's registered blocks hold committed tokens its cache computed:
    never a block holding proposals (accepted or not) beyond them."""
    llm = LLM(str(target_dir), draft=str(draft_dir), spec=SpecConfig(method="draft", k=4))
    eng = llm.engine
    pc = eng.proposer.kv.prefix_cache
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    seqs = [eng.add_request(f"r{i}", PREFIX[: 30 + 7 * i] + [i + 1], sp) for i in range(3)]
    by_id = {}  # prefix id -> its key (parent id, the block's token ids), as registered
    checked = 0
    while eng.has_unfinished():
        eng.step()
        by_id.update({pid: key for key, (_, pid) in pc._blocks.items()})
        for seq in seqs:
            ids = pc._ids.get(seq.seq_id, [])
            assert len(ids) * 16 <= seq.draft_computed <= seq.num_tokens
            got = [t for pid in ids for t in by_id[pid][1]]
            assert got == seq.all_ids[: len(got)]
            checked += len(ids)
    assert checked > 0
    assert sum(s.stats.proposed_tokens - s.stats.accepted_tokens for s in seqs) > 0  # rejections happened
