"""Trees from the drafters on the target's features (`--method dspark|eagle3 --tree N`): DSpark's
trees grown by its Markov head (proposers/dspark_tree.py), EAGLE-3's spine trees (a runner-up leaf
a slot), and the engine handing a drafter the feature rows of a tree's accepted path.

Greedy output equals plain decoding at 1 and 16 in flight and under preemption; the drafter's
cache equals a fresh computation over the committed tokens after rounds whose accepted path left
the tree's first nodes; each tree node's q is the Markov head's conditional on its parent's token.

The test drafters are random (few proposals accepted), so oracle subclasses also run the
drafter as ever but propose a tree of the plain greedy continuation in which the spine is
corrupted at a position that moves with the output and a sibling there holds the right token,
with the continuation below it: the accepted path goes through the sibling."""
import random

import pytest
import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.cli.main import main
from draftwise.model import load_model
from draftwise.model.dspark import load_dspark
from draftwise.proposers import DraftBlock, register_proposer
from draftwise.proposers.dspark import DSparkProposer
from draftwise.proposers.dspark_tree import grows_trees, markov_trees
from draftwise.proposers.eagle3 import Eagle3Proposer
from draftwise.proposers.tree_budget import NUM_BINS, PRIOR_WEIGHT, NodeCalibration
from test_dspark_engine import ORACLE, assert_cache_is_fresh, make_dspark_dir
from drafter_checks import assert_greedy_equals_plain, steps_checking
from test_dspark_engine import plain  # noqa: F401 (the fixture: fills ORACLE)
from test_eagle3_engine import make_eagle3_dir
from tiny_models import make_model_dir

SIBLING_PATHS: list[tuple[int, ...]] = []  # accepted paths that left the first nodes (oracle rounds)


def oracle_tree(output: list[int], j: int, n: int, vocab: int) -> DraftBlock | None:
    """n nodes after output position j: the spine output[j..] with node c corrupted, a sibling of node
    c holding output[j + c], and the output's continuation below the sibling (None: too few left)."""
    want = output[j: j + n]
    if len(want) < 2 or n < 2:
        return None
    c = (3 * j + 1) % min(n - 1, len(want))
    toks, parents = list(want[: c + 1]), list(range(-1, c))
    toks[c] = (toks[c] + 1) % vocab
    toks.append(want[c])  # the sibling, node c + 1
    parents.append(c - 1)
    for t in want[c + 1: c + 1 + n - len(toks)]:
        parents.append(len(toks) - 1)
        toks.append(t)
    return DraftBlock(toks, None, [0.5] * len(toks), parents=tuple(parents), drafting="point")


class TreeOracle:
    def propose(self, seqs, num_draft, num_forced=None):
        blocks = super().propose(seqs, num_draft, num_forced)  # the drafter runs as ever
        for i, (s, b) in enumerate(zip(seqs, blocks)):
            output = ORACLE.get(tuple(s.prompt_ids))
            if output is not None and b.token_ids and s.params.is_greedy:
                tree = oracle_tree(output, len(s.output_ids), num_draft[i], self.drafter.cfg.vocab_size)
                blocks[i] = tree or b
        return blocks

    def postprocess(self, seq, block, num_accepted, num_tokens_before):
        if block.nodes and any(node != j for j, node in enumerate(block.nodes)):
            SIBLING_PATHS.append(block.nodes)
        super().postprocess(seq, block, num_accepted, num_tokens_before)


@register_proposer("test-dspark-tree-oracle")
class DSparkTreeOracle(TreeOracle, DSparkProposer):
    pass


