"""The `dspark` policy: DSpark's prefix scheduler (Algorithm 1) and why its early stop keeps the
output exact.

- Appendix A of the paper in exact fractions: target (7/10, 3/10), draft (1/2, 1/2), SPS(1) = 1,
  SPS(2) = 1/2, SPS(3) = 9/20, c_1 = 4/5 and c_2 = 9/10 after A, 0 after B. The early-stopped
  scheduler emits (7/10, 3/10); the retrospective one (search past the drop, keep the best
  prefix) admits x_1 only when x_1 = A and emits (17/20, 3/20).
- Two rows whose admissions read each other's drafts: the joint output is the product of the
  targets, exactly (the early stop reveals a proposal only once it is admitted).
- The policy through its interface: the exhaustive enumeration of tests/test_policy_causal.py
  (TV <= 1e-9, admitted lengths that vary), optimality for a linear cost, greedy equality
  through the engine, and `draftwise check`: PASS for dspark, FAIL for Appendix A's
  retrospective scheduler registered as a test policy. (Load and the drafter's cost:
  tests/test_dspark_policy_load.py.)
"""
import itertools
from fractions import Fraction as F
from types import SimpleNamespace

import pytest
import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.policies import CostModel, register_policy
from draftwise.policies.dspark import DSparkPolicy, prefix_schedule
from draftwise.policies.goodput import GoodputConfig
from policy_helpers import COST, PROMPTS
from test_policy_causal import enumerate_admissions

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


# --------------------------------------------------------------------------- the policy, through its interface

def cliff_seconds(cliff: float):
    """One row's step seconds at `tokens` fed: 1 s alone, `cliff` s with a proposal (Appendix A: 2 s),
    then 0.05 s a token: a drop after the first proposal that later confident ones may recover."""
    return lambda tokens: 1.0 if tokens == 1 else cliff + 0.05 * (tokens - 2)


@register_policy("dspark-retro-test")
class Retrospective(DSparkPolicy):
    """Test only, NOT causal: Appendix A's scheduler without the early stop, row by row (R = 1 each,
    as in the paper's example) on the drafter's raw confidences and `cliff_seconds` (a cliff of
    1.6 s, where the tiny models' confidences straddle it); drafts every row's maximum. It
    verifies x_j when the confidences after it promise a long accepted run."""

    name = "dspark-retro-test"

    def __init__(self, cliff: float = 1.6, **kw):
        super().__init__(**kw)
        self.seconds = cliff_seconds(cliff)

    def plan(self, seqs, max_draft):
        return list(max_draft)

    def admit(self, seqs, blocks, draft_seconds):
        out = []
        for b in blocks:
            row, a = [], 1.0
            for c in b.confidence or [0.0] * len(b.token_ids):
                a *= c
                row.append(a)
            out.append(retrospective_schedule([row], self.seconds)[0] if row else 0)
        return out


STEEP = CostModel((0.001, 0.0, 0.001, 0.0), (0.0, 0.0, 0.0))  # a verified token costs a whole step's worth


def sampled(i: int = 0, tokens: int = 10) -> SimpleNamespace:
    return SimpleNamespace(seq_id=i, params=SamplingParams(temperature=1.0), num_tokens=tokens)


def test_dspark_admission_is_exact_by_enumeration():
    """Every draft and acceptance outcome of a row drafting 3 proposals over 4 tokens (q_j's
    confidence depends on x_1..x_{j-1}), admitted by the policy after its plan: TV <= 1e-9, with
    admitted lengths that vary across paths (the test is not vacuous)."""
    policy = DSparkPolicy(k=3, cost=STEEP, has_draft_model=False, config=FROZEN)
    seq = sampled()
    assert policy.plan([seq], [3]) == [3]  # free drafting and a fresh estimate: all of it
    tv, lengths = enumerate_admissions(policy)
    assert tv <= 1e-9 and len(lengths) >= 3, lengths


def test_the_enumeration_sees_the_retrospective_scheduler():
    """On the enumeration's tables (c_1 = 0.755) a cliff of 2.8 s makes x_1's admission follow the
    confidences after it: x_1 = 1 is verified with its two successors, x_1 = 3 mostly not."""
    policy = Retrospective(cliff=2.8, k=3, cost=STEEP)
    tv, lengths = enumerate_admissions(policy)
    assert tv > 0.1 and lengths == {0, 3}  # against <= 1e-9 for the early stop


