"""Suffix decoding's trees: the index's best-first tree (exact frequencies and gains, its first-child
path = the chain draft, every prefix a tree), the nodes a greedy tree's verification tests, the
proposer's tree blocks and their calibration, and the engine with suffix:tree (greedy equal to
plain; `draftwise check` passes)."""
import random

import pytest

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.cli.main import main
from draftwise.proposers.suffix import SuffixProposer, nodes_tested
from draftwise.proposers.suffix_index import Draft, SuffixIndex


class History:
    def __init__(self, prompt, output=(), seq_id=1, grammar=None):
        self.seq_id, self.prompt_ids, self.output_ids, self.grammar = seq_id, list(prompt), list(output), grammar


def first_child_path(parents: list[int]) -> list[int]:
    path, slot = [], -1
    while (child := next((i for i, p in enumerate(parents) if p == slot), None)) is not None:
        path.append(child)
        slot = child
    return path


# ------------------------------------------------------------------ the index
def test_tree_branches_where_earlier_occurrences_disagree():
    """Context [1, 2] was followed by 3 twice and by 4 once: both drafted, 3 first, with exact
    frequencies; each continues as its occurrences did."""
    index = SuffixIndex(8)
    index.append("a", [1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 4, 6])
    t = index.draft_tree([9, 1, 2], 8, 0.0, 1.0, 2)  # a match of 2: depth 2 at most
    assert t.match_length == 2
    nodes = list(zip(t.token_ids, t.parents, t.probs, t.gains))
    # best first: 3 (2/3), then 3's continuation 5 (2/3 x 1), then 4 (1/3) and its continuation 6
    assert nodes == [(3, -1, pytest.approx(2 / 3), pytest.approx(2 / 3)), (5, 0, 1.0, pytest.approx(2 / 3)),
                     (4, -1, pytest.approx(1 / 3), pytest.approx(1 / 3)), (6, 2, 1.0, pytest.approx(1 / 3))]
    assert t.gains == sorted(t.gains, reverse=True)
    assert all(p < i for i, p in enumerate(t.parents))
    assert t.score == pytest.approx(sum(t.gains))  # gains at the default rate: the path frequencies


def test_one_branch_is_the_chain_and_wider_trees_start_with_it():
    """On random documents: with one continuation per slot the tree is `draft`'s chain; with three,
    its first-child path is a prefix of that chain, its gains never rise (every prefix is a tree)
    and it expects at least as many accepted tokens when not cut by the node budget."""
    rng = random.Random(0)
    for _ in range(500):
        vocab = rng.choice([3, 5, 8])
        index = SuffixIndex(rng.choice([4, 6, 24]))
        for doc in range(rng.randint(1, 3)):
            index.append(doc, [rng.randrange(vocab) for _ in range(rng.randint(5, 60))])
        context = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
        k, min_prob, factor = rng.randint(1, 16), rng.choice([0.0, 0.1, 0.3]), rng.choice([0.5, 1.0, 2.0])
        chain = index.draft(context, k, min_prob, factor)
        one = index.draft_tree(context, k, min_prob, factor, 1)
        assert (one.token_ids, one.probs) == (chain.token_ids, chain.probs)
        assert one.parents == list(range(-1, len(one.token_ids) - 1))
        wide = index.draft_tree(context, k, min_prob, factor, 3)
        main_path = [wide.token_ids[i] for i in first_child_path(wide.parents)]
        assert chain.token_ids[: len(main_path)] == main_path
        assert wide.gains == sorted(wide.gains, reverse=True)
        assert all(p < i for i, p in enumerate(wide.parents))
        if len(wide.token_ids) < k:
            assert wide.score >= chain.score - 1e-12


def test_tree_depth_follows_the_match_length():
    index = SuffixIndex(24)
    index.append("a", [1, 2, 3, 4, 5, 6, 7, 8] + [1, 2, 3, 9, 9, 9])
    t = index.draft_tree([2, 3], 16, 0.0, 1.0, 2)  # a match of 2: depth 2 at most
    depths = []
    for p in t.parents:
        depths.append(depths[p] + 1 if p >= 0 else 1)
    assert max(depths) == 2 and sorted(t.token_ids[:2]) == [4, 9]


def test_tree_score_sums_path_products():
    assert Draft([1, 2, 3], [0.5, 0.5, 0.5], parents=[-1, -1, 0]).score == pytest.approx(0.5 + 0.5 + 0.25)


# ------------------------------------------------------------------ verification's tested nodes
def test_tested_nodes_are_the_children_of_the_root_and_of_accepted_nodes():
    # root -> 0 (-> 2 -> 4), 1 (-> 3); node 1 accepted, then its child 3 rejected
    parents, firsts = [-1, -1, 0, 1, 2], [True, False, True, True, True]
    assert nodes_tested(parents, firsts, [1]) == [(1, True, False), (1, False, True), (2, True, False)]
    assert nodes_tested(parents, firsts, [0, 2, 4]) == [(1, True, True), (1, False, False), (2, True, True),
                                                        (3, True, True)]
    assert nodes_tested(parents, firsts, []) == [(1, True, False), (1, False, False)]
    # a sibling drafted before its slot's most frequent continuation (its calibrated gain was higher)
    assert nodes_tested([-1, -1], [False, True], [0]) == [(1, False, True), (1, True, False)]
    # sampled: siblings tried in turn, the one after the accepted never tested
    assert nodes_tested([-1, -1, -1], [True, False, False], [1], greedy=False) == [(1, True, False), (1, False, True)]