@register_proposer("test-eagle3-tree-oracle")
class Eagle3TreeOracle(TreeOracle, Eagle3Proposer):
    pass


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, target_dir, tokenizer, plain):  # noqa: F811
    """name -> (target, {kind: drafter dir}, plain's (llm, prompts, params, outputs)): "narrow" the
    tests' target (the drafters' PyTorch paths), "wide" one whose head is packed for the kernels
    (vocabulary 2048: DSpark's block call, EAGLE-3's greedy steps, which its trees need)."""
    d = tmp_path_factory.mktemp("pairs")
    wide = make_model_dir(d / "wide", seed=0, tokenizer=tokenizer, vocab_size=2048, layers=2, hidden=64)
    llm = LLM(str(wide))
    rng = random.Random(1)
    ps = [[rng.randrange(1, 300) for _ in range(rng.randint(1, 30))] for _ in range(20)]
    outs = [o.token_ids for o in llm.generate(ps, plain[2])]
    ORACLE.update({tuple(p): o for p, o in zip(ps, outs)})
    return {"narrow": (target_dir, {"dspark": make_dspark_dir(d / "dspark", target_dir)}, plain),
            "wide": (wide, {"dspark": make_dspark_dir(d / "wdspark", wide),
                            "eagle3": make_eagle3_dir(d / "weagle3", wide)}, (llm, ps, plain[2], outs))}


CASES = [("narrow", "dspark", 1, None), ("narrow", "dspark", 16, 14), ("wide", "dspark", 1, None),
         ("wide", "eagle3", 1, None), ("wide", "eagle3", 16, 14), ("narrow", "test-dspark-tree-oracle", 16, None),
         ("narrow", "test-dspark-tree-oracle", 16, 14), ("wide", "test-dspark-tree-oracle", 1, None),
         ("wide", "test-eagle3-tree-oracle", 1, None), ("wide", "test-eagle3-tree-oracle", 16, 14)]


@pytest.mark.parametrize("pair,method,seqs,blocks", CASES)
def test_greedy_equals_plain(pairs, pair, method, seqs, blocks):
    """c = 1 and 16; 14 blocks of 16 tokens for 16 sequences of up to 54 tokens: preemptions."""
    target, drafters, plain_outputs = pairs[pair]
    kind = "eagle3" if "eagle3" in method else "dspark"
    llm = LLM(str(target), draft=str(drafters[kind]), spec=SpecConfig(method=method, k=6, tree=2),
              max_num_seqs=seqs, num_kv_blocks=blocks, max_model_len=64)
    assert (llm.engine.proposer.kernel is not None) == (pair == "wide")
    SIBLING_PATHS.clear()
    assert_greedy_equals_plain(llm, plain_outputs, blocks)
    if "oracle" not in method:  # verified trees taught the node calibration
        tables = llm.engine.proposer.calibration.tables
        assert sum(n for kind in tables for _, n in kind) > 2 * NUM_BINS * PRIOR_WEIGHT + 20
    else:
        assert len(SIBLING_PATHS) > 10  # accepted through a sibling, the continuation below it too
        assert any(len(p) >= 2 and p[-1] == p[-2] + 1 and p[-2] != len(p) - 2 for p in SIBLING_PATHS)


@pytest.mark.parametrize("pair,method", [("narrow", "test-dspark-tree-oracle"), ("wide", "test-dspark-tree-oracle"),
                                         ("wide", "test-eagle3-tree-oracle")])
def test_drafter_cache_equals_fresh_after_sibling_paths(pairs, pair, method):
    """After rounds whose accepted path went through a sibling (and recomputes after preemption), the
    drafter's cache holds exactly the committed context: the rows of the path's nodes, written at
    the positions they were committed to."""
    target, drafters, (_, ps, _, _) = pairs[pair]
    kind = "eagle3" if "eagle3" in method else "dspark"
    llm = LLM(str(target), draft=str(drafters[kind]), spec=SpecConfig(method=method, k=6, tree=2),
              num_kv_blocks=14, max_model_len=64)
    eng = llm.engine
    fresh = load_model(target, fuse=False, load_tokenizer=False).model.eval()
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    seqs = [eng.add_request(f"r{i}", p, sp) for i, p in enumerate(ps)]
    SIBLING_PATHS.clear()

    def check(s):
        if kind == "dspark":
            assert_cache_is_fresh(eng.proposer, fresh, s)
        else:
            assert eng.proposer.cache_error(s, fresh) <= 1e-4

    assert steps_checking(eng, seqs, 60, check) > 20 and len(SIBLING_PATHS) > 5
    assert eng.stats.preemptions > 0


