"""Rejection sampler and `verify`, exact tier: fractions, exhaustive enumeration, greedy tables,
determinism.

p is the target, q the draft. The enumeration runs the sampler's deterministic core
(`rejection_sample_from_uniforms`), and `verify` (the engine's boundary: flat processed logits in)
with the same uniforms, once per branch, with uniforms chosen inside that branch, and weighs each
branch with the sampler's own formulas (`accept_probability`, `residual_distribution`).
"""
import itertools
from fractions import Fraction

import pytest
import torch

from draftwise.sampling import (
    accept_probability,
    categorical_from_uniform,
    VerifyMetadata,
    rejection_sample,
    rejection_sample_from_uniforms,
    residual_distribution,
    verify,
)

# --------------------------------------------------------------------------- (a) exact fractions


def test_two_symbol_example_exactly():
    """p = (1/4, 3/4), q = (1/2, 1/2): the sampler itself, driven over a grid of uniforms,
    commits A with probability exactly 1/4 = p(A). Dyadic numbers keep float64 exact, and every
    threshold (accept A with 1/2; the residual (0, 1); the bonus p (1/2, 1/2)) falls on the 1/8
    grid, so the midpoint of each cell stands for the whole cell."""
    p = torch.tensor([[[0.25, 0.75], [0.5, 0.5]]], dtype=torch.float64)  # [1, K+1, V]
    q = torch.tensor([[[0.5, 0.5]]], dtype=torch.float64)  # [1, K, V]
    grid = [(i + 0.5) / 8 for i in range(8)]
    first = [Fraction(0), Fraction(0)]
    accepted = {0: 0, 1: 0}
    for x, ua, ur in itertools.product(range(2), grid, grid):
        toks, acc = rejection_sample_from_uniforms(torch.tensor([[x]]), q, p, torch.tensor([[ua]], dtype=torch.float64),
                                                   torch.tensor([ur], dtype=torch.float64))
        first[int(toks[0, 0])] += Fraction(1, 2) * Fraction(1, 64)  # q(x) * the cell's measure
        accepted[x] += int(acc[0])
    assert accepted == {0: 32, 1: 64}  # min(1, p/q): 1/2 for A, 1 for B
    assert first == [Fraction(1, 4), Fraction(3, 4)]


def test_two_symbol_example_with_the_samplers_formulas():
    p = torch.tensor([0.6, 0.4], dtype=torch.float32)
    q = torch.tensor([0.8, 0.2], dtype=torch.float32)
    assert residual_distribution(p, q).tolist() == [0.0, 1.0]
    a = accept_probability(p, q)
    assert a[1].item() == 1.0
    assert abs(a[0].item() - 0.75) < 1e-7
    # Point-mass draft on A: accept with p(A); the residual is p with A zeroed.
    assert abs(accept_probability(p[:1], torch.ones(1)).item() - 0.6) < 1e-7
    assert residual_distribution(p, torch.tensor([1.0, 0.0])).tolist() == [0.0, 1.0]


def test_categorical_from_uniform_never_draws_zero_weight_tokens():
    w = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 5, dtype=torch.float64)
    u = torch.tensor([0.0, 0.49, 0.5, 0.75, 1.0 - 2.0**-53], dtype=torch.float64)
    assert categorical_from_uniform(w, u).tolist() == [1, 1, 3, 3, 3]
    # Unnormalised weights; u * total rounding up to total falls back to the last positive token.
    w = torch.tensor([[3.0, 1.0, 0.0]], dtype=torch.float64)
    assert categorical_from_uniform(w, torch.tensor([0.8])).tolist() == [1]
    assert categorical_from_uniform(w, torch.tensor([1.0])).tolist() == [1]


# --------------------------------------------------------------------------- (b) exhaustive enumeration

V = 5


def _table(salt: int, history: tuple, zeros: bool) -> torch.Tensor:
    """A fixed random distribution over V tokens for each history (a stand-in for a model)."""
    seed = salt
    for t in history:
        seed = seed * 31 + t + 1
    g = torch.Generator().manual_seed(seed % (2**61))
    w = torch.rand(V, generator=g, dtype=torch.float64) ** 2
    if zeros:  # some tokens impossible, so supports of p and q differ
        w[torch.rand(V, generator=g) < 0.3] = 0.0
        if w.sum() == 0:
            w[int(torch.randint(V, (1,), generator=g))] = 1.0
    return w / w.sum()


def target(h):
    return _table(1, h, zeros=True)


def draft(h):
    return _table(2, h, zeros=True)


