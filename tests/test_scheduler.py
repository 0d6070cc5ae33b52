"""Unit tier for `Scheduler`: token budget, chunked prefill, proposals per sequence, preemption.

Sequences and SamplingParams are built by hand and no model runs: `step` plays the engine's
postprocess (a chunk advances `num_computed`; a step that reaches the last token commits the
accepted proposals plus one token, then rolls back to `len(all_ids) - 1` and truncates the
target's table), so every figure below can be followed by hand.
"""
import pytest

from draftwise.engine.scheduler import Scheduler
from draftwise.engine.sequence import Sequence, Status
from draftwise.kv import KVManager
from draftwise.sampling import SamplingParams


def make_seq(prompt_len: int, max_tokens: int = 16, k: int = 0, name: str = "r") -> Sequence:
    return Sequence(name, list(range(1, prompt_len + 1)), SamplingParams(temperature=0, max_tokens=max_tokens), k)


def make_sched(blocks: int = 64, block_size: int = 4, k: int = 0, draft_blocks: int | None = None,
               max_model_len: int = 256, **kw) -> Scheduler:
    draft_kv = KVManager(draft_blocks, block_size) if draft_blocks else None
    return Scheduler(KVManager(blocks, block_size), draft_kv, max_model_len, k, **kw)


def step(sched: Scheduler, accepted: dict[int, int] | None = None):
    """schedule() and a model-free postprocess; `accepted[seq_id]` proposals are kept (default all)."""
    out = sched.schedule()
    postprocess(sched, out, accepted)
    return out


def postprocess(sched: Scheduler, out, accepted: dict[int, int] | None = None) -> None:
    for s in out.scheduled:
        seq = s.seq
        if not s.samples:
            seq.num_computed += s.num_new_tokens
            continue
        a = (accepted or {}).get(seq.seq_id, s.num_draft)
        seq.output_ids += [1000 + len(seq.output_ids) + j for j in range(a + 1)]
        seq.num_computed = seq.num_tokens - 1
        sched.target_kv.truncate(seq.seq_id, seq.num_computed)


def plan(out) -> list[tuple[str, int, int]]:
    return [(s.seq.request_id, s.num_new_tokens, s.num_draft) for s in out.scheduled]


def test_chunked_prefill_under_a_tiny_budget():
    """A 30-token prompt under an 8-token budget: chunks of 8, 8, 8, then 6, which samples."""
    sched = make_sched(max_num_batched_tokens=8)
    seq = make_seq(30)
    sched.add(seq)
    seen = []
    for _ in range(6):
        out = sched.schedule()
        (s,) = out.scheduled
        samples = s.samples
        postprocess(sched, out)
        seen.append((s.num_new_tokens, samples, seq.num_computed, len(sched.target_kv.tables[seq.seq_id])))
    # (chunk, samples, num_computed after the step, blocks held after the step)
    assert seen == [(8, False, 8, 2), (8, False, 16, 4), (8, False, 24, 6), (6, True, 30, 8),
                    (1, True, 31, 8), (1, True, 32, 8)]
    assert seq.output_ids == [1000, 1001, 1002]
    assert not seq.is_prefilling


def test_a_prefill_chunk_reserves_only_what_it_feeds():
    sched = make_sched(max_num_batched_tokens=8, k=4)
    seq = make_seq(30, k=4)
    sched.add(seq)
    sched.schedule()
    assert sched.target_kv.tables[seq.seq_id] == [0, 1]  # 8 positions, no lookahead while prefilling


def test_running_sequences_first_then_admission_within_the_budget():
    sched = make_sched(max_num_batched_tokens=8)
    a, b, c = make_seq(6, name="a"), make_seq(30, name="b"), make_seq(3, name="c")
    for s in (a, b, c):
        sched.add(s)
    assert plan(step(sched)) == [("a", 6, 0), ("b", 2, 0)]  # the budget ends inside b's prompt
    assert list(sched.waiting) == [c]
    assert plan(step(sched)) == [("a", 1, 0), ("b", 7, 0)]  # running first, in admission order
    assert plan(step(sched)) == [("a", 1, 0), ("b", 7, 0)]
    assert list(sched.waiting) == [c]  # no budget left to admit c
    assert b.num_computed == 16


