"""Exactness of tree verification (sampling/tree.py), in the three tiers of the chain's tests.

- fractions: two point-mass siblings, by hand;
- enumeration: a depth-2 tree (two children at the root, two under each) drafted three ways, the
  committed tokens' joint distribution over three tokens (rounds repeated as the engine does)
  against the target's, to 1e-9; the same with the siblings' proposal distribution wrong (drafted
  without replacement, verified as independent draws) is biased, so the check can fail;
- statistical: `tree_rejection_sample` with a seeded generator against the enumerated round.
"""
from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch

from draftwise.sampling.tree import DraftTree, sibling_proposals, sibling_test, tree_rejection_sample, tree_sample_from_uniforms

V = 3
SHAPE = (-1, -1, 0, 0, 1, 1)  # two children at the root, two under each: node i's parent


def test_two_point_siblings_by_hand():
    """p = (1/2, 1/3, 1/6), candidates 1 then 2: 1 is accepted with 1/3; after its rejection the
    target is (3/4, 0, 1/4), 2 is accepted with 1/4; else 0: each token with exactly p."""
    p = torch.tensor([0.5, 1 / 3, 1 / 6], dtype=torch.float64)
    tree = DraftTree(parents=(-1, -1), tokens=(1, 2))
    q1, q2 = sibling_proposals(tree, None, [0, 1], V)
    a1, r1 = sibling_test(p, q1, 1)
    a2, r2 = sibling_test(r1, q2, 2)
    assert a1 == pytest.approx(1 / 3, abs=1e-15) and a2 == pytest.approx(1 / 4, abs=1e-15)
    assert r1.tolist() == pytest.approx([0.75, 0.0, 0.25], abs=1e-15) and r2.tolist() == pytest.approx([1, 0, 0])
    out = {1: Fraction(1, 3), 2: Fraction(2, 3) * Fraction(1, 4), 0: Fraction(2, 3) * Fraction(3, 4)}
    assert out == {0: Fraction(1, 2), 1: Fraction(1, 3), 2: Fraction(1, 6)}
    leaf = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)  # after either candidate: the bonus is 2
    rows = torch.stack([p, leaf, leaf])
    assert tree_sample_from_uniforms(tree, rows, None, [0.3, 0.9], 0.5) == ([0], 2)  # 0.3 < 1/3
    assert tree_sample_from_uniforms(tree, rows, None, [0.34, 0.2], 0.5) == ([1], 2)  # 0.2 < 1/4
    assert tree_sample_from_uniforms(tree, rows, None, [0.34, 0.3], 0.99) == ([], 0)  # the residual (1, 0, 0)


def _tables(seed: int):
    """Target and draft next-token distributions for every history of up to 5 tokens."""
    g = torch.Generator().manual_seed(seed)
    p, q = {}, {}
    for n in range(6):  # a round from a 2-token context reaches 5
        for h in itertools.product(range(V), repeat=n):
            p[h] = torch.softmax(2 * torch.randn(V, generator=g, dtype=torch.float64), -1)
            q[h] = torch.softmax(2 * torch.randn(V, generator=g, dtype=torch.float64), -1)
    return p, q


def _draws(drafting: str, q: torch.Tensor):
    """Every way two siblings can be drafted from q: (tokens, probability)."""
    if drafting == "point":
        top = torch.argsort(q, descending=True)[:2].tolist()
        return [(tuple(top), 1.0)]
    out = []
    for a, b in itertools.product(range(V), repeat=2):
        if drafting == "iid":
            out.append(((a, b), float(q[a] * q[b])))
        elif a != b:
            out.append(((a, b), float(q[a] * q[b] / (1 - q[a]))))
    return out


def _drafted_trees(ctx, drafting, q):
    """Every depth-2 tree the draft can propose after `ctx`: (tree, its probability)."""
    for (x0, x1), w_root in _draws(drafting, q[ctx]):
        for (y0, y1), w0 in _draws(drafting, q[ctx + (x0,)]):
            for (z0, z1), w1 in _draws(drafting, q[ctx + (x1,)]):
                yield DraftTree(SHAPE, (x0, x1, y0, y1, z0, z1), drafting), w_root * w0 * w1


