"""The `dspark` policy: DSpark's prefix scheduler (Algorithm 1) and why its early stop keeps the
output exact.

- Appendix A of the paper in exact fractions: target (7/10, 3/10), draft (1/2, 1/2), SPS(1) = 1,
  SPS(2) = 1/2, SPS(3) = 9/20, c_1 = 4/5 and c_2 = 9/10 after A, 0 after B. The early-stopped
  scheduler emits (7/10, 3/10); the retrospective one (search past the drop, keep the best
  prefix) admits x_1 only when x_1 = A and emits (17/20, 3/20).
- Two rows whose admissions read each other's drafts: the joint output is the product of the
  targets, exactly (the early stop reveals a proposal only once it is admitted).
- The policy through its interface: the exhaustive enumeration of tests/test_policy_causal.py
  (TV <= 1e-9, admitted lengths that vary), optimality for a linear cost, load awareness, a
  useless drafter, greedy equality through the engine, and `draftwise check`: PASS for dspark,
  FAIL for Appendix A's retrospective scheduler registered as a test policy.
"""
import itertools
from fractions import Fraction as F
from types import SimpleNamespace

import pytest
import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.policies import CostModel, Policy, StepTiming, policy_class, register_policy
from draftwise.policies.dspark import DSparkPolicy, prefix_schedule
from draftwise.policies.goodput import GoodputConfig
from draftwise.proposers import DraftBlock
from test_policy_causal import COST, PROMPTS, enumerate_policy, never_right, rows

FROZEN = GoodputConfig(learn_step_cost=False)


def retrospective_schedule(survivals, step_seconds):
    """Algorithm 1 without its early stop (test only, NOT causal): the whole greedy path is
    searched and its best prefix kept, so the decision on x_j reads c_{j+1}, a function of x_j."""
    rows_ = len(survivals)
    order = sorted(((a, j, r) for r, row in enumerate(survivals) for j, a in enumerate(row) if a > 0),
                   key=lambda t: (-t[0], t[1], t[2]))
    tokens, expected = rows_, F(rows_)  # (exact with fractions; a float survival makes it float)
    best, best_n = expected / step_seconds(tokens), 0
    for n, (a, _, _) in enumerate(order):
        tokens, expected = tokens + 1, expected + a
        if expected / step_seconds(tokens) > best:
            best, best_n = expected / step_seconds(tokens), n + 1
    lengths = [0] * rows_
    for a, j, r in order[:best_n]:
        lengths[r] = max(lengths[r], j + 1)
    return lengths


# --------------------------------------------------------------------------- Appendix A, exactly

P1, Q1 = [F(7, 10), F(3, 10)], [F(1, 2), F(1, 2)]  # p and q at the first position over {A, B}
C1, C2 = F(4, 5), {0: F(9, 10), 1: F(0)}  # c_1 before drafting; c_2 after x_1 = A / B
SPS = {1: F(1), 2: F(1, 2), 3: F(9, 20)}


def seconds_from(sps):
    return lambda tokens: 1 / sps[tokens]


def first_token(schedule) -> list[F]:
    """P(first emitted token) when x_1 ~ q is verified iff the schedule admits it (else the target
    samples directly): accepted with min(1, p/q), else the residual max(p - q, 0), normalised."""
    out = [F(0), F(0)]
    residual = [max(p - q, F(0)) for p, q in zip(P1, Q1)]
    for x in range(2):
        length = schedule([[C1, C1 * C2[x]]])[0]
        if length == 0:
            for y in range(2):
                out[y] += Q1[x] * P1[y]
            continue
        accept = min(F(1), P1[x] / Q1[x])
        out[x] += Q1[x] * accept
        for y in range(2):
            out[y] += Q1[x] * (1 - accept) * residual[y] / sum(residual)
    return out


def test_appendix_a_arithmetic():
    """The paper's figures from its setup: a_1 = sum_x min(p, q) = 4/5; Theta_0 = 1, Theta_1 = 9/10;
    Theta_2 = 567/500 (1.134) after A, 81/100 (0.81) after B."""
    assert sum(min(p, q) for p, q in zip(P1, Q1)) == C1
    theta = lambda *a: (1 + sum(a)) * SPS[1 + len(a)]  # noqa: E731
    assert (theta(), theta(C1)) == (1, F(9, 10))
    assert theta(C1, C1 * C2[0]) == F(567, 500) and theta(C1, C1 * C2[1]) == F(81, 100)


def test_appendix_a_early_stop_is_exact_and_retrospective_is_not():
    seconds = seconds_from(SPS)
    early = lambda s: prefix_schedule(s, seconds)  # noqa: E731
    retro = lambda s: retrospective_schedule(s, seconds)  # noqa: E731
    assert [early([[C1, C1 * C2[x]]]) for x in range(2)] == [[0], [0]]  # Theta_1 < Theta_0: stop
    assert [retro([[C1, C1 * C2[x]]]) for x in range(2)] == [[2], [0]]  # x_1 = A admitted, B not
    assert first_token(early) == [F(7, 10), F(3, 10)]
    assert first_token(retro) == [F(17, 20), F(3, 20)]


