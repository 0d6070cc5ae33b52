"""Checks the tests of drafters share: greedy output equal to plain decoding's (near-ties aside), and
engine steps after which the drafter's cache covers the committed context."""
from draftwise.lab import correctness


def assert_greedy_equals_plain(llm, plain, blocks):
    """`llm`'s greedy outputs of `plain`'s prompts equal plain decoding's (near-ties aside), it drafted,
    and with a pool of `blocks` it preempted. Returns its engine's stats."""
    llm0, ps, sp, want = plain
    outs = llm.generate(ps, sp)
    assert_equal_but_near_ties(llm0.engine.target.model, ps, [o.token_ids for o in outs], want)
    st = llm.engine.stats
    assert st.proposed_tokens > 0
    if blocks:
        assert st.preemptions > 0
    return st


def steps_checking(eng, seqs, steps: int, check) -> int:
    """Up to `steps` engine steps; after each, every decoding sequence of `seqs` has its drafter's
    cache as long as the target's committed context and passes `check(seq)`. Returns the checks run."""
    checked = 0
    for _ in range(steps):
        if not eng.has_unfinished():
            break
        eng.step()
        for s in seqs:
            if s.is_finished or s.is_prefilling or s.num_computed == 0:
                continue
            assert s.draft_computed == s.num_computed
            check(s)
            checked += 1
    return checked


def assert_equal_but_near_ties(target, ps, got, want):
    for p, g, w in zip(ps, got, want):
        j = correctness.first_difference(w, g)
        assert j is None or (j < len(w) and correctness.near_tie(target, p + w, len(p) + j)), (j, g, w)
