"""Suffix decoding: the index (counts, matches, frequency scoring, removal, the answers of a trie
of every substring), the proposer (adaptive length, the global cache across requests and its LRU
bound, committed history only), and the engine with `--method suffix` (greedy equal to plain;
`draftwise check` passes)."""
import random
from fractions import Fraction

import pytest

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.cli.main import main
from draftwise.proposers.suffix import OutputCache, SuffixProposer, tail
from draftwise.proposers.suffix_index import Draft, SuffixIndex


class History:
    def __init__(self, prompt, output=(), seq_id=1, grammar=None):
        self.seq_id, self.prompt_ids, self.output_ids, self.grammar = seq_id, list(prompt), list(output), grammar


def counts(index: SuffixIndex) -> dict[tuple, int]:
    """Every substring of up to depth tokens of the index's documents -> its count."""
    subs = {tuple(d.tokens[i:j]) for d in index.docs.values() for i in range(len(d.tokens))
            for j in range(i + 1, min(i + index.depth, len(d.tokens)) + 1)}
    return {s: index.count(list(s)) for s in subs}


# ------------------------------------------------------------------ the index
def test_index_counts_every_substring_up_to_depth():
    t = SuffixIndex(3)
    t.append("a", [1, 2, 1])
    t.append("a", [2])  # incremental: the same as appending [1, 2, 1, 2] at once
    assert counts(t) == {(1,): 2, (2,): 2, (1, 2): 2, (2, 1): 1, (1, 2, 1): 1, (2, 1, 2): 1}
    whole = SuffixIndex(3)
    whole.append("b", [1, 2, 1, 2])
    assert counts(whole) == counts(t)


def test_appending_does_work_independent_of_depth():
    """A token enters three position lists (its own, its pair's, its four's) whatever the depth:
    indexing a prompt costs the same at depth 2 and 24 (a trie extends depth nodes per token)."""
    tokens = [random.Random(0).randrange(5) for _ in range(200)]
    for depth in (2, 24):
        t = SuffixIndex(depth)
        t.append(0, tokens)
        assert [sum(map(len, table.values())) for table in (t.ends, t.pairs, t.quads)] == [200, 199, 197]


def test_match_is_the_longest_suffix_followed_by_something():
    t = SuffixIndex(8)
    t.append(0, [5, 1, 2, 3, 9, 1, 2, 3])
    m, occ = t.match([7, 1, 2, 3])  # [1, 2, 3] occurred followed by 9 (its occurrence at the end is not)
    assert m == 3 and list(t.continuations(occ)) == [9]
    assert t.match([4, 4])[0] == 0  # nothing matches: the empty suffix
    assert t.match([5, 1, 2, 3])[0] == 4
    assert SuffixIndex(4).match([1, 2])[0] == 0  # empty index


def test_draft_follows_the_most_frequent_continuation_with_exact_frequencies():
    t = SuffixIndex(6)
    t.append(0, [1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 3, 0, 1, 2])
    d = t.draft([8, 0, 1, 2], max_tokens=3, min_prob=0.0)
    assert d.match_length == 3  # [0, 1, 2]: followed by 4, 3, and (the end)
    assert d.token_ids == [3, 0, 1]  # 3 follows [0, 1, 2] once, 4 once: the tie goes to the most recent
    assert [Fraction(p).limit_denominator(10) for p in d.probs] == [Fraction(1, 2), 1, 1]
    assert d.score == pytest.approx(0.5 + 0.5 + 0.5)
    u = SuffixIndex(6)
    u.append(0, [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2])
    d = u.draft([1, 2], max_tokens=1, min_prob=0.0)
    assert d.token_ids == [3] and d.probs == [pytest.approx(2 / 3)]  # 3 twice, 4 once


def test_draft_length_adapts_to_the_match_and_min_prob():
    t = SuffixIndex(16)
    seq = list(range(10, 30))
    t.append(0, seq)
    assert t.draft([99, 10], 16, 0.0).token_ids == [11]  # match 1 -> 1 token
    assert t.draft([12, 13, 14], 16, 0.0).token_ids == [15, 16, 17]  # match 3 -> 3 tokens
    assert t.draft(seq[:8], 16, 0.0).token_ids == seq[8:16]  # match 8 -> 8 tokens
    assert t.draft(seq[:8], 5, 0.0).token_ids == seq[8:13]  # at most max_tokens
    assert t.draft([12, 13, 14], 16, 0.0, spec_factor=2.0).token_ids == [15, 16, 17, 18, 19, 20]
    u = SuffixIndex(8)
    u.append(0, [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 3, 1, 2])  # after [1, 2]: 3 (2/4), 4, 5
    assert u.draft([9, 1, 2], 4, min_prob=0.6).token_ids == []  # 1/2 < 0.6: nothing
    assert u.draft([9, 1, 2], 4, min_prob=0.4).token_ids == [3, 1]  # 1/2 >= 0.4, then [1, 2, 3] -> 1 always


