"""Verification policies: causal admission proven (fractions, exhaustive enumeration through the
real policy code), the length optimiser, greedy equality of every policy with plain decoding,
and `draftwise check` with a policy.

The rule under test (policies/base.py): for a sampled row, whether proposal j is verified may
depend on the committed history, x_1..x_{j-1} and q_1..q_j, never on x_j or later. `Peek`, a
deliberately non-causal policy (verify x_j only if it is q_j's most probable token: it reads the
token), is the control: the enumeration and `draftwise check`'s distribution test must both see
its bias.

The goodput policy's own rules: tests/test_goodput_probes.py, test_goodput_looks.py,
test_goodput_steps.py (shared helpers: tests/policy_helpers.py).
"""
import itertools
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.policies import CostModel, Policy, StatelessPolicy, StepHints, available_policies, policy_class, register_policy
from draftwise.policies.base import causal_lengths
from draftwise.policies.calibration import Calibration
from draftwise.policies.cost import OnlineCost
from draftwise.policies.goodput import GoodputPolicy, admitted_lengths, choose_lengths
from draftwise.proposers import DraftBlock
from draftwise.sampling import VerifyMetadata, accept_probability, residual_distribution, verify

from policy_helpers import COST, CFG, PROMPTS, rows, never_right


@register_policy("peek-test")
class Peek(StatelessPolicy):
    """Test only, NOT causal: verifies proposal j only while x_j is q_j's most probable token (reads
    the token; with q = p it inflates the top token from p_top to p_top * (2 - p_top))."""

    def __init__(self, **_):
        pass

    def plan(self, seqs, max_draft):
        return list(max_draft)

    def admit(self, seqs, blocks, draft_seconds):
        out = []
        for b in blocks:
            n = 0
            while n < len(b.token_ids) and b.probs is not None:
                q = b.probs[n]
                if float(q[b.token_ids[n]]) < float(q.max()):
                    break
                n += 1
            out.append(n)
        return out


# --------------------------------------------------------------------------- (a) exact fractions

def output_distribution(p, q, verify_rule):
    """P(emitted token) for one proposal x ~ q, verified iff verify_rule(x), else the target
    samples directly; exact fractions."""
    out = [Fraction(0)] * len(p)
    for x, qx in enumerate(q):
        if verify_rule(x):
            acc = min(Fraction(1), p[x] / qx)
            out[x] += qx * acc
            r = [max(pi - qi, Fraction(0)) for pi, qi in zip(p, q)]
            for y in range(len(p)):
                out[y] += qx * (1 - acc) * r[y] / sum(r)
        else:
            for y in range(len(p)):
                out[y] += qx * p[y]
    return out


def test_two_symbol_example_causal_vs_peeking():
    p = [Fraction(3, 5), Fraction(2, 5)]
    q = [Fraction(4, 5), Fraction(1, 5)]
    assert output_distribution(p, q, lambda x: q[x] > Fraction(1, 2)) == [Fraction(18, 25), Fraction(7, 25)]
    # the causal rule, through the helper every built-in policy uses: it sees max q, not x
    for threshold in (Fraction(1, 2), Fraction(9, 10)):
        blocks = [DraftBlock([x], None, [max(q)]) for x in range(2)]
        lengths = causal_lengths(blocks, lambda i, j, conf: conf > threshold)
        assert lengths[0] == lengths[1]  # the same decision whatever the token
        assert output_distribution(p, q, lambda x: lengths[x] == 1) == p


# --------------------------------------------------------------------------- (b) exhaustive enumeration

V, N = 4, 3  # vocabulary, proposals drafted


def table(salt, history):
    g = torch.Generator().manual_seed(salt * 1000 + sum((t + 1) * 7 ** i for i, t in enumerate(history)))
    w = torch.rand(V, generator=g, dtype=torch.float64) ** 3
    w[torch.rand(V, generator=g) < 0.25] = 0.0
    if w.sum() == 0:
        w[0] = 1.0
    return w / w.sum()