def point_proposal(h):
    return (sum(h) * 7 + 3 * len(h) + 1) % V  # a deterministic proposer, like n-gram lookup


def target_joint(horizon: int) -> dict:
    out = {}
    for y in itertools.product(range(V), repeat=horizon):
        pr = 1.0
        for i in range(horizon):
            pr *= target(y[:i])[y[i]].item()
        if pr > 0:
            out[y] = pr
    return out


def extend_with_target(prefix: tuple, weight: float, horizon: int, acc: dict):
    if len(prefix) == horizon:
        acc[prefix] = acc.get(prefix, 0.0) + weight
        return
    p = target(prefix)
    for t in range(V):
        if p[t] > 0:
            extend_with_target(prefix + (t,), weight * p[t].item(), horizon, acc)


def enumerate_branches(width: int, n: int, point_mass: bool):
    """Every (draft path, number accepted, last token) branch with positive probability."""
    rows = []  # (draft ids [width], q [width, V], p [width+1, V], u_accept [width], u_recover, weight, expected)
    paths = [tuple(point_proposal_path(n))] if point_mass else itertools.product(range(V), repeat=n)
    for x in paths:
        x = tuple(x)
        qs = [torch.nn.functional.one_hot(torch.tensor(x[j]), V).double() if point_mass else draft(x[:j])
              for j in range(n)]
        ps = [target(x[:j]) for j in range(n + 1)]
        w_path = 1.0
        for j in range(n):
            w_path *= qs[j][x[j]].item()
        if w_path == 0:
            continue
        a = [accept_probability(ps[j][x[j]], qs[j][x[j]]).item() for j in range(n)]
        for acc in range(n + 1):
            w = w_path
            for j in range(acc):
                w *= a[j]
            if acc < n:
                w *= 1.0 - a[acc]
                last = residual_distribution(ps[acc], qs[acc])
            else:
                last = ps[n]
            if w == 0:
                continue
            # accepted: u = 0; rejected: midway between the acceptance probability and 1 (robust to
            # the last-bit rounding of softmax(log p) in `verify`)
            u_rej = [(a[acc] + 1.0) / 2] if acc < n else []
            u_acc = [0.0] * acc + u_rej + [0.5] * (width - acc - 1 if acc < n else width - n)
            cdf = torch.cumsum(last, 0)
            for t in range(V):
                if last[t] == 0:
                    continue
                lo = cdf[t - 1].item() if t > 0 else 0.0
                u_rec = (lo + cdf[t].item()) / 2
                ids = list(x) + [-1] * (width - n)  # padding beyond n is garbage on purpose
                q_rows = torch.stack(qs + [torch.full((V,), 0.2, dtype=torch.float64)] * (width - n)) if width else torch.zeros(0, V)
                p_rows = torch.stack(ps + [torch.full((V,), 0.2, dtype=torch.float64)] * (width - n))
                rows.append((ids, q_rows, p_rows, u_acc, u_rec, w * last[t].item(), x[:acc] + (t,)))
    return rows


def point_proposal_path(n):
    h = ()
    for _ in range(n):
        h = h + (point_proposal(h),)
    return h


@pytest.mark.parametrize(
    "width, n, point_mass",
    [(1, 1, False), (2, 2, False), (3, 3, False), (3, 1, False), (3, 0, False), (2, 2, True), (3, 3, True)],
)
def test_enumeration_matches_target_distribution(width, n, point_mass):
    rows = enumerate_branches(width, n, point_mass)
    b = len(rows)
    ids = torch.tensor([r[0] for r in rows], dtype=torch.long).reshape(b, width)
    q = torch.stack([r[1] for r in rows]).reshape(b, width, V)
    p = torch.stack([r[2] for r in rows])
    u_acc = torch.tensor([r[3] for r in rows], dtype=torch.float64).reshape(b, width)
    u_rec = torch.tensor([r[4] for r in rows], dtype=torch.float64)
    committed, num_accepted = rejection_sample_from_uniforms(
        ids, None if point_mass else q, p, u_acc, u_rec,
        num_draft=torch.full((b,), n, dtype=torch.long),
    )
    # the same branches through `verify`: flat processed logits (log p) and flat q, n proposals each
    meta = VerifyMetadata.build([r[0][:n] for r in rows], [False] * b)
    p_logits = torch.log(p[:, : n + 1]).reshape(b * (n + 1), V)  # [N, V], -inf where p = 0
    q_flat = None if point_mass else q[:, :n].reshape(b * n, V)
    res = verify(p_logits, meta, q_flat, draws=(u_acc[:, :n], u_rec))
    assert bool(res.valid.all())
    assert torch.equal(res.num_accepted, num_accepted)
    assert torch.equal(res.committed, committed[:, : n + 1])
    # Each branch's uniforms lead the implementation down exactly that branch.
    dist = {}
    for i, r in enumerate(rows):
        expected = r[6]
        assert num_accepted[i].item() == len(expected) - 1
        assert committed[i].tolist() == list(expected) + [-1] * (width + 1 - len(expected))
        extend_with_target(expected, r[5], n + 1, dist)
    want = target_joint(n + 1)
    assert abs(sum(dist.values()) - 1.0) < 1e-12
    tv = 0.5 * sum(abs(dist.get(y, 0.0) - want.get(y, 0.0)) for y in set(dist) | set(want))
    assert tv <= 1e-9