def test_proposals_per_sequence_fit_budget_max_tokens_and_context():
    sched = make_sched(k=4, max_num_batched_tokens=64, max_model_len=40)
    s = make_seq(10, max_tokens=20, k=4)
    s.output_ids = [7] * 5
    assert sched.num_draft_for(s) == 4
    s.output_ids = [7] * 17  # max_tokens - 17 - 1 = 2 left after the token the round always commits
    assert sched.num_draft_for(s) == 2
    s.output_ids = [7] * 19
    assert sched.num_draft_for(s) == 0
    s2 = make_seq(37, max_tokens=20, k=4)  # 3 positions of context left
    assert sched.num_draft_for(s2) == 3
    s2.output_ids = [7] * 3
    assert sched.num_draft_for(s2) == 0
    # the step's budget caps them too: 1 token fed + 2 proposals under a budget of 3
    tight = make_sched(k=4, max_num_batched_tokens=3)
    seq = make_seq(2, k=4)
    tight.add(seq)
    assert plan(step(tight)) == [("r", 2, 0)]
    assert plan(step(tight)) == [("r", 1, 2)]


def test_lookahead_is_reserved_in_both_pools():
    sched = make_sched(k=3, draft_blocks=64, block_size=1)  # one block a position: exact counts
    seq = make_seq(9, k=3)
    sched.add(seq)
    step(sched)  # prefill: the draft pool is not touched
    assert seq.seq_id not in sched.draft_kv.tables
    out = sched.schedule()
    assert plan(out) == [("r", 1, 3)]
    # target: num_computed (9) + the fed token + 3 proposals; drafter: all 10 tokens + 3 - 1
    # (it feeds the proposals but the last one, whose K/V nothing reads)
    assert len(sched.target_kv.tables[seq.seq_id]) == 13
    assert len(sched.draft_kv.tables[seq.seq_id]) == 12


def three_running(blocks: int, **kw) -> tuple[Scheduler, list[Sequence]]:
    """a, b, c admitted in this order, 4-token prompts (one block each), one token committed."""
    sched = make_sched(blocks=blocks, **kw)
    seqs = [make_seq(4, name=n) for n in "abc"]
    for s in seqs:
        sched.add(s)
    step(sched)
    assert sched.running == seqs and all(len(sched.target_kv.tables[s.seq_id]) == 1 for s in seqs)
    return sched, seqs


def test_preemption_takes_the_most_recently_admitted_and_recomputes_it():
    sched, (a, b, c) = three_running(blocks=5)
    d = make_seq(4, name="d")
    sched.add(d)
    # step 2: every decode needs a second block (positions 4): a and b get the two free ones;
    # c finds the pool dry and, as the most recently admitted, is preempted
    out = step(sched)
    assert out.preempted == [c]
    assert plan(out) == [("a", 1, 0), ("b", 1, 0)]
    assert c.status is Status.WAITING and c.num_computed == 0 and c.draft_computed == 0
    assert c.output_ids == [1000]  # committed tokens are kept
    assert c.seq_id not in sched.target_kv.tables
    assert list(sched.waiting) == [c, d]  # requeued at the front, ahead of d
    assert c.stats.preemptions == 1 and sched.num_preemptions == 1
    assert sched.running == [a, b]
    sched.finish(a)  # 2 blocks come back: 3 free
    out = sched.schedule()
    # c is readmitted first and recomputes its prompt and its output in one chunk
    assert plan(out) == [("b", 1, 0), ("c", 5, 0), ("d", 4, 0)]
    assert out.scheduled[1].samples
    postprocess(sched, out)
    assert c.num_computed == 5 and c.output_ids == [1000, 1001]
    assert sched.running == [b, c, d] and sched.target_kv.pool.num_free == 0


def test_preemption_admits_nobody_in_the_same_step():
    sched, (a, b, c) = three_running(blocks=5)
    sched.finish(c)  # 3 free blocks, but a and b need one each and the next ones need more
    d = make_seq(12, name="d")  # would need 3 blocks
    sched.add(d)
    e = make_seq(8, name="e")
    sched.add(e)
    out = step(sched)
    assert plan(out) == [("a", 1, 0), ("b", 1, 0)] and not out.preempted
    assert list(sched.waiting) == [d, e]  # first come, first served: e does not overtake d