def target(h):
    return table(1, h)


def draft(h):
    return table(2, h)


def target_joint(horizon):
    out = {}
    for y in itertools.product(range(V), repeat=horizon):
        pr = 1.0
        for i in range(horizon):
            pr *= target(y[:i])[y[i]].item()
        if pr > 0:
            out[y] = pr
    return out


def extend(prefix, weight, horizon, acc):
    if len(prefix) == horizon:
        acc[prefix] = acc.get(prefix, 0.0) + weight
        return
    p = target(prefix)
    for t in range(V):
        if p[t] > 0:
            extend(prefix + (t,), weight * p[t].item(), horizon, acc)


def enumerate_admissions(policy):
    """`enumerate_policy` through `policy.admit`, with the set of admitted lengths seen (a test
    whose lengths never vary would be vacuous)."""
    lengths = set()

    def admit(seqs, blocks):
        out = policy.admit(seqs, blocks, 0.0)
        lengths.add(out[0])
        return out

    tv, _ = enumerate_policy(admit)
    return tv, lengths


def enumerate_policy(admit):
    """Output distribution over N+1 tokens when `admit(seqs, blocks)` picks the verified prefix of
    each drafted path; every branch is also run through `verify` with uniforms inside it."""
    seq = SimpleNamespace(seq_id=0, params=SamplingParams(temperature=1.0), num_tokens=10)
    dist, rows = {}, []
    for x in itertools.product(range(V), repeat=N):
        qs = [draft(x[:j]) for j in range(N)]
        w_path = 1.0
        for j in range(N):
            w_path *= qs[j][x[j]].item()
        if w_path == 0:
            continue
        block = DraftBlock(list(x), torch.stack(qs).float(), [float(q.max()) for q in qs])
        L = admit([seq], [block])[0]
        ps = [target(x[:j]) for j in range(L + 1)]
        a = [accept_probability(ps[j][x[j]], qs[j][x[j]]).item() for j in range(L)]
        for acc in range(L + 1):
            w = w_path
            for j in range(acc):
                w *= a[j]
            last = ps[L] if acc == L else residual_distribution(ps[acc], qs[acc])
            if acc < L:
                w *= 1.0 - a[acc]
            if w == 0:
                continue
            cdf = torch.cumsum(last, 0)
            for t in range(V):
                if last[t] == 0:
                    continue
                u_rec = ((cdf[t - 1].item() if t else 0.0) + cdf[t].item()) / 2
                u_acc = [0.0] * acc + ([(a[acc] + 1) / 2] if acc < L else []) + [0.5] * (L - acc - 1 if acc < L else 0)
                rows.append((list(x[:L]), ps, qs[:L], u_acc, u_rec, x[:acc] + (t,)))
                extend(x[:acc] + (t,), w * last[t].item(), N + 1, dist)
    # the same branches through `verify`
    meta = VerifyMetadata.build([r[0] for r in rows], [False] * len(rows))
    p_logits = torch.cat([torch.log(torch.stack(r[1])) for r in rows])
    q_list = [torch.stack(r[2]) for r in rows if r[2]]
    q_flat = torch.cat(q_list) if q_list else None
    k = meta.max_k
    u_acc = torch.tensor([r[3] + [0.5] * (k - len(r[3])) for r in rows], dtype=torch.float64).reshape(len(rows), k)
    res = verify(p_logits, meta, q_flat, draws=(u_acc, torch.tensor([r[4] for r in rows], dtype=torch.float64)))
    assert [tuple(res.tokens(i)) for i in range(len(rows))] == [r[5] for r in rows]
    want = target_joint(N + 1)
    return 0.5 * sum(abs(dist.get(y, 0.0) - want.get(y, 0.0)) for y in set(dist) | set(want)), dist