# --------------------------------------------------------------------------- (c) greedy and deterministic tables


def peaked(argmaxes, vocab=6):
    """[len, vocab] distributions with the given argmax per position."""
    p = torch.full((len(argmaxes), vocab), 0.1)
    for j, a in enumerate(argmaxes):
        p[j, a] = 0.5
    return p / p.sum(-1, keepdim=True)


def greedy_call(draft_ids, target_argmax, draft_probs=None, num_draft=None):
    b = len(draft_ids)
    p = torch.stack([peaked(t) for t in target_argmax])
    return rejection_sample(
        torch.tensor(draft_ids), draft_probs, p, None,
        num_draft=None if num_draft is None else torch.tensor(num_draft),
        is_greedy=torch.ones(b, dtype=torch.bool),
    )


def test_greedy_all_accepted_gives_bonus():
    c, n = greedy_call([[1, 2, 3]], [[1, 2, 3, 4]])
    assert c.tolist() == [[1, 2, 3, 4]] and n.tolist() == [3]


def test_greedy_first_mismatch_commits_target_token_and_pads():
    c, n = greedy_call([[1, 2, 3], [5, 2, 3]], [[1, 0, 3, 4], [1, 2, 3, 4]])
    assert c.tolist() == [[1, 0, -1, -1], [1, -1, -1, -1]]
    assert n.tolist() == [1, 0]


def test_greedy_num_draft_zero_is_plain_decoding():
    c, n = greedy_call([[1, 2]], [[4, 2, 3]], num_draft=[0])
    assert c.tolist() == [[4, -1, -1]] and n.tolist() == [0]


def test_greedy_mixed_num_draft_per_row():
    c, n = greedy_call(
        [[1, 2, 3], [1, 2, 9], [1, 2, 3], [0, 0, 0]],
        [[1, 2, 3, 4], [1, 2, 5, 4], [1, 5, 3, 4], [2, 3, 4, 5]],
        num_draft=[3, 2, 1, 0],
    )
    assert c.tolist() == [[1, 2, 3, 4], [1, 2, 5, -1], [1, 5, -1, -1], [2, -1, -1, -1]]
    assert n.tolist() == [3, 2, 1, 0]


def test_greedy_ignores_draft_probs_and_ties_take_lowest_index():
    q = torch.softmax(torch.randn(1, 2, 6), -1)
    c, n = greedy_call([[1, 2]], [[1, 2, 3]], draft_probs=q)
    assert c.tolist() == [[1, 2, 3]]
    p = torch.tensor([[[0.1, 0.4, 0.4, 0.1], [0.25, 0.25, 0.25, 0.25]]])
    c, n = rejection_sample(torch.tensor([[2]]), None, p, None, is_greedy=torch.tensor([True]))
    assert c.tolist() == [[1, -1]] and n.tolist() == [0]


def test_verify_greedy_rows_match_the_batched_greedy_sampler():
    """`verify`'s greedy rows (argmax of the flat logits, no softmax) equal `rejection_sample` with
    is_greedy, row by row, in ragged batches."""
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        b = int(torch.randint(1, 6, (1,), generator=g))
        ks = torch.randint(0, 5, (b,), generator=g).tolist()
        logits, drafts, want = [], [], []
        for k in ks:
            row = torch.randn(k + 1, 6, generator=g) * 3  # [k+1, V]
            target_argmax = row.argmax(-1).tolist()
            # proposals that follow the argmax for a random prefix, then random tokens
            n_ok = int(torch.randint(0, k + 1, (1,), generator=g))
            draft = target_argmax[:n_ok] + torch.randint(0, 6, (k - n_ok,), generator=g).tolist()
            c, n = rejection_sample(torch.tensor([draft], dtype=torch.long).reshape(1, k), None,
                                    torch.softmax(row, -1)[None], None, is_greedy=torch.tensor([True]))
            want.append((c[0, : int(n[0]) + 1].tolist(), int(n[0])))
            assert int(n[0]) >= n_ok
            logits.append(row)
            drafts.append(draft)
        res = verify(torch.cat(logits), VerifyMetadata.build(drafts, [True] * b), None)
        assert [(res.tokens(i), int(res.num_accepted[i])) for i in range(b)] == want