def test_a_copy_runs_past_the_depth_bound():
    t = SuffixIndex(4)
    text = list(range(100, 140))
    t.append(0, text)
    d = t.draft(text[:20], 16, 0.0, spec_factor=100)
    assert d.match_length == 3 and d.token_ids == text[20:36]  # re-anchored every step past depth 3


def test_remove_restores_the_counts_of_the_other_documents():
    t, only_b = SuffixIndex(3), SuffixIndex(3)
    t.append("a", [1, 2, 3, 1])
    t.append("b", [2, 3, 4])
    only_b.append("b", [2, 3, 4])
    t.remove("a")
    assert counts(t) == counts(only_b) and len(counts(t)) == 6
    assert t.ends.keys() == only_b.ends.keys() and t.pairs.keys() == only_b.pairs.keys()


def test_a_removed_document_breaks_no_tie():
    """After an earlier output leaves the cache, a tie between continuations goes to the most
    recent occurrence still held, and the draft names a document still held."""
    t = SuffixIndex(4)
    t.append("x", [1, 2, 6])
    t.append("y", [1, 2, 5])
    t.append("z", [1, 2, 6])
    d = t.draft([1, 2], 1, 0.0)
    assert d.token_ids == [6] and d.doc == "z"  # 6 twice, 5 once
    t.remove("z")
    d = t.draft([1, 2], 1, 0.0)
    assert d.token_ids == [5] and d.doc == "y"  # a tie: y's 5 is more recent than x's 6


def reference_draft(docs: dict, depth: int, context: list[int], max_tokens: int, min_prob: float,
                    spec_factor: float) -> Draft:
    """The trie's draft by its definition, over windows: counts of every substring of up to depth
    tokens, the longest followed suffix (<= depth - 1 tokens), the most frequent continuation (the
    most recent on a tie), re-anchored on the last depth - 1 tokens at the depth bound."""
    clock, where = 0, []  # (doc, tokens, clock of each position)
    for key, toks in docs.items():
        where.append((key, toks, list(range(clock + 1, clock + 1 + len(toks)))))
        clock += len(toks)

    def nexts(s):  # token -> (count, latest clock, doc) of s + token
        out = {}
        if len(s) >= depth:
            return out
        for key, toks, clocks in where:
            for e in range(len(s) - 1, len(toks) - 1):
                if toks[e - len(s) + 1 : e + 1] == s:
                    c, seen, _ = out.get(toks[e + 1], (0, 0, None))
                    out[toks[e + 1]] = (c + 1, clocks[e + 1], key) if clocks[e + 1] > seen else (c + 1, seen, _)
        return out

    def match(ctx):
        return next((m for m in range(min(depth - 1, len(ctx)), 0, -1) if nexts(ctx[len(ctx) - m :])), 0)

    m = match(context)
    out, path, run = Draft(match_length=m), list(context[len(context) - m :]), 1.0
    while len(out.token_ids) < min(max_tokens, int(spec_factor * m)):
        nxt = nexts(path)
        if not nxt:
            path = path[len(path) - match(path) :]
            nxt = nexts(path)
            if not nxt:
                break
        tok, (count, _, key) = max(nxt.items(), key=lambda kv: kv[1][:2])
        total = sum(c for c, _, _ in nxt.values())
        run *= count / total
        if run < min_prob:
            break
        out.token_ids.append(tok)
        out.probs.append(count / total)
        out.doc = key
        path.append(tok)
    return out


def test_drafts_are_the_tries_on_random_documents():
    rng = random.Random(5)
    for case in range(300):
        depth, vocab = rng.randint(2, 7), rng.randint(2, 5)
        docs = {key: [rng.randrange(vocab) for _ in range(rng.randint(0, 14))] for key in range(rng.randint(1, 3))}
        t = SuffixIndex(depth)
        for key, toks in docs.items():
            cut = rng.randint(0, len(toks))
            t.append(key, toks[:cut])
            t.append(key, toks[cut:])  # incremental appends
        for _ in range(4):
            ctx = [rng.randrange(vocab) for _ in range(rng.randint(0, 9))]
            args = rng.randint(0, 12), rng.choice([0.0, 0.2, 0.5]), rng.choice([0.5, 1.0, 3.0])
            assert t.draft(ctx, *args) == reference_draft(docs, depth, ctx, *args), (case, docs, ctx, args)


def test_index_rejects_a_depth_below_two():
    with pytest.raises(ValueError, match="depth"):
        SuffixIndex(1)