def _slot_histories(tree, ctx):
    return [ctx] + [ctx + tuple(tree.tokens[j] for j in tree.path_to(i)) for i in range(tree.size)]


def _round(tree, ctx, p, q, verify_as=None):
    """The exact distribution of one round's committed tokens, by the algorithm's formulas.
    `verify_as`: verify with another drafting's proposal distributions (a wrong verifier)."""
    hist = _slot_histories(tree, ctx)
    check = DraftTree(tree.parents, tree.tokens, verify_as or tree.drafting)
    out: dict[tuple, float] = {}

    def walk(slot, prefix, mass):
        r = p[hist[slot]] / p[hist[slot]].sum()
        siblings = tree.children(slot)
        for node, q_k in zip(siblings, sibling_proposals(check, q[hist[slot]], siblings, V)):
            accept, residual = sibling_test(r, q_k, tree.tokens[node])
            walk(node + 1, prefix + (tree.tokens[node],), mass * accept)
            mass, r = mass * (1 - accept), residual
        for t in range(V):
            out[prefix + (t,)] = out.get(prefix + (t,), 0.0) + mass * float(r[t])

    walk(0, (), 1.0)
    return out


def _joint(p, q, drafting, length=3, verify_as=None, trees=None):
    """The committed stream's first `length` tokens, rounds repeated from each new context;
    `trees(ctx, q)`: the drafted trees and their probabilities (default `_drafted_trees`)."""
    memo = {}

    def from_ctx(ctx):
        if len(ctx) >= length:
            return {ctx[:length]: 1.0}
        if ctx not in memo:
            dist: dict[tuple, float] = {}
            for tree, w in (trees(ctx, q) if trees else _drafted_trees(ctx, drafting, q)):
                for seq, m in _round(tree, ctx, p, q, verify_as).items():
                    for full, m2 in from_ctx(ctx + seq).items():
                        dist[full] = dist.get(full, 0.0) + w * m * m2
            memo[ctx] = dist
        return memo[ctx]

    return from_ctx(())


def _target_joint(p, length=3):
    out = {}
    for seq in itertools.product(range(V), repeat=length):
        prob = 1.0
        for i, t in enumerate(seq):
            prob *= float(p[seq[:i]][t])
        out[seq] = prob
    return out


def _tv(a, b):
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


@pytest.mark.parametrize("drafting,seed", [("iid", 0), ("distinct", 0), ("distinct", 1), ("point", 0), ("point", 1)])
def test_a_depth_two_tree_commits_the_targets_distribution(drafting, seed):
    p, q = _tables(seed)
    got = _joint(p, q, drafting)
    assert sum(got.values()) == pytest.approx(1.0, abs=1e-12)
    assert _tv(got, _target_joint(p)) <= 1e-9


def test_siblings_verified_with_the_wrong_proposal_distribution_are_biased():
    """Drafted without replacement but verified as independent draws (the second sibling's q not
    renormalised): the enumeration sees the bias, so the exact test above could fail."""
    p, q = _tables(0)
    assert _tv(_joint(p, q, "distinct", verify_as="iid"), _target_joint(p)) > 1e-3


def _distinct(q, taken=()):
    """Each next draw from q without replacement of `taken`: (token, its probability)."""
    left = 1.0 - sum(float(q[t]) for t in taken)
    return [(x, float(q[x]) / left) for x in range(V) if x not in taken]