def test_preemption_walks_back_from_the_newest_to_the_sequence_itself():
    sched, (a, b, c) = three_running(blocks=3)  # the pool is full after the prompts
    out = step(sched)
    # a needs a second block: c goes and a runs; b then needs one and is itself the newest left
    assert out.preempted == [c, b] and plan(out) == [("a", 1, 0)]
    assert list(sched.waiting) == [b, c]  # their order of admission is kept for the next try
    assert sched.running == [a] and len(sched.target_kv.tables[a.seq_id]) == 2


def test_a_lone_sequence_that_cannot_grow_preempts_itself():
    sched = make_sched(blocks=3)
    seq = make_seq(12)
    sched.add(seq)
    step(sched)  # 3 blocks for the prompt, one token committed: position 12 needs a 4th
    out = step(sched)
    assert out.preempted == [seq] and out.empty
    assert list(sched.waiting) == [seq] and sched.target_kv.pool.num_free == 3
    assert sched.schedule().empty  # 13 tokens never fit in 12 slots: nothing is admitted


def test_a_dry_draft_pool_preempts_too():
    sched = make_sched(blocks=64, draft_blocks=4, k=3)
    a, b = make_seq(4, k=3, name="a"), make_seq(4, k=3, name="b")
    sched.add(a)
    sched.add(b)
    step(sched)  # prefill: 5 tokens each after the first commit, no draft blocks yet
    out = step(sched)  # each drafter reservation needs 5 + 3 - 1 = 7 positions: 2 blocks
    assert plan(out) == [("a", 1, 3), ("b", 1, 3)]
    out = step(sched)  # 9 tokens now: 11 positions, 3 blocks each; only 4 in the pool
    assert out.preempted == [b] and plan(out) == [("a", 1, 3)]
    assert b.seq_id not in sched.draft_kv.tables and b.seq_id not in sched.target_kv.tables
    assert len(sched.draft_kv.tables[a.seq_id]) == 3


@pytest.mark.parametrize("limit", [None, 1])
def test_max_num_seqs_and_admission_limit(limit):
    sched = make_sched(max_num_seqs=2)
    sched.admission_limit = limit
    seqs = [make_seq(4, name=str(i)) for i in range(4)]
    for s in seqs:
        sched.add(s)
    cap = 2 if limit is None else 1
    step(sched)
    assert sched.running == seqs[:cap] and list(sched.waiting) == seqs[cap:]
    step(sched)
    assert len(sched.running) == cap
    sched.finish(seqs[0])
    assert seqs[0].is_finished and seqs[0].seq_id not in sched.target_kv.tables
    out = step(sched)
    assert sched.running == seqs[1 : cap + 1]
    assert out.scheduled[-1].seq is seqs[cap] and out.scheduled[-1].num_new_tokens == 4


def test_finish_a_waiting_sequence_and_has_unfinished():
    sched = make_sched(k=2, draft_blocks=8)
    a, b = make_seq(4, name="a"), make_seq(4, name="b")
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    assert sched.draft_kv.tables[a.seq_id]
    sched.finish(a)
    assert a.seq_id not in sched.draft_kv.tables and a.seq_id not in sched.target_kv.tables
    c = make_seq(4, name="c")
    sched.add(c)
    sched.finish(c)  # aborted before it ran
    assert c.is_finished and not sched.waiting
    sched.finish(b)
    assert not sched.has_unfinished() and sched.target_kv.pool.num_free == 64