# ------------------------------------------------------------------ the global cache
def test_output_cache_evicts_least_recently_used_by_tokens():
    c = OutputCache(depth=4, max_tokens=10)
    c.add("a", [1, 2, 3, 4])
    c.add("b", [5, 6, 7])
    c.touch("a")  # drafted from: now the most recent
    c.add("c", [8, 9, 10, 11])  # 11 tokens > 10: b goes
    assert list(c.docs) == ["a", "c"] and c.tokens == 8
    assert c.index.match([5, 6])[0] == 0 and c.index.match([1, 2])[0] == 2
    c.add("d", list(range(20, 40)))  # longer than the cache: its last 10 tokens, everything else out
    assert list(c.docs) == ["d"] and c.tokens == 10 and c.docs["d"] == list(range(30, 40))
    fresh = SuffixIndex(4)
    fresh.append(0, list(range(30, 40)))
    assert counts(c.index) == counts(fresh)
    none = OutputCache(depth=4, max_tokens=0)
    none.add("a", [1, 2])
    assert not none.docs


# ------------------------------------------------------------------ the proposer
def test_proposer_drafts_from_the_prompt_and_output_with_adaptive_length():
    prop = SuffixProposer(suffix_depth=8)
    text = list(range(10, 40))
    a, b, c = prop.propose([History(text, text[:2], seq_id=1), History(text, text[:9], seq_id=2),
                            History([1, 2], [3], seq_id=3)], [16, 4, 4])
    assert a.token_ids == text[2:4]  # match of 2 tokens: 2 proposals
    assert b.token_ids == text[9:13]  # match of 7 (depth - 1): k = 4 proposals
    assert c.token_ids == [] and c.probs is None and a.probs is None
    assert a.confidence == [pytest.approx(1 - 1 / 3), pytest.approx(1 - 1 / 4)]
    prop.confidence = False
    assert prop.propose([History(text, text[:9], seq_id=2)], [4])[0].confidence is None
    assert prop.propose([History(text, text[:9], seq_id=2)], [0])[0].token_ids == []


def test_proposer_reads_committed_history_only():
    """A rejected block never enters the request's index: after any sequence of rounds the index
    equals one built from the committed tokens."""
    prop = SuffixProposer(suffix_depth=5)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    h = History(prompt, [], seq_id=7)
    for committed in ([9], [9, 4, 5], [9, 4, 5, 8], [9, 4, 5, 8, 1, 2]):
        prop.propose([h], [4])  # proposes [4, 5, 6, ...]: some rounds reject it
        h.output_ids = list(committed)
    prop.propose([h], [4])
    fresh = SuffixIndex(5)
    fresh.append(0, prompt + h.output_ids)
    assert counts(prop.local[7].index) == counts(fresh)


def test_long_catch_ups_are_timed_apart_from_the_step():
    """Indexing a new prompt (more than LONG_CATCH_UP tokens) is reported as catch-up, which the
    policy leaves out of its decode-step cost model; a row one token behind reports none."""
    prop = SuffixProposer(suffix_depth=8)
    prompt = list(range(100, 100 + 4 * SuffixProposer.LONG_CATCH_UP))
    h = History(prompt, [], seq_id=3)
    prop.propose([h], [4])
    assert prop.catch_up_seconds > 0
    h.output_ids = [7]
    prop.propose([h], [4])
    assert prop.catch_up_seconds == 0.0
    h.output_ids = [7] * (SuffixProposer.LONG_CATCH_UP + 2)  # a stretch of steps without drafting
    prop.propose([h], [4])
    assert prop.catch_up_seconds > 0


def test_global_cache_carries_outputs_across_requests():
    prop = SuffixProposer(suffix_depth=8, suffix_cache_tokens=64)
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    first = History([1, 2, 3], answer, seq_id=1)
    prop.propose([first], [4])
    prop.finish(first)
    assert 1 not in prop.local and list(prop.cache.docs) == [1]
    # a later request whose prompt never shows the answer: its output so far matches the earlier one
    later = History([5, 6, 7], answer[:4], seq_id=2)
    assert prop.propose([later], [4])[0].token_ids == answer[4:8]
    own = SuffixProposer(suffix_depth=8, suffix_cache_tokens=0)  # no global cache: nothing to draft
    own.finish(first)
    assert own.propose([later], [4])[0].token_ids == []


def test_the_request_own_index_wins_a_tie():
    prop = SuffixProposer(suffix_depth=8)
    prop.finish(History([0], [1, 2, 3, 50, 51], seq_id=1))  # earlier output: [1, 2, 3] -> 50
    h = History([1, 2, 3, 60, 61, 9], [1, 2, 3], seq_id=2)  # this request's own text: [1, 2, 3] -> 60
    assert prop.propose([h], [2])[0].token_ids == [60, 61]