def test_markov_tree_nodes_are_the_conditionals_of_their_parents(target_dir, tmp_path):
    """Every node's children are the `width` most probable tokens of softmax(U_d + B(parent token)),
    parents come before children, a tree of width 1 is the block's argmax chain, and a node's
    confidence is the confidence head's at its slot after its parent's token."""
    lm = load_model(target_dir, fuse=False, load_tokenizer=False)
    drafter = load_dspark(make_dspark_dir(tmp_path, target_dir), lm.model).eval()
    assert grows_trees(drafter)
    g = drafter.cfg.block_size
    torch.manual_seed(0)
    with torch.inference_mode():
        feats = torch.randn(2, 7, len(drafter.cfg.target_feature_layers) * lm.config.hidden_size)
        anchors = torch.tensor([3, 11])
        pos = torch.arange(7).expand(2, 7)
        fused = drafter.fuse(feats)
        hidden = drafter.block_hidden(anchors[:, None], torch.full((2, 1), 7), drafter.context_kv(fused, pos), pos,
                                      fused[:, -1:])[:, 0]  # [2, g, H]
        base = drafter.head(hidden)
        chain = drafter.draw(hidden, anchors)
        (b0, _), (b1, _) = markov_trees(drafter, hidden, base, anchors.tolist(), [g, g], 1, NodeCalibration())
        assert b0.token_ids == chain.tokens[0].tolist() and b1.token_ids == chain.tokens[1].tolist()
        assert b0.parents == tuple(range(-1, g - 1))
        trees = markov_trees(drafter, hidden, base, anchors.tolist(), [9, 9], 2, NodeCalibration())
        for b, (blk, record) in enumerate(trees):
            assert 0 < len(blk.token_ids) <= 9 and blk.drafting == "point"
            depth = []
            for i, p in enumerate(blk.parents):
                assert p < i
                depth.append(0 if p < 0 else depth[p] + 1)
                prev = anchors[b] if p < 0 else torch.tensor(blk.token_ids[p])
                logits = base[b, depth[i]] + drafter.markov.step(None, prev[None], hidden[b, depth[i]][None])[1][0]
                q = torch.softmax(logits, -1)
                top2 = torch.topk(q, 2).indices.tolist()
                assert blk.token_ids[i] in top2
                assert record.qs[i] == pytest.approx(float(q[blk.token_ids[i]]), rel=1e-4)
                c = torch.sigmoid(drafter.confidence_logit(hidden[b, depth[i]][None], prev[None])
                                  / drafter.confidence_temperature(depth[i]))
                assert blk.confidence[i] == pytest.approx(float(c), rel=1e-4)
            assert max(depth) < g
            siblings = [i for i, p in enumerate(blk.parents) if blk.parents.count(p) > 1]
            assert siblings  # (width 2 with 9 nodes over a block of 5: some slot holds two)


def test_stateful_heads_draft_chains(target_dir, tmp_path):
    lm = load_model(target_dir, fuse=False, load_tokenizer=False)
    for kind, grows in (("vanilla", True), ("gated", True), ("rnn", False), ("mlp", False)):
        path = make_dspark_dir(tmp_path / kind, target_dir, markov_head_type=kind)
        assert grows_trees(load_dspark(path, lm.model)) == grows, kind


def test_dspark_tree_config_passes_check(target_dir, tmp_path, capsys):
    """`draftwise check` on a DSpark tree config: greedy equality (greedy rows' trees), the sampled
    distribution (sampled rows' chains), the drafter's cache after rollback."""
    rc = main(["check", "--model", str(target_dir), "--method", "dspark", "--draft",
               str(make_dspark_dir(tmp_path, target_dir)), "--k", "6", "--tree", "2", "--samples", "300",
               "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in ("greedy equality", "distribution", "KV rollback"):
        assert f"PASS {name}" in out