def test_constrained_sequences_reserve_their_forced_proposals():
    """A constrained sequence (structured output) may verify `max_forced` grammar-forced proposals
    on top of its k drafted ones: the target reserves 1 + k + f slots, the drafter k + f - 1 past
    the committed tokens, f is capped by max_tokens like k, and an unconstrained one reserves 1 + k."""
    sched = make_sched(blocks=64, block_size=4, k=2, draft_blocks=64, max_forced=5)
    free, json_, short = make_seq(4, name="free"), make_seq(4, name="json"), make_seq(4, max_tokens=6, name="short")
    json_.grammar = short.grammar = object()  # only `is not None` is read
    for s in (free, json_, short):
        sched.add(s)
    step(sched)  # prefills, each commits one token
    out = sched.schedule()
    got = {s.seq.request_id: (s.num_draft, s.num_forced) for s in out.scheduled}
    assert got == {"free": (2, 0), "json": (2, 5), "short": (2, 2)}  # short: 6 - 1 - 1 - 2 = 2 left
    tables = sched.target_kv.tables
    assert [len(tables[s.seq_id]) for s in (free, json_, short)] == [2, 3, 3]  # 4 + 1 + 2 (+ f) slots
    dtables = sched.draft_kv.tables
    assert [len(dtables[s.seq_id]) for s in (free, json_, short)] == [2, 3, 2]  # 5 + 2 (+ f) - 1 slots
    sched = make_sched(blocks=64, block_size=4, k=2, max_forced=5, max_num_batched_tokens=6)
    sched.add(json_ := make_seq(4, name="json"))
    json_.grammar = object()
    step(sched)
    (s,) = sched.schedule().scheduled
    assert (s.num_draft, s.num_forced) == (2, 3)  # the step's token budget: 6 - 1 - 2


def test_mixed_chunk_caps_prefill_only_while_others_decode():
    """With `mixed_chunk`, a prompt admitted beside a decoding sequence is prefilled in chunks of
    at most that many tokens (the engine runs the step as one forward); alone it takes the budget."""
    sched = make_sched(blocks=128, max_num_batched_tokens=256, mixed_chunk=16)
    a = make_seq(100, name="a")
    sched.add(a)
    assert plan(step(sched)) == [("a", 100, 0)]  # nothing decodes yet: one chunk of the whole prompt
    b = make_seq(40, name="b")
    sched.add(b)
    assert plan(step(sched)) == [("a", 1, 0), ("b", 16, 0)]
    assert plan(step(sched)) == [("a", 1, 0), ("b", 16, 0)]
    assert plan(step(sched)) == [("a", 1, 0), ("b", 8, 0)]
    assert plan(step(sched)) == [("a", 1, 0), ("b", 1, 0)]


def test_a_step_sure_to_be_plain_reserves_nothing_for_proposals():
    """When the policy is sure the next step drafts for no row (`plain_next`, asked with the number
    of rows that would draft: `plan`'s batch), decoding rows reserve no K/V for drafted proposals
    and none for the drafter: `num_draft` 0, `plain` set (the row still goes to `plan`); a
    constrained row keeps its grammar-forced proposals. Asked with another batch, or not sure:
    the usual reservations."""
    asked = []

    def sure(num_seqs: int) -> bool:
        asked.append(num_seqs)
        return num_seqs == 2

    sched = make_sched(k=3, draft_blocks=64, block_size=1, max_forced=2)  # one block a position
    sched.plain_next = sure
    a, b = make_seq(9, name="a"), make_seq(9, name="b")
    b.grammar = object()
    for s in (a, b):
        sched.add(s)
    step(sched)  # prefills
    out = sched.schedule()
    assert asked[-1] == 2
    got = {s.seq.request_id: (s.num_draft, s.num_forced, s.plain) for s in out.scheduled}
    assert got == {"a": (0, 0, True), "b": (0, 2, True)}
    assert [len(sched.target_kv.tables[s.seq_id]) for s in (a, b)] == [10, 12]  # 9 + 1 (+ 2 forced)
    assert a.seq_id not in sched.draft_kv.tables and b.seq_id not in sched.draft_kv.tables
    postprocess(sched, out)
    sched.plain_next = lambda num_seqs: False
    out = sched.schedule()
    got = {s.seq.request_id: (s.num_draft, s.num_forced, s.plain) for s in out.scheduled}
    assert got == {"a": (3, 0, False), "b": (3, 2, False)}
    assert [len(sched.draft_kv.tables[s.seq_id]) for s in (a, b)] == [13, 15]  # 11 tokens + 3 (+ 2) - 1
