"""A lookup before the drafter (`--lookup ngram|suffix`, proposers/lookup_first.py): the choice rule
and routing on stubs; greedy output equal to plain decoding at 1 and 16 in flight and under
preemption with both proposers drafting rows; `draftwise check` PASS (sampled rows' distribution
included); bad input a clear error."""
import random

import pytest

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.cli.main import main
from draftwise.lab.runner import parse_configs
from draftwise.proposers import DraftBlock
from draftwise.proposers.lookup_first import LookupFirst
from draftwise.proposers.tree_budget import TreeBudget
from test_dspark_engine import assert_equal_but_near_ties, make_dspark_dir
from test_eagle3_engine import make_eagle3_dir


class Seq:
    def __init__(self, seq_id):
        self.seq_id = seq_id


class StubLookup:
    name = "ngram"
    confidence = False

    def __init__(self, conf):
        self.conf, self.calls = conf, []

    def propose(self, seqs, num_draft, num_forced=None):
        self.calls.append(list(num_draft))
        return [DraftBlock([7] * n, None, [self.conf[s.seq_id]] * n if n else []) for s, n in zip(seqs, num_draft)]

    def postprocess(self, seq, block, num_accepted, num_tokens_before):
        self.calls.append(("post", seq.seq_id))

    def finish(self, seq):
        self.calls.append(("finish", seq.seq_id))


class StubDrafter(StubLookup):
    name = "draft"
    kv = "its cache"
    feature_layers = ()

    def __init__(self):
        super().__init__({})
        self.budget = None

    def propose(self, seqs, num_draft, num_forced=None):
        self.calls.append(([s.seq_id for s in seqs], list(num_draft), list(num_forced)))
        self.catch_up_seconds = 0.5  # (what a long catch-up of its rows took)
        return [DraftBlock([3] * n, None, None) for n in num_draft]

    def set_tree_budget(self, budget):
        self.budget = budget


def test_rows_with_a_strong_match_take_the_lookups_block_the_others_the_drafters():
    lookup, drafter = StubLookup({0: 0.9, 1: 0.5, 2: 0.75, 3: 0.2}), StubDrafter()
    p = LookupFirst(lookup, drafter, k=3, lookup_min=0.75)
    assert lookup.confidence and p.kv == "its cache" and p.name == "draft+ngram"
    seqs = [Seq(i) for i in range(4)]
    p.set_tree_budget(TreeBudget(0.1, [8, 8, 2, 8]))
    blocks = p.propose(seqs, [8, 8, 8, 1], [0, 1, 0, 2])
    assert lookup.calls == [[8, 8, 8, 1]]  # the lookup may draft up to the row's whole cap
    assert [b.token_ids for b in blocks] == [[7] * 8, [3] * 3, [7] * 8, [3] * 1]
    assert drafter.calls == [([1, 3], [3, 1], [1, 2])]  # capped at the drafter's k, forced counts kept
    assert drafter.budget == TreeBudget(0.1, [3, 3])  # the budget's caps: the drafter's rows, at most k
    assert p.catch_up_seconds == 0.5
    for s in seqs:
        p.postprocess(s, blocks[s.seq_id], 0, 10)
    assert lookup.calls[1:] == [("post", 0), ("post", 2)] and drafter.calls[1:] == [("post", 1), ("post", 3)]
    p.finish(seqs[0])
    assert lookup.calls[-1] == ("finish", 0) and drafter.calls[-1] == ("finish", 0)
    calls = len(drafter.calls)
    p.propose(seqs[:1], [8], [0])  # the lookup's row alone: the drafter does not run, its old figure stays out
    assert len(drafter.calls) == calls and p.catch_up_seconds == 0.0