def test_verify_metadata_offsets_and_padding():
    meta = VerifyMetadata.build([[5, 6, 7], [], [9]], [False, True, False])
    assert meta.num_draft.tolist() == [3, 0, 1]
    assert meta.cu_num_logits.tolist() == [0, 4, 5, 7]
    assert meta.cu_num_draft.tolist() == [0, 3, 3, 4]
    assert meta.draft_token_ids.tolist() == [[5, 6, 7], [-1, -1, -1], [9, -1, -1]]
    assert meta.logits_index().tolist() == [[0, 1, 2, 3], [4, 4, 4, 4], [5, 6, 6, 6]]
    assert meta.draft_index().tolist() == [[0, 1, 2], [3, 3, 3], [3, 3, 3]]
    last_empty = VerifyMetadata.build([[5, 6], []], [False, False])  # rows without proposals stay in range
    assert last_empty.draft_index().tolist() == [[0, 1], [1, 1]]


def test_verify_fails_only_rows_with_unusable_distributions():
    """A NaN row (e.g. a temperature whose float32 is 0) or a row with every token masked commits
    nothing and is flagged; the other rows are decided as if alone."""
    g = torch.Generator().manual_seed(0)
    good = torch.randn(3, 6, generator=g)
    nan = torch.full((2, 6), float("nan"))
    masked = torch.full((1, 6), -torch.inf)
    meta = VerifyMetadata.build([[1, 2], [3], []], [True, False, True])
    res = verify(torch.cat([good, nan, masked]), meta, None, [None, torch.Generator().manual_seed(1), None])
    assert res.valid.tolist() == [True, False, False]
    assert res.tokens(1) == [] and res.tokens(2) == []
    alone = verify(good, VerifyMetadata.build([[1, 2]], [True]), None)
    assert res.tokens(0) == alone.tokens(0)


def test_random_rows_with_deterministic_tables():
    # p one-hot: a proposal with p(x) = 1 is always accepted, with p(x) = 0 always rejected.
    p = torch.nn.functional.one_hot(torch.tensor([[1, 2, 3], [1, 2, 3]]), 5).float()  # [2, 3, 5]
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        c, n = rejection_sample(torch.tensor([[1, 2], [1, 4]]), None, p, g)
        assert c.tolist() == [[1, 2, 3], [1, 2, -1]] and n.tolist() == [2, 1]
        q = torch.softmax(torch.randn(2, 2, 5, generator=g), -1)
        c, n = rejection_sample(torch.tensor([[1, 2], [1, 4]]), q, p, g)
        assert c.tolist() == [[1, 2, 3], [1, 2, -1]] and n.tolist() == [2, 1]


def test_mixed_greedy_and_random_rows_and_inputs_untouched():
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(4, 3, 7, generator=g), -1)
    q = torch.softmax(torch.randn(4, 2, 7, generator=g), -1)
    ids = torch.randint(0, 7, (4, 2), generator=g)
    copies = [t.clone() for t in (ids, q, p)]
    c, n = rejection_sample(ids, q, p, g, is_greedy=torch.tensor([True, False, True, False]))
    for t, before in zip((ids, q, p), copies):
        assert torch.equal(t, before)
    for row in (0, 2):  # greedy rows agree with a greedy-only call
        c1, n1 = rejection_sample(ids[row:row + 1], q[row:row + 1], p[row:row + 1], None,
                                  is_greedy=torch.tensor([True]))
        assert torch.equal(c[row], c1[0]) and n[row] == n1[0]
    valid = torch.arange(3)[None, :] <= n[:, None]
    assert bool(((c >= 0) == valid).all())


def test_shape_errors():
    p = torch.full((1, 3, 4), 0.25)
    with pytest.raises(ValueError, match="num_draft"):
        rejection_sample(torch.zeros(1, 2, dtype=torch.long), None, p, None, num_draft=torch.tensor([3]))
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(torch.zeros(1, 3, dtype=torch.long), None, p, None)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.zeros(1, 2, dtype=torch.long), torch.full((1, 2, 5), 0.2), p, None)