# ------------------------------------------------------------------ the proposer
def test_proposer_drafts_a_tree_where_the_history_branches_and_a_chain_where_it_does_not():
    prop = SuffixProposer(suffix_depth=8, suffix_spec_factor=4.0, tree=2)
    branching = History([1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 4, 6, 0, 1, 2], seq_id=1)
    copying = History(list(range(10, 40)), list(range(10, 19)), seq_id=2)
    a, b = prop.propose([branching, copying], [8, 4])
    assert a.is_tree and a.drafting == "point"
    assert [a.token_ids[i] for i, p in enumerate(a.parents) if p == -1] == [3, 4]  # tried in this order
    assert a.probs is None and len(a.confidence) == len(a.token_ids)
    assert not b.is_tree and b.token_ids == list(range(19, 23))
    constrained = History(branching.prompt_ids, seq_id=3, grammar=AllowAll())
    assert not prop.propose([constrained], [8])[0].is_tree  # a constrained row verifies a chain


class AllowAll:
    def cursor(self):
        return self

    def accept(self, token):
        return True


def test_proposer_calibrates_first_continuations_and_siblings_apart():
    prop = SuffixProposer(suffix_depth=8, suffix_spec_factor=4.0, tree=2)
    h = History([1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 4, 6, 0, 1, 2], seq_id=1)
    before_first, before_sibling = prop._rate(2, 1, 2 / 3, True), prop._rate(2, 1, 1 / 3, False)
    for _ in range(20):  # the sibling (4) is what the target wants, every time
        blk = prop.propose([h], [8])[0]
        path = [next(i for i, p in enumerate(blk.parents) if p == -1 and blk.token_ids[i] == 4)]
        prop.observe_verified(h, blk, len(blk.token_ids), 1, path=path)
    assert prop._rate(2, 1, 2 / 3, True) < before_first
    assert prop._rate(2, 1, 1 / 3, False) > before_sibling
    blk = prop.propose([h], [8])[0]
    assert blk.token_ids[0] == 4 and blk.parents[0] == -1  # the calibrated gains now put the sibling first


def test_a_tree_draft_that_did_not_branch_calibrates_its_sibling_as_a_sibling():
    """A tree draft's prefix can be chain-shaped and still hold a slot's less frequent continuation
    (drafted first for its higher calibrated gain): verified as a chain, it counts as a sibling."""
    from draftwise.proposers.base import DraftBlock

    prop = SuffixProposer(tree=2)
    h = History([1, 2, 3], seq_id=5)
    prop.drafted[5] = (3, [7, 8], [False, True])
    prop.observe_verified(h, DraftBlock([7, 8], None), 2, 1)
    assert prop.sibling_acceptance.cells and set(prop.acceptance.cells) == {(2, 2)}  # (bucket of m = 3, depth 2)


# ------------------------------------------------------------------ the engine
REPEAT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
BRANCHY = [5, 6, 7, 5, 6, 8, 5, 6, 7, 5, 6, 9, 5, 6]


@pytest.mark.parametrize("prompts, sibling", [([BRANCHY * 2], False),
                                               ([REPEAT * 3, BRANCHY, [40, 41, 42] * 4, [3] * 9], True)],
                         ids=["batch1", "batch4"])
def test_greedy_suffix_tree_equals_plain(target_dir, prompts, sibling):
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    base = LLM(str(target_dir)).generate(prompts, sp)
    llm = LLM(str(target_dir), spec=SpecConfig(method="suffix", k=8, tree=3))
    trees = []
    real = llm.engine.speculation.proposer.propose

    def spy(seqs, num_draft, num_forced=None):
        blocks = real(seqs, num_draft, num_forced)
        trees.extend(b for b in blocks if b.is_tree)
        return blocks

    prop = llm.engine.speculation.proposer
    prop.propose = spy
    sibling_paths = []
    real_observe = prop.observe_verified

    def observe(seq, block, num_verified, num_accepted, path=None):
        if path and block.is_tree:
            firsts = prop.drafted[seq.seq_id][2]
            sibling_paths.extend(i for i in path if not firsts[i])
        real_observe(seq, block, num_verified, num_accepted, path)

    prop.observe_verified = observe
    for _ in range(2):  # the second time the global cache holds the first outputs
        outs = llm.generate(prompts, sp)
        assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert trees  # trees were drafted and verified
    assert sibling_paths or not sibling  # batch4: a sibling accepted on the way
    assert not llm.engine.speculation.proposer.local


def test_check_suffix_tree_passes(target_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\\n    return a + b\\n\\ndef add(a, c):\\n    return a\\n\\ndef add(\n"
                       "for i in range(10):\n")
    rc = main(["check", "--model", str(target_dir), "--method", "suffix", "--tree", "2", "--samples", "200",
               "--max-tokens", "16", "--prompts", str(prompts)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS distribution" in out
