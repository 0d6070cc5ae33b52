"""benchmarks/tree_headroom.py's per-slot rates against brute force over every pair of draws."""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from tree_headroom import coverage, cut_bound, rrs_two, select_two  # noqa: E402


def pairs(q):
    """(x1, x2, probability) of two draws without replacement."""
    v = len(q)
    for x1, x2 in itertools.permutations(range(v), 2):
        yield x1, x2, float(q[x1] * q[x2] / (1 - q[x1]))


def rrs_brute(p, q):
    """P(accepted) of recursive rejection over (x1, x2), by the definition."""
    resid = (p - q).clamp(min=0)
    acc = 0.0
    for x1, x2, w in pairs(q):
        a1 = min(1.0, float(p[x1] / q[x1]))
        q2 = q.clone()
        q2[x1] = 0
        q2 = q2 / q2.sum()
        p1 = resid / resid.sum() if resid.sum() > 0 else p
        a2 = min(1.0, float(p1[x2] / q2[x2]))
        acc += w * (a1 + (1 - a1) * a2)
    return acc


def best_flow(p, q):
    """The optimal acceptance of any verification of the pair: min over all token sets H of
    p(not H) + P(a draw in H) (max-flow min-cut, brute force over every H)."""
    v, best = len(p), float("inf")
    for m in range(v + 1):
        for h in itertools.combinations(range(v), m):
            hit = sum(w for x1, x2, w in pairs(q) if x1 in h or x2 in h)
            best = min(best, float(p.sum() - p[list(h)].sum()) + hit)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_rates_match_brute_force_and_are_ordered(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(5, generator=g, dtype=torch.float64), 0)
    q = torch.softmax(2 * torch.randn(5, generator=g, dtype=torch.float64), 0)
    cov = sum(torch.nn.functional.one_hot(torch.tensor(x), 5).double() * w
              for x1, x2, w in pairs(q) for x in (x1, x2))
    assert torch.allclose(coverage(q), cov)
    assert rrs_two(p, q) == pytest.approx(rrs_brute(p, q), abs=1e-12)
    one = float(torch.minimum(p, q).sum())
    best = best_flow(p, q)
    # the threshold sets' cut bounds the optimum from above, and every rule stays below the optimum;
    # recursive rejection's first step is one draw's
    assert best - 1e-12 <= cut_bound(p, q) <= float(torch.minimum(p, coverage(q)).sum()) + 1e-12
    assert one - 1e-12 <= rrs_two(p, q) <= best + 1e-12
    assert select_two(p, q, p / q) <= best + 1e-12
    key = p / q  # the kept draw's marginal, by its definition
    r = torch.zeros(5, dtype=torch.float64)
    for x1, x2, w in pairs(q):
        r[x1 if key[x1] > key[x2] else x2] += w
    assert select_two(p, q, key) == pytest.approx(float(torch.minimum(p, r).sum()), abs=1e-12)


def test_greedy_rates_follow_the_targets_argmax():
    from tree_headroom import greedy_rates

    p = torch.tensor([0.1, 3.0, 1.0], dtype=torch.float64)  # the target keeps token 1
    assert greedy_rates(p, torch.tensor([0.0, 2.0, 1.0])) == {
        "argmax of q is the target's": 1.0, "runner-up of q is the target's": 0.0, "either": 1.0}
    assert greedy_rates(p, torch.tensor([2.0, 1.0, 0.0]))["runner-up of q is the target's"] == 1.0
    assert greedy_rates(p, torch.tensor([2.0, 0.0, 1.0]))["either"] == 0.0