# the marginal seconds of one more verified token at batch 1, context 10 (the enumeration's row)
MARGINAL = OnlineCost(COST).step_seconds(1, 2, 10.0) - OnlineCost(COST).step_seconds(1, 1, 10.0)


def goodput_rule(rate: float):
    """The goodput policy's admission rule at a planned rate (`admitted_lengths`, what its `admit`
    runs): proposals pay for their marginal verification time at that rate."""
    cal = Calibration()
    return lambda seqs, blocks: admitted_lengths(seqs, blocks, cal, rate * MARGINAL, set())


@pytest.mark.parametrize("rate", [0.0, 1000.0, 1500.0, 1e9])
def test_goodput_admission_is_exact_by_enumeration(rate):
    tv, _ = enumerate_policy(goodput_rule(rate))  # the planned rate sets the threshold the confidences must pass
    assert tv <= 1e-9


def test_goodput_admission_is_exact_after_a_plan():
    """The same through the policy: `admit` after the plan of a step ("spec": its own rate, here
    high enough that the admitted length varies with the confidences)."""
    fast = CostModel((0.0008, 0.0, 0.0004, 0.0), (0.00005, 0.00001, 0.0))
    policy = GoodputPolicy(k=N, cost=fast, has_draft_model=True)
    seq = SimpleNamespace(seq_id=0, params=SamplingParams(temperature=1.0), num_tokens=10)
    assert policy.plan([seq], [N]) and policy.hints().arm == "spec"
    tv, lengths = enumerate_admissions(policy)
    assert tv <= 1e-9 and len(lengths) >= 2, lengths


def test_goodput_admission_varies_with_confidence():
    """The enumeration above is not vacuous: at these rates the admitted length differs between paths."""
    rule = goodput_rule(1500.0)
    seq = SimpleNamespace(seq_id=0, params=SamplingParams(temperature=1.0), num_tokens=10)
    lengths = set()
    for x in itertools.product(range(V), repeat=N):
        qs = [draft(x[:j]) for j in range(N)]
        lengths.add(rule([seq], [DraftBlock(list(x), None, [float(q.max()) for q in qs])])[0])
    assert len(lengths) >= 3


def test_the_enumeration_sees_a_peeking_policy():
    tv, _ = enumerate_policy(lambda seqs, blocks: Peek().admit(seqs, blocks, 0.0))
    assert tv > 1e-3  # against <= 1e-9 for the causal policy


def test_every_registered_policy_has_the_whole_interface():
    """The engine calls every `Policy` method on any policy (no optional hooks)."""
    for name in available_policies():
        cls = policy_class(name)
        policy = cls(k=3, cost=COST, has_draft_model=True)
        assert isinstance(policy, Policy), name
        assert policy.plan(rows(2), [3, 3]) is not None
        assert isinstance(policy.hints(), StepHints) and policy.plain_next(2) in (True, False)


# --------------------------------------------------------------------------- (c) the optimiser

def brute_force(gains, step):
    best, arg = -1.0, None
    for lengths in itertools.product(*[range(len(g) + 1) for g in gains]):
        e = len(gains) + sum(sum(g[:n]) for g, n in zip(gains, lengths))
        v = e / step(len(gains) + sum(lengths))
        if v > best + 1e-12:
            best, arg = v, list(lengths)
    return arg, best


def test_choose_lengths_is_optimal_for_a_linear_cost():
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        b, k = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        gains = []
        for _ in range(b):
            a = torch.rand(k, generator=g).tolist()
            row, acc = [], 1.0
            for x in a:
                acc *= x
                row.append(acc)
            gains.append(row)
        base, per_tok = float(torch.rand(1, generator=g)) + 0.1, float(torch.rand(1, generator=g))
        step = lambda t: base + per_tok * t  # noqa: E731
        lengths, value = choose_lengths(gains, step)
        _, best = brute_force(gains, step)
        assert abs(value - best) < 1e-9