def test_the_cache_is_drafted_only_where_it_can_win_and_wins_as_before():
    rng = random.Random(11)
    for case in range(200):
        depth, vocab = rng.randint(3, 7), rng.randint(2, 4)
        prop = SuffixProposer(suffix_depth=depth, suffix_spec_factor=rng.choice([0.5, 1.0, 3.0]),
                              suffix_min_prob=rng.choice([0.0, 0.2]))
        for key in range(rng.randint(1, 3)):
            prop.finish(History([0], [rng.randrange(vocab) for _ in range(rng.randint(1, 16))], seq_id=100 + key))
        h = History([rng.randrange(vocab) for _ in range(rng.randint(1, 12))],
                    [rng.randrange(vocab) for _ in range(rng.randint(0, 6))], seq_id=1)
        n = rng.randint(1, 10)
        context = tail(h, depth - 1)
        own = prop._catch_up(h).draft(context, n, prop.min_prob, prop.spec_factor)
        other = prop.cache.index.draft(context, n, prop.min_prob, prop.spec_factor)
        want = other if (other.score, other.match_length) > (own.score, own.match_length) else own
        assert prop._draft(h, n) == want, case


def test_a_perfect_own_draft_skips_the_cache():
    prop = SuffixProposer(suffix_depth=8)
    text = list(range(10, 30))
    prop.finish(History([0], text, seq_id=1))
    drafted = []
    index_draft = prop.cache.index.draft
    prop.cache.index.draft = lambda *a, **kw: drafted.append(a) or index_draft(*a, **kw)
    assert prop.propose([History(text, text[:7], seq_id=2)], [4])[0].token_ids == text[7:11]
    assert drafted == []  # its own copy scores 4 of 4 with a match as long: the cache cannot beat it
    assert prop.propose([History([5, 6], text[:7], seq_id=3)], [4])[0].token_ids == text[7:11]
    assert len(drafted) == 1  # nothing of its own: drafted from the cache


class Grammar:
    """Allows every token but `bad`."""

    def __init__(self, bad):
        self.bad = bad

    def cursor(self):
        g = self

        class Cursor:
            def accept(self, t):
                return t != g.bad
        return Cursor()


def test_a_constrained_block_ends_before_the_first_forbidden_token():
    prop = SuffixProposer(suffix_depth=8)
    text = list(range(10, 30))
    block = prop.propose([History(text, text[:6], grammar=Grammar(bad=13))], [4])[0]
    assert block.token_ids == [16, 17, 18, 19]  # 13 is not among them
    block = prop.propose([History(text, text[:6], seq_id=2, grammar=Grammar(bad=18))], [4])[0]
    assert block.token_ids == [16, 17] and len(block.confidence) == 2


def test_proposer_rejects_bad_parameters():
    with pytest.raises(ValueError, match="suffix decoding"):
        SuffixProposer(suffix_min_prob=1.5)
    with pytest.raises(ValueError, match="suffix decoding"):
        SuffixProposer(suffix_depth=1)


def test_tail_reads_across_prompt_and_output():
    h = History([1, 2, 3], [4, 5])
    assert tail(h, 4) == [2, 3, 4, 5] and tail(h, 1) == [5] and tail(h, 9) == [1, 2, 3, 4, 5]


def test_score_sums_running_products():
    assert Draft([1, 2], [0.5, 0.5]).score == pytest.approx(0.75) and Draft().score == 0


# ------------------------------------------------------------------ the engine
REPEAT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]


@pytest.mark.parametrize("prompts", [[REPEAT * 3], [REPEAT * 3, [5, 6, 5, 6, 5, 6, 5], [40, 41, 42] * 4, [3] * 9]],
                         ids=["batch1", "batch4"])
def test_greedy_suffix_equals_plain(target_dir, prompts):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = LLM(str(target_dir)).generate(prompts, sp)
    llm = LLM(str(target_dir), spec=SpecConfig(method="suffix", k=8))
    outs = llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert sum(o.stats.proposed_tokens for o in outs) > 0
    again = llm.generate(prompts, sp)  # the global cache now holds these outputs
    assert [o.token_ids for o in again] == [b.token_ids for b in base]
    assert sum(o.stats.accepted_tokens for o in again) >= sum(o.stats.accepted_tokens for o in outs)
    assert not llm.engine.speculation.proposer.local  # finished requests leave nothing behind


def test_check_suffix_passes(target_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\\n    return a + b\\n\\ndef add(a, b):\nfor i in range(10):\n")
    rc = main(["check", "--model", str(target_dir), "--method", "suffix", "--samples", "200", "--max-tokens", "16",
               "--prompts", str(prompts)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS distribution" in out