def _adaptive_trees(ctx, q, biased=False):
    """A sampled tree grown as draft_tree_sampled.py grows one: where the next draw happens depends
    on the tokens drawn before it. At the root x0; x0 == 0: a second root draw x1 and stop;
    else x0 is fed and y0 drawn under it; y0 == 1: a second root draw after x0's subtree, else a
    second draw under x0. `biased`: a first root draw equal to 2 is dropped for the next one (a
    draw kept or not by its own token: a selection verification cannot undo)."""
    for x0, w0 in _distinct(q[ctx]):
        if x0 == 0 or (biased and x0 == 2):
            for x1, w1 in _distinct(q[ctx], (x0,)):
                tree = DraftTree((-1,), (x1,), "distinct") if x0 == 2 else DraftTree((-1, -1), (x0, x1), "distinct")
                yield tree, w0 * w1
            continue
        for y0, w1 in _distinct(q[ctx + (x0,)]):
            if y0 == 1:
                for x1, w2 in _distinct(q[ctx], (x0,)):
                    yield DraftTree((-1, 0, -1), (x0, y0, x1), "distinct"), w0 * w1 * w2
            else:
                for y1, w2 in _distinct(q[ctx + (x0,)], (y0,)):
                    yield DraftTree((-1, 0, 0), (x0, y0, y1), "distinct"), w0 * w1 * w2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_tree_whose_shape_follows_earlier_draws_commits_the_targets_distribution(seed):
    """Draws without replacement whose number and place depend on earlier draws (and a sibling
    tried after an earlier sibling's subtree was drawn) stay exact; dropping a draw by its own
    token does not."""
    p, q = _tables(seed)
    got = _joint(p, q, "distinct", trees=_adaptive_trees)
    assert sum(got.values()) == pytest.approx(1.0, abs=1e-12)
    assert _tv(got, _target_joint(p)) <= 1e-9
    biased = _joint(p, q, "distinct", trees=lambda ctx, q: _adaptive_trees(ctx, q, biased=True))
    assert _tv(biased, _target_joint(p)) > 1e-3


@pytest.mark.parametrize("drafting", ["iid", "point"])
def test_the_sampler_follows_the_enumerated_round(drafting):
    """One fixed tree, 6,000 seeded rounds of `tree_rejection_sample`: frequencies of each
    committed sequence against the enumeration (chi-square, df < 40, critical value at 1e-4)."""
    p, q = _tables(2)
    tree = next(t for t, _ in _drafted_trees((), drafting, q))
    hist = _slot_histories(tree, ())
    target = torch.stack([p[h] for h in hist])
    draft = torch.stack([q[h] for h in hist]) if drafting != "point" else None
    expect = _round(tree, (), p, q)
    g = torch.Generator().manual_seed(7)
    n = 6_000
    counts: dict[tuple, int] = {}
    for _ in range(n):
        path, token = tree_rejection_sample(tree, target, draft, g)
        seq = tuple(tree.tokens[i] for i in path) + (token,)
        counts[seq] = counts.get(seq, 0) + 1
    assert set(counts) <= {s for s, m in expect.items() if m > 0}
    chi2 = sum((counts.get(s, 0) - n * m) ** 2 / (n * m) for s, m in expect.items() if n * m >= 5)
    assert chi2 < 73.4, (chi2, len(expect))


def test_greedy_follows_the_targets_argmax_down_the_tree():
    p, q = _tables(3)
    ctx = ()
    best0 = int(p[ctx].argmax())
    best1 = int(p[(best0,)].argmax())
    other = (best0 + 1) % V
    tree = DraftTree((-1, -1, 1, 1), (other, best0, (best1 + 1) % V, best1))
    hist = _slot_histories(tree, ctx)
    target = torch.stack([p[h] for h in hist])
    path, token = tree_rejection_sample(tree, target, None, greedy=True)
    assert path == [1, 3] and token == int(p[(best0, best1)].argmax())
    assert tree_rejection_sample(DraftTree((-1,), (other,)), target[:2], None, greedy=True) == ([], best0)


def test_a_malformed_tree_is_refused():
    with pytest.raises(ValueError, match="parent"):
        DraftTree((0,), (1,))
    with pytest.raises(ValueError, match="one parent per token"):
        DraftTree((-1,), (1, 2))
    with pytest.raises(ValueError, match="draft_probs"):
        tree_sample_from_uniforms(DraftTree((-1,), (1,), "iid"), torch.ones(2, V) / V, None, [0.5], 0.5)