def repetitive_prompts(vocab, n=12, seed=0):
    """Random prompts with a repeated stretch: n-gram lookup finds matches of several tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        run = [rng.randrange(1, vocab) for _ in range(rng.randint(4, 10))]
        out.append([rng.randrange(1, vocab) for _ in range(rng.randint(0, 6))] + run * 3)
    return out


@pytest.fixture(scope="module")
def dspark_dir(tmp_path_factory, target_dir):
    return make_dspark_dir(tmp_path_factory.mktemp("dspark"), target_dir)


@pytest.fixture(scope="module")
def drafters(tmp_path_factory, target_dir, draft_dir, dspark_dir):
    return {"draft": draft_dir, "dspark": dspark_dir,
            "eagle3": make_eagle3_dir(tmp_path_factory.mktemp("eagle3"), target_dir)}


@pytest.fixture(scope="module")
def plain(target_dir):
    llm = LLM(str(target_dir))
    ps = repetitive_prompts(llm.engine.vocab_size)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return llm, ps, sp, [o.token_ids for o in llm.generate(ps, sp)]


@pytest.mark.parametrize("method,lookup,seqs,blocks", [
    ("draft", "ngram", 1, None), ("draft", "ngram", 16, None), ("draft", "suffix", 16, 14),
    ("dspark", "ngram", 1, None), ("dspark", "suffix", 16, None), ("dspark", "ngram", 16, 14),
    ("eagle3", "ngram", 16, 14)])
def test_greedy_equals_plain(target_dir, drafters, plain, method, lookup, seqs, blocks):
    """Both proposers draft some rows; 14 blocks of 16 tokens for 16 sequences: preemptions."""
    llm0, ps, sp, want = plain
    llm = LLM(str(target_dir), draft=str(drafters[method]),
              spec=SpecConfig(method=method, k=3, lookup=lookup, lookup_k=6), max_num_seqs=seqs, num_kv_blocks=blocks,
              max_model_len=64)
    proposer = llm.engine.proposer
    assert isinstance(proposer, LookupFirst)
    rows = {"lookup": 0, "drafter": 0}
    drafter_propose = proposer.inner.propose

    def counting(seqs_, num_draft, num_forced=None):
        rows["drafter"] += sum(1 for n in num_draft if n)
        return drafter_propose(seqs_, num_draft, num_forced)

    proposer.inner.propose = counting
    lookup_propose = proposer.lookup.propose

    def counting_lookup(seqs_, num_draft, num_forced=None):
        out = lookup_propose(seqs_, num_draft, num_forced)
        rows["lookup"] += sum(1 for b in out if b.confidence and b.confidence[0] >= proposer.lookup_min)
        return out

    proposer.lookup.propose = counting_lookup
    outs = llm.generate(ps, sp)
    assert_equal_but_near_ties(llm0.engine.target.model, ps, [o.token_ids for o in outs], want)
    assert rows["lookup"] > 0 and rows["drafter"] > 0, rows
    st = llm.engine.stats
    assert st.accepted_tokens > 0
    assert 0 < st.lookup_rounds < st.rounds and 0 < st.lookup_accepted_tokens <= st.accepted_tokens
    if blocks:
        assert st.preemptions > 0


@pytest.mark.parametrize("method,lookup", [("draft", "ngram"), ("dspark", "suffix")])
def test_check_passes(target_dir, drafters, method, lookup, capsys):
    rc = main(["check", "--model", str(target_dir), "--method", method, "--draft", str(drafters[method]), "--k", "3",
               "--lookup", lookup, "--lookup-min", "0.5", "--samples", "300", "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in ("greedy equality", "distribution", "KV rollback", "stops inside accepted blocks"):
        assert f"PASS {name}" in out


def test_bad_input(target_dir, draft_dir, capsys):
    for kw, msg in ((dict(method="draft", lookup="prompt"), "lookup must be one of ngram, suffix"),
                    (dict(method="ngram", lookup="suffix"), "goes before a drafting method"),
                    (dict(method=None, lookup="ngram"), "goes before a drafting method"),
                    (dict(method="draft", lookup="ngram", lookup_k=65), "lookup_k"),
                    (dict(method="draft", lookup="ngram", lookup_min=1.5), "lookup_min")):
        with pytest.raises(ValueError, match=msg):
            SpecConfig(**kw)
    assert SpecConfig(method="draft", k=4, lookup="ngram", lookup_k=12).max_draft == 12
    with pytest.raises(ValueError, match="give lookup"):
        SpecConfig(method="draft", k=4, lookup_k=12)
    (c,) = [c for c in parse_configs("eagle3:k=3:lookup=suffix:lookup_k=8:lookup_min=0.6") if c.method]
    assert c.label == "eagle3:k=3:lookup=suffix:lookup_k=8:lookup_min=0.6" and c.spec.max_draft == 8
    with pytest.raises(ValueError, match="goes before a drafting method"):
        parse_configs("ngram:k=3:lookup=suffix")
    with pytest.raises(ValueError, match="--configs entries look like"):
        parse_configs("draft:k=3:lookup_min=high")
    rc = main(["generate", "--model", str(target_dir), "--method", "ngram", "--lookup", "suffix",
               "--max-tokens", "4", "def f(x):"])
    assert rc == 2 and "goes before a drafting method" in capsys.readouterr().err


@pytest.mark.parametrize("method,lookup,policy", [("dspark", "ngram", "dspark"), ("draft", "suffix", "goodput")])
def test_load_aware_policies_with_a_lookup(target_dir, drafters, plain, method, lookup, policy):
    """A load-aware policy plans up to lookup_k proposals a row and admits lookup and drafter blocks
    alike; greedy output stays plain decoding's, 4 in flight."""
    from draftwise.policies import CostModel
    from policy_helpers import COST

    llm0, ps, sp, want = plain
    cost = CostModel((0.05,) + tuple(COST.target[1:]), COST.draft)
    llm = LLM(str(target_dir), draft=str(drafters[method]), max_num_seqs=4,
              spec=SpecConfig(method=method, k=3, lookup=lookup, lookup_k=6, policy=policy, cost_model=cost))
    outs = llm.generate(ps, sp)
    assert_equal_but_near_ties(llm0.engine.target.model, ps, [o.token_ids for o in outs], want)
    assert llm.engine.stats.proposed_tokens > 0