def test_appendix_a_when_the_first_proposal_pays():
    """SPS(2) = 3/5 makes Theta_1 = 27/25 > 1: x_1 is admitted whatever it is, and the output is
    still the target's (exactness is not only the trivial "verify nothing")."""
    sps = {**SPS, 2: F(3, 5)}
    early = lambda s: prefix_schedule(s, seconds_from(sps))  # noqa: E731
    assert [early([[C1, C1 * C2[x]]])[0] for x in range(2)] == [2, 1]
    assert first_token(early) == P1


# --------------------------------------------------------------------------- two rows, jointly exact

def two_row_tables():
    """Per row, p and q over {0, 1} by history (exact fractions); q's confidence after x_1 varies."""
    p = [{(): [F(7, 10), F(3, 10)], (0,): [F(1, 2), F(1, 2)], (1,): [F(1, 5), F(4, 5)]},
         {(): [F(2, 5), F(3, 5)], (0,): [F(9, 10), F(1, 10)], (1,): [F(3, 10), F(7, 10)]}]
    q = [{(): [F(9, 10), F(1, 10)], (0,): [F(19, 20), F(1, 20)], (1,): [F(1, 2), F(1, 2)]},
         {(): [F(4, 5), F(1, 5)], (0,): [F(3, 5), F(2, 5)], (1,): [F(1, 2), F(1, 2)]}]
    return p, q


def row_outputs(p, q, x, length):
    """{first two emitted tokens: probability} of a row that verifies x[:length] (target
    sampling after the verified tokens, as the next step would)."""
    out = {}

    def emit(prefix, w):
        if len(prefix) == 2:
            out[prefix] = out.get(prefix, F(0)) + w
            return
        for t, pt in enumerate(p[prefix]):
            emit(prefix + (t,), w * pt)

    w = F(1)
    for j in range(length):
        h, pj, qj = x[:j], p[x[:j]], q[x[:j]]
        accept = min(F(1), pj[x[j]] / qj[x[j]])
        residual = [max(a - b, F(0)) for a, b in zip(pj, qj)]
        for t, r in enumerate(residual):
            if r and accept < 1:
                emit(h + (t,), w * (1 - accept) * r / sum(residual))
        w *= accept
    emit(x[:length], w)
    return out


def joint_outputs(schedule):
    p, q = two_row_tables()
    joint, lengths_seen = {}, set()
    for xs in itertools.product(itertools.product(range(2), repeat=2), repeat=2):
        w, survivals = F(1), []
        for r, x in enumerate(xs):
            a, row = F(1), []
            for j in range(2):
                w *= q[r][x[:j]][x[j]]
                a *= max(q[r][x[:j]])  # the confidence of q_j: a function of x_1..x_{j-1}
                row.append(a)
            survivals.append(row)
        lengths = schedule(survivals)
        lengths_seen.add(tuple(lengths))
        outs = [row_outputs(p[r], q[r], xs[r], lengths[r]) for r in range(2)]
        for (y0, w0), (y1, w1) in itertools.product(outs[0].items(), outs[1].items()):
            joint[y0, y1] = joint.get((y0, y1), F(0)) + w * w0 * w1
    want = {}
    for r in range(2):
        want[r] = {}
        for y in itertools.product(range(2), repeat=2):
            want[r][y] = p[r][()][y[0]] * p[r][y[:1]][y[1]]
    tv = sum(abs(joint.get((a, b), F(0)) - want[0][a] * want[1][b]) for a in want[0] for b in want[1]) / 2
    return tv, lengths_seen


# seconds of a two-row step at T tokens fed: growing smoothly, or a cliff at the first proposal and flat after
SMOOTH = {2: F(1), 3: F(11, 10), 4: F(13, 10), 5: F(17, 10), 6: F(2)}
JAGGED = {2: F(1), 3: F(2), 4: F(41, 20), 5: F(21, 10), 6: F(12, 5)}


def test_two_rows_are_jointly_exact():
    """Row 1's first proposal (survival 4/5) ranks after row 0's second (171/200) when x_{0,1} = 0
    and before it (9/20) when x_{0,1} = 1, so on the smooth curve whether row 1 verifies anything
    reads row 0's draft; the joint output is still exactly the product of the two targets (the
    early stop reveals a proposal only once it is admitted). The retrospective search on the
    jagged curve admits row 0's x_1 only when it is 0, and is biased."""
    smooth, jagged = SMOOTH.__getitem__, JAGGED.__getitem__
    tv, seen = joint_outputs(lambda s: prefix_schedule(s, smooth))
    assert tv == 0
    assert seen == {(2, 0), (1, 1)}  # row 1's admission varies with row 0's draft
    tv, seen = joint_outputs(lambda s: prefix_schedule(s, jagged))
    assert tv == 0 and seen == {(0, 0)}
    tv_retro, seen = joint_outputs(lambda s: retrospective_schedule(s, jagged))
    assert tv_retro > F(1, 100) and seen == {(2, 1), (0, 0)}