def brute_force(survivals, seconds):
    best = -1.0
    for lengths in itertools.product(*[range(len(a) + 1) for a in survivals]):
        best = max(best, (len(survivals) + sum(sum(a[:n]) for a, n in zip(survivals, lengths)))
                   / seconds(len(survivals) + sum(lengths)))
    return best


def test_prefix_schedule_is_optimal_for_a_linear_cost():
    """For a cost linear in tokens Theta is unimodal along the greedy path: the early stop finds
    the best lengths of all (brute force over every combination)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        rows_, k = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        survivals = [torch.cumprod(torch.rand(k, generator=g, dtype=torch.float64), 0).tolist() for _ in range(rows_)]
        base, per = float(torch.rand(1, generator=g)) + 0.1, float(torch.rand(1, generator=g))
        seconds = lambda t: base + per * t  # noqa: E731
        lengths = prefix_schedule(survivals, seconds)
        value = (rows_ + sum(sum(a[:n]) for a, n in zip(survivals, lengths))) / seconds(rows_ + sum(lengths))
        assert value == pytest.approx(brute_force(survivals, seconds), rel=1e-12)


def test_prefix_schedule_keeps_the_minimum_and_the_row_order():
    seconds = lambda t: 1.0 + 1.0 * t  # noqa: E731  (dear tokens: nothing pays)
    assert prefix_schedule([[0.3, 0.1], [0.2]], seconds) == [0, 0]
    assert prefix_schedule([[0.3, 0.1], [0.2]], seconds, [1, 0]) == [1, 0]  # a probe stays admitted
    cheap = lambda t: 1.0 + 0.01 * t  # noqa: E731
    assert prefix_schedule([[0.9, 0.8, 0.7], [0.6, 0.0]], cheap) == [3, 1]  # a zero survival is never admitted


# --------------------------------------------------------------------------- through the engine

@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_dspark_keeps_greedy_output(target_dir, draft_dir, method):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(target_dir))
    llm = LLM(str(target_dir), draft=str(draft_dir) if method == "draft" else None,
              spec=SpecConfig(method=method, k=3, policy="dspark", cost_model=COST))
    for c in (1, 16):
        want = [o.token_ids for o in plain.generate(PROMPTS[:c], sp)]
        assert [o.token_ids for o in llm.generate(PROMPTS[:c], sp)] == want, c
    st = llm.engine.stats
    assert 0 < st.verified_tokens <= st.proposed_tokens and st.accepted_tokens <= st.verified_tokens


def test_check_passes_dspark_and_fails_the_retrospective_scheduler(tokenizer, tmp_path, capsys):
    """`draftwise check` on a peaked model drafting for itself (q = p, so only an admission that
    reads the proposal can bias), at temperature 0.7 where the retrospective scheduler's admission
    of x_1 moves ~0.1 of probability at the first drafted position: dspark PASSes, the
    retrospective scheduler FAILs (greedy rows may read anything: both PASS greedy equality)."""
    from draftwise.cli.main import main
    from draftwise.policies.profile import HardwareProfile
    from tiny_models import make_model_dir

    prof = HardwareProfile(machine={}, torch=torch.__version__, device="cpu", threads=1, dtype="float32",
                           draft_dtype="bfloat16", models={}, settings={}, grid=[], draft_grid=[], cost=COST)
    path = prof.save(tmp_path / "profile.json")
    peaked = make_model_dir(tmp_path / "peaked", seed=0, tokenizer=tokenizer, layers=2, hidden=64, init_std=3.0)
    common = ["check", "--model", str(peaked), "--draft", str(peaked), "--k", "3", "--samples", "600",
              "--temperature", "0.7", "--max-tokens", "16", "--profile", str(path)]
    assert main(common + ["--policy", "dspark"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "PASS distribution" in out and "PASS greedy equality" in out
    assert main(common + ["--policy", "dspark-retro-test"]) == 1
    out = capsys.readouterr().out
    assert "FAIL distribution" in out and "PASS greedy equality" in out