# --------------------------------------------------------------------------- (d) seeded determinism


def _random_batch(b, k, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(b, k + 1, vocab, generator=g), -1)
    q = torch.softmax(torch.randn(b, k, vocab, generator=g), -1)
    ids = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(b, k)
    return ids, q, p


def test_same_seed_same_output():
    ids, q, p = _random_batch(16, 4, 50, seed=0)
    runs = [rejection_sample(ids, q, p, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    gens = lambda: [torch.Generator().manual_seed(100 + i) for i in range(16)]
    a = rejection_sample(ids, q, p, gens())
    b = rejection_sample(ids, q, p, gens())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    others = [rejection_sample(ids, q, p, torch.Generator().manual_seed(s))[0] for s in range(8, 16)]
    assert any(not torch.equal(runs[0][0], o) for o in others)  # the seed matters


def test_per_row_generator_is_independent_of_the_rest_of_the_batch():
    vocab = 50
    ids, q, p = _random_batch(1, 3, vocab, seed=1)  # the row under test, 3 proposals
    for trial in range(5):
        results = []
        for other_b, width, pos in ((0, 3, 0), (5, 3, 2), (7, 6, 4)):
            oi, oq, op = _random_batch(other_b + 1, width, vocab, seed=10 + other_b + trial)
            oi, oq, op = oi.clone(), oq.clone(), op.clone()
            oi[pos, :3], oq[pos, :3], op[pos, :4] = ids[0], q[0], p[0]
            num_draft = torch.randint(0, width + 1, (other_b + 1,))
            num_draft[pos] = 3
            gens = [torch.Generator().manual_seed(1000 + i) for i in range(other_b + 1)]
            gens[pos] = torch.Generator().manual_seed(42 + trial)
            if other_b:
                gens[0] = None  # torch's default generator for another row
            c, n = rejection_sample(oi, oq, op, gens, num_draft=num_draft)
            results.append((c[pos, :4].tolist(), n[pos].item()))
        assert results[0] == results[1] == results[2]


def test_greedy_rows_draw_no_randomness():
    ids, q, p = _random_batch(2, 2, 20, seed=2)
    g0, g1 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)
    state0 = g0.get_state()
    rejection_sample(ids, q, p, [g0, g1], is_greedy=torch.tensor([True, False]))
    assert torch.equal(g0.get_state(), state0)
    assert not torch.equal(g1.get_state(), torch.Generator().manual_seed(6).get_state())


def test_argmax_path_decides_as_verify_for_greedy_rows():
    """`verify_argmax` (the engine's path for greedy rows with nothing to process) commits exactly
    what `verify` commits for greedy rows: random drafts, half of them right, exact ties in the
    logits (the first maximal id wins in both), rows of NaN, with one NaN, or every token masked."""
    from draftwise.sampling.verify import VerifyMetadata, verify, verify_argmax

    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        b, vocab = int(torch.randint(1, 6, (1,), generator=gen)), 7
        nd = torch.randint(0, 5, (b,), generator=gen).tolist()
        logits = torch.randint(-3, 3, (sum(n + 1 for n in nd), vocab), generator=gen).float()  # ties often
        am = logits.argmax(-1).tolist()
        drafts, base = [], 0
        for n in nd:
            d = [am[base + j] if torch.rand(1, generator=gen) < 0.6 else int(torch.randint(0, vocab, (1,), generator=gen))
                 for j in range(n)]
            drafts.append(d)
            base += n + 1
        if trial % 7 == 0:
            logits[int(torch.randint(0, logits.shape[0], (1,), generator=gen))] = float("nan")
        if trial % 11 == 0:
            logits[int(torch.randint(0, logits.shape[0], (1,), generator=gen))] = -torch.inf
        if trial % 5 == 0:  # one NaN among finite logits
            logits[int(torch.randint(0, logits.shape[0], (1,), generator=gen)), int(torch.randint(0, vocab, (1,), generator=gen))] = float("nan")
        want = verify(logits.clone(), VerifyMetadata.build(drafts, [True] * b), None)
        toks, acc, valid = verify_argmax(logits, drafts)
        assert valid == want.valid.tolist()
        assert acc == [a if v else 0 for a, v in zip(want.num_accepted.tolist(), valid)]
        assert toks == [want.tokens(i) for i in range(b)]
    with pytest.raises(ValueError, match="rows"):
        verify_argmax(torch.zeros(3, 4), [[1]])