def test_choose_lengths_useless_drafter_and_drafting_cost():
    step = lambda t: 0.004 + 0.0001 * t  # noqa: E731
    assert choose_lengths([[0.0] * 4] * 3, step)[0] == [0, 0, 0]
    assert choose_lengths([[0.99 ** (j + 1) for j in range(4)]] * 2, step)[0] == [4, 4]
    # an expensive drafter step makes the same acceptances not worth drafting
    assert choose_lengths([[0.5 ** (j + 1) for j in range(4)]], step, lambda n: 0.01)[0] == [0]
    # a probe is kept whatever it gains
    assert choose_lengths([[0.0] * 4, [0.0] * 4], step, None, [1, 0])[0] == [1, 0]


def test_online_cost_learns_what_the_profile_misses():
    from draftwise.policies.cost import OnlineCost

    model = OnlineCost(COST)
    assert model.step_seconds(4, 8, 100.0) == pytest.approx(COST.target_seconds(4, 8, 100.0))
    g = torch.Generator().manual_seed(0)
    for _ in range(300):  # the whole step pays 1 ms + 0.2 ms per row + 0.05 ms per token more
        b, t = int(torch.randint(1, 17, (1,), generator=g)), 0
        t = b + int(torch.randint(0, 4 * b + 1, (1,), generator=g))
        model.observe(b, t, 50.0, [], COST.target_seconds(b, t, 50.0) + 0.001 + 0.0002 * b + 0.00005 * t)
    for b, t in ((1, 1), (8, 40), (16, 80)):
        want = COST.target_seconds(b, t, 50.0) + 0.001 + 0.0002 * b + 0.00005 * t
        assert model.step_seconds(b, t, 50.0) == pytest.approx(want, rel=0.02)
    # steps that never varied (batch 1, never drafting) teach a per-step cost, not a per-token one
    flat = OnlineCost(COST)
    for _ in range(100):
        flat.observe(1, 1, 50.0, [], COST.target_seconds(1, 1, 50.0) + 0.05)
    assert flat.step_seconds(1, 1, 50.0) == pytest.approx(COST.target_seconds(1, 1, 50.0) + 0.05, rel=1e-3)
    assert flat.step_seconds(1, 5, 50.0) - flat.step_seconds(1, 1, 50.0) == pytest.approx(
        COST.target_seconds(1, 5, 50.0) - COST.target_seconds(1, 1, 50.0), rel=1e-3)


# --------------------------------------------------------------------------- (d) engine: greedy equality



@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_every_policy_keeps_greedy_output(target_dir, draft_dir, method):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(target_dir))
    want = {c: [o.token_ids for o in plain.generate(PROMPTS[:c], sp)] for c in (1, 16)}
    for policy in ("fixed", "adaptive", "goodput", "peek-test"):
        llm = LLM(str(target_dir), draft=str(draft_dir) if method == "draft" else None,
                  spec=SpecConfig(method=method, k=3, policy=policy, cost_model=COST))
        for c in (1, 16):
            got = llm.generate(PROMPTS[:c], sp)
            assert [o.token_ids for o in got] == want[c], (policy, c)
        st = llm.engine.stats
        assert st.verified_tokens <= st.proposed_tokens and st.accepted_tokens <= st.verified_tokens


@register_policy("overreach-test")
class Overreach(StatelessPolicy):
    """Plans more than it may (k = 99 for every row) and admits all: the engine holds it to the caps."""

    name = "overreach-test"

    def __init__(self, k: int, cost=None, has_draft_model: bool = True):
        pass

    def plan(self, seqs, max_draft):
        return [99] * len(seqs)

    def admit(self, seqs, blocks, draft_seconds):
        return [len(b.token_ids) for b in blocks]


def test_every_policy_honours_a_requests_draft_cap(target_dir, draft_dir):
    """`SamplingParams.max_draft` per request, in one batch: 0 proposes nothing, 1 at most one
    token a round (whatever the policy plans), the greedy output is plain's in every case."""
    sp = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, max_draft=cap) for cap in (0, 1, None)]
    want = [o.token_ids for o in LLM(str(target_dir)).generate(PROMPTS[:3], sp[2])]
    for policy in available_policies():
        llm = LLM(str(target_dir), draft=str(draft_dir), spec=SpecConfig(method="draft", k=3, policy=policy,
                                                                           cost_model=COST))
        outs = llm.generate(PROMPTS[:3], sp)
        assert [o.token_ids for o in outs] == want, policy
        off, one = outs[0].stats, outs[1].stats
        assert off.proposed_tokens == off.verified_tokens == 0 and off.rounds > 0, policy
        assert one.proposed_tokens <= one.rounds and one.accepted_per_position[1:] == [0, 0], policy
    over = LLM(str(target_dir), draft=str(draft_dir), spec=SpecConfig(method="draft", k=3, policy="overreach-test"))
    outs = over.generate(PROMPTS[:3], sp)
    assert outs[0].stats.proposed_tokens == 0 and outs[1].stats.proposed_tokens <= outs[1].stats.rounds
    assert outs[2].stats.proposed_tokens > outs[2].stats.rounds  # k = 3 where no cap holds it


def test_goodput_stops_drafting_with_a_useless_drafter(target_dir, draft_dir):
    """With acceptances near 0 the goodput policy verifies (and drafts) little: probes, and the
    measured check's rare bursts of fixed speculation (its first look deferred, the model rating it
    far behind; each burst that stays far behind waits four times longer for the next)."""
    llm = LLM(str(target_dir), draft=str(draft_dir), spec=SpecConfig(method="draft", k=4, policy="goodput",
                                                                     cost_model=COST))
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    never_right(llm.engine.policy, confidences=[(b + 0.5) / 20 for b in range(20)] + [None])  # at every confidence
    out = llm.generate([[7, 8, 9, 10]], sp)[0]
    rounds = out.stats.rounds
    probes = rounds // CFG.probe_every + 2
    bursts = 1 + rounds // (4 * CFG.explore_every)
    assert out.stats.verified_tokens <= probes + 4 * CFG.burst * bursts
    assert out.stats.proposed_tokens <= 4 * (probes + CFG.burst * bursts)
    assert out.stats.verified_tokens < 0.1 * 4 * rounds  # fixed speculation would verify 4 a round


# --------------------------------------------------------------------------- (e) draftwise check

def test_check_passes_goodput_and_fails_a_peeking_policy(target_dir, draft_dir, tokenizer, tmp_path, capsys):
    from draftwise.cli.main import main
    from draftwise.policies.profile import HardwareProfile
    from tiny_models import make_model_dir

    prof = HardwareProfile(machine={}, torch=torch.__version__, device="cpu", threads=1, dtype="float32",
                           draft_dtype="bfloat16", models={}, settings={}, grid=[], draft_grid=[], cost=COST)
    path = prof.save(tmp_path / "profile.json")
    common = ["check", "--model", str(target_dir), "--draft", str(draft_dir), "--k", "3", "--samples", "300",
              "--max-tokens", "16", "--profile", str(path)]
    assert main(common + ["--policy", "goodput"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "PASS distribution" in out and "PASS greedy equality" in out
    # a peaked model (larger weights) as its own drafter (q = p): peeking inflates each position's
    # top token from p_top to p_top * (2 - p_top), which the check's chi-square must see
    peaked = make_model_dir(tmp_path / "peaked", seed=0, tokenizer=tokenizer, layers=2, hidden=64, init_std=4.0)
    assert main(["check", "--model", str(peaked), "--draft", str(peaked)] + common[5:] + ["--policy", "peek-test"]) == 1
    out = capsys.readouterr().out
    assert "FAIL distribution" in out and "PASS greedy equality" in out  # greedy rows may peek
