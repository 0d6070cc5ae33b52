"""Verification policies: causal admission proven (fractions, exhaustive enumeration through the
real policy code), the length optimiser, greedy equality of every policy with plain decoding,
and `draftwise check` with a policy.

The rule under test (policies/base.py): for a sampled row, whether proposal j is verified may
depend on the committed history, x_1..x_{j-1} and q_1..q_j, never on x_j or later. `Peek`, a
deliberately non-causal policy (verify x_j only if it is q_j's most probable token: it reads the
token), is the control: the enumeration and `draftwise check`'s distribution test must both see
its bias.

The goodput policy is driven through its interface (`plan`, `admit`, `observe`, `observe_step`,
`hints`, `plain_next`, a `GoodputConfig`) on synthetic clocks, its parts (the
core's `Planner`, one batch size's `Arms`) through their methods; no test touches a private field
(the `Arms` unit tests set its public decision state directly, to pin one rule at a time).
"""
import itertools
import random
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.policies import CostModel, Policy, StatelessPolicy, StepHints, StepTiming, available_policies, \
    policy_class, register_policy
from draftwise.policies.base import causal_lengths
from draftwise.policies.calibration import Calibration
from draftwise.policies.cost import OnlineCost
from draftwise.policies.goodput import ARMS, Arms, GoodputConfig, GoodputPolicy, admitted_lengths, choose_lengths
from draftwise.policies.goodput.plan import Planner
from draftwise.proposers import DraftBlock
from draftwise.sampling import VerifyMetadata, accept_probability, residual_distribution, verify

COST = CostModel((0.003, 0.0002, 0.0004, 0.0), (0.0003, 0.00005, 0.0))
DEAR = CostModel((0.0001, 0.0, 0.02, 0.0), (0.0003, 0.00005, 0.0))  # all of it per token fed: no drafting pays
CFG = GoodputConfig()
FROZEN = GoodputConfig(learn_step_cost=False)  # the profile's view throughout: only the measured check learns


def rows(b: int, **kw) -> list[SimpleNamespace]:
    return [SimpleNamespace(seq_id=i, params=SamplingParams(temperature=0), num_tokens=50, **kw) for i in range(b)]


def timing(b: int, tokens: int, lengths, seconds, catch_up: float = 0.0) -> StepTiming:
    return StepTiming(b, tokens, 50.0, list(lengths), seconds, catch_up)


def never_right(policy, confidences=(0.1,)) -> None:
    """Observations of a drafter that is never right, fed through `observe` (greedy rows, one
    rejected first proposal each, at these confidences), closed by an untimed step."""
    seq = SimpleNamespace(seq_id=10**6, params=SamplingParams(temperature=0), num_tokens=50)
    for conf in confidences:
        block = DraftBlock([1], None, [conf])
        for _ in range(400):
            policy.observe(seq, block, 1, 0)
    policy.forget(seq.seq_id)
    policy.observe_step(timing(1, 2, [1], None))


def burst_starts(modes: list[str], arm: str) -> list[int]:
    return [i for i, m in enumerate(modes) if m == arm and (i == 0 or modes[i - 1] != arm)]


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

PROMPTS = [[20 + i, 3, 4, 5, 20 + i, 3] for i in range(16)]


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


@pytest.mark.parametrize("spec_pays", [True, False])
def test_goodput_measured_check_follows_the_clock(spec_pays):
    """Whatever the cost model says, the measured check settles on the arm the clock favours."""
    policy = GoodputPolicy(k=4, cost=COST, has_draft_model=True)  # COST says: speculate
    seqs = [SimpleNamespace(seq_id=i, params=SamplingParams(temperature=0), num_tokens=50) for i in range(4)]
    modes = []
    for step in range(400):
        lengths = policy.plan(seqs, [4] * 4)
        blocks = [DraftBlock([1] * n, None, [0.9] * n) for n in lengths]
        admitted = policy.admit(seqs, blocks, 0.0)
        tokens = 4 + sum(admitted)
        for s, blk, n in zip(seqs, blocks, admitted):
            policy.observe(s, blk, n, min(n, 2))  # two of the verified proposals accepted
        # the clock: verification costs 0.3 ms per token when speculation pays, 10 ms when it does not
        seconds = 0.005 + (0.0003 if spec_pays else 0.010) * (tokens - 4)
        policy.observe_step(timing(4, tokens, lengths, seconds))
        modes.append(policy.hints().arm)
    spec_share = 1 - modes[200:].count("plain") / 200  # "spec" (as planned) or "full" (every row k)
    assert spec_share > 0.85 if spec_pays else spec_share < 0.15


def test_grid_cost_reads_the_measured_points():
    from draftwise.policies.cost import GridCost

    pts = [(b, t, 64, 0.004 + (0.0 if b == 1 else 0.0005 * b * t)) for b in (1, 4, 16) for t in (1, 3, 5)]
    pts += [(1, 1, 256, 0.009)]  # another context: not in the table
    g = GridCost(COST, pts)
    for b, t, c, s in pts[:-1]:
        assert g.target_seconds(b, b * t, 64) == pytest.approx(s)
    assert g.target_seconds(1, 5, 64) == pytest.approx(g.target_seconds(1, 1, 64))  # free at batch 1
    f4, f16 = 0.004 + 0.0005 * 4 * 2, 0.004 + 0.0005 * 16 * 2  # 2 tokens per sequence at B = 4 and 16
    assert g.target_seconds(8, 16, 64) == pytest.approx(f4 + (f16 - f4) * (8 - 4) / (16 - 4))
    assert g.target_seconds(4, 8, 100) == pytest.approx(g.target_seconds(4, 8, 64) + COST.target[3] * 4 * 36)


def test_goodput_probes_back_off_with_a_useless_drafter():
    """Probes that accept nothing double their interval (32, 64, ... up to max_probe_every); one
    that accepts brings it back to probe_every. The measured check's bursts of fixed speculation
    (every proposal verified: the estimates can recover from them too) grow apart as well."""
    policy = GoodputPolicy(k=4, cost=COST, has_draft_model=True)
    never_right(policy)
    seqs = rows(1)
    bursts = []

    def run(steps, accept):
        probes, looks = [], []
        for step in range(steps):
            lengths = policy.plan(seqs, [4])
            arm = policy.hints().arm
            blocks = [DraftBlock([1] * n, None, [0.1] * n) for n in lengths]
            admitted = policy.admit(seqs, blocks, 0.0)
            if admitted[0]:
                (bursts if arm == "full" else probes).append(step)
                looks.append(step)
            policy.observe(seqs[0], blocks[0], admitted[0], min(admitted[0], accept))
            policy.observe_step(timing(1, 1 + admitted[0], lengths, 0.005))
        return probes, looks

    probes, _ = run(3000, accept=0)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) <= 3000 // CFG.max_probe_every + 6, probes  # 32/probe would be ~90
    assert gaps[-1] >= CFG.max_probe_every and gaps == sorted(gaps)
    starts = burst_starts([("full" if i in bursts else "") for i in range(3000)], "full")
    assert len(bursts) <= CFG.burst * len(starts) and len(starts) <= 8, bursts
    assert [b - a for a, b in zip(starts, starts[1:])] == sorted(b - a for a, b in zip(starts, starts[1:]))
    bursts.clear()
    probes, looks = run(2 * CFG.max_probe_every, accept=1)  # the drafter became right
    # the first probe accepts: the next look comes probe_every steps later, not after a longer wait
    assert probes and looks[0] == probes[0] and looks[1] - looks[0] <= CFG.probe_every + 4, looks[:4]


def test_a_rows_probe_interval_doubles_and_resets():
    """While the plan drafts for some rows, a row it leaves out probes once it has not verified
    for its interval: a probe that accepts nothing doubles the interval (here 32, then 64), one
    that accepts brings it back to probe_every."""
    core, seqs = Planner(CFG, COST, has_draft_model=True), rows(2)
    good, bad = DraftBlock([1] * 4, None, [0.9] * 4), DraftBlock([1], None, [0.9])
    for _ in range(50):  # row 0's drafter is right, row 1's never
        core.observe(seqs[0], good, 4, 4, calibrate=True, plain_leads=lambda: False)
        core.observe(seqs[1], bad, 1, 0, calibrate=True, plain_leads=lambda: False)

    def steps_to_probe() -> int:  # steps in which row 0 drafts and row 1 does not verify
        for n in range(2000):
            plan = core.plan(seqs, [4, 4])
            assert plan.lengths[0] > 0 and plan.lengths[1] == 0, plan.lengths
            if core.probe_rows(seqs, plan, [4, 4], lambda: True)[1]:
                return n
            core.count_step(timing(2, 6, plan.lengths, 0.005))
        raise AssertionError("no probe")

    def probe(accepted: int) -> None:
        core.observe(seqs[1], bad, 1, accepted, calibrate=True, plain_leads=lambda: False)
        core.count_step(timing(2, 7, [4, 1], 0.005))

    assert steps_to_probe() == CFG.probe_every
    probe(accepted=0)
    assert steps_to_probe() == 2 * CFG.probe_every - 1  # (counted from the probe's step)
    probe(accepted=1)
    assert steps_to_probe() == CFG.probe_every - 1


def test_no_engine_wide_probes_where_the_load_stops_drafting():
    """A drafter whose first proposal is right (every probe would accept) at a load where
    verification costs more than it commits: the plan drafts for no row whatever the estimates
    say and the measured check rates plain steps above fixed speculation. No engine-wide probe is
    made there (each would catch a row's drafter up over its whole context for one proposal; the
    check's bursts of "full", still run now and then, calibrate every row instead)."""
    policy = GoodputPolicy(k=4, cost=DEAR, has_draft_model=True)
    b = 4
    seqs = rows(b)
    probes, modes = [], []
    for step in range(3000):
        lengths = policy.plan(seqs, [4] * b)
        modes.append(policy.hints().arm)
        blocks = [DraftBlock([1] * n, None, [0.9] * n) for n in lengths]
        admitted = policy.admit(seqs, blocks, 0.0)
        if any(admitted) and modes[-1] != "full":
            probes.append(step)
        for s, blk, n in zip(seqs, blocks, admitted):
            policy.observe(s, blk, n, min(n, 1))  # the first proposal accepted
        policy.observe_step(timing(b, b + sum(admitted), lengths, DEAR.target_seconds(b, b + sum(admitted))))
    assert probes == [], probes
    assert modes.count("full") >= 3, "the check still looks at fixed speculation"


def idle_steps_to_engine_probe(core: Planner, seqs, limit: int = 2000) -> int:
    """Steps in which no row verifies, until the plan's engine-wide probe (the check allowing it)."""
    plan = core.plan(seqs, [4] * len(seqs))
    assert not any(plan.lengths)  # (a load at which no drafting pays)
    for n in range(limit):
        if any(core.probe_rows(seqs, plan, [4] * len(seqs), lambda: True)):
            return n
        core.count_step(timing(len(seqs), len(seqs), [0] * len(seqs), 0.005))
    raise AssertionError("no engine-wide probe")


def test_the_engine_wide_probe_comes_once_no_row_has_verified_and_the_check_allows():
    """When the plan drafts for no row, one row probes once no row has verified for the
    engine-wide interval, and only if the measured check allows it (its budget covers the probe
    and plain steps do not lead: `MeasuredCheck.engine_probe_allowed`, asked only then)."""
    core = Planner(CFG, DEAR, has_draft_model=True)
    seqs = rows(4)
    plan = core.plan(seqs, [4] * 4)
    asked = []
    for _ in range(CFG.probe_every):
        assert core.probe_rows(seqs, plan, [4] * 4, lambda: asked.append(1) or True) == [0] * 4
        core.count_step(timing(4, 4, [0] * 4, 0.005))
    assert asked == []  # not due: the check is not asked
    assert core.probe_rows(seqs, plan, [4] * 4, lambda: False) == [0] * 4  # due, not allowed
    assert core.probe_rows(seqs, plan, [4] * 4, lambda: True) == [1, 0, 0, 0]  # due and allowed: one row


def test_an_accepting_engine_wide_probe_resets_only_where_speculation_measures_ahead():
    """Where the measured check rates fixed speculation above plain steps, what stops drafting is
    the estimate: an engine-wide probe that accepts brings the interval back to probe_every (a
    pessimistic start recovers soon). Where plain steps lead, it doubles, as one that accepts
    nothing does everywhere."""
    block = DraftBlock([1], None, [0.9])

    def probe(core, seqs, accepted, plain_leads):  # the probe's step: row 0 verifies one proposal
        core.observe(seqs[0], block, 1, accepted, calibrate=True, plain_leads=lambda: plain_leads)
        core.count_step(timing(len(seqs), len(seqs) + 1, [1] + [0] * (len(seqs) - 1), 0.005))

    for plain_leads, accepted, expected in ((False, 1, 32), (True, 1, 128), (False, 0, 128)):
        core, seqs = Planner(CFG, DEAR, has_draft_model=True), rows(4)
        assert idle_steps_to_engine_probe(core, seqs) == CFG.probe_every
        probe(core, seqs, accepted=0, plain_leads=False)  # nothing accepted: twice as long
        assert idle_steps_to_engine_probe(core, seqs) == 2 * CFG.probe_every
        probe(core, seqs, accepted, plain_leads)
        assert idle_steps_to_engine_probe(core, seqs) == expected, (plain_leads, accepted)


def test_goodput_full_arm_wins_when_the_plan_truncates_too_much():
    """A profile that overstates verification (0.8 ms a token) makes the plan truncate blocks
    while the clock charges 0.2 ms: the measured check, which corrects each arm's predicted
    seconds by what its steps took, settles on the "full" arm (every row drafts and verifies k)."""
    import random

    cost = CostModel((0.003, 0.0002, 0.0008, 0.0), (0.0003, 0.00005, 0.0))
    policy = GoodputPolicy(k=4, cost=cost, has_draft_model=True, config=FROZEN)  # (the profile's view throughout)
    rng = random.Random(0)
    seqs = [SimpleNamespace(seq_id=i, params=SamplingParams(temperature=0), num_tokens=50) for i in range(2)]
    modes, spec_lengths = [], []
    for step in range(600):
        lengths = policy.plan(seqs, [4] * 2)
        blocks = [DraftBlock([1] * n, None, [0.8] * n) for n in lengths]
        admitted = policy.admit(seqs, blocks, 0.0)
        for s, blk, n in zip(seqs, blocks, admitted):
            acc = 0
            while acc < n and rng.random() < 0.8:  # each proposal accepted with probability 0.8
                acc += 1
            policy.observe(s, blk, n, acc)
        tokens = 2 + sum(admitted)
        policy.observe_step(timing(2, tokens, lengths, 0.005 + 0.0002 * (tokens - 2)))
        modes.append(policy.hints().arm)
        if modes[-1] == "spec":
            spec_lengths.append(sum(lengths))
    assert spec_lengths and sum(spec_lengths) / len(spec_lengths) < 7, "the plan truncates (8: every row k)"
    assert modes[300:].count("full") / 300 > 0.8, modes[300:]


def test_goodput_new_batch_size_starts_from_its_neighbour():
    """Once plain wins at 4 rows (its looks at speculation grown far apart), 5 rows start plain
    too (no warm-up bursts of speculation), look at each arm soon, and the exploration there after
    that first look follows the neighbour's (long) intervals. (The exploration budget is set free
    here: the looks follow their intervals alone.)"""
    free = GoodputConfig(learn_step_cost=False, explore_budget=1.0, credit_cap=1e9)
    policy = GoodputPolicy(k=4, cost=COST, has_draft_model=True, config=free)  # COST says: speculate, throughout

    def run(b, steps):
        seqs = [SimpleNamespace(seq_id=i, params=SamplingParams(temperature=0), num_tokens=50) for i in range(b)]
        modes = []
        for _ in range(steps):
            lengths = policy.plan(seqs, [4] * b)
            blocks = [DraftBlock([1] * n, None, [0.9] * n) for n in lengths]
            admitted = policy.admit(seqs, blocks, 0.0)
            for s, blk, n in zip(seqs, blocks, admitted):
                policy.observe(s, blk, n, min(n, 2))
            tokens = b + sum(admitted)
            policy.observe_step(timing(b, tokens, lengths, 0.005 + 0.010 * (tokens - b)))  # verifying costs
            modes.append(policy.hints().arm)
        return modes

    modes = run(4, 300)
    assert modes[-4 * CFG.explore_every:] == ["plain"] * (4 * CFG.explore_every), modes  # no look for long
    modes = run(5, 40 + 4 * CFG.explore_every)  # (5 rows: another batch bucket than 4)
    assert modes[:12] == ["plain"] * 12, modes
    assert "full" in modes[: CFG.first_look + 2 * CFG.burst + 1]  # the first look at this batch size
    assert modes[40:] == ["plain"] * (4 * CFG.explore_every), modes  # then the neighbour's long waits


def _drive(policy, b, steps, seconds, accept=2):
    """Steps of the goodput policy on `b` rows; seconds(lengths, previous lengths) is the step's time."""
    seqs = [SimpleNamespace(seq_id=i, params=SamplingParams(temperature=0), num_tokens=50) for i in range(b)]
    modes, prev = [], [0] * b
    for _ in range(steps):
        lengths = policy.plan(seqs, [4] * b)
        blocks = [DraftBlock([1] * n, None, [0.9] * n) for n in lengths]
        admitted = policy.admit(seqs, blocks, 0.0)
        for s, blk, n in zip(seqs, blocks, admitted):
            policy.observe(s, blk, n, min(n, accept))
        policy.observe_step(timing(b, b + sum(admitted), lengths, seconds(admitted, prev)))
        modes.append(policy.hints().arm)
        prev = list(admitted)
    return modes


def test_goodput_new_batch_size_looks_at_every_arm_soon():
    """A new batch size inherits a neighbour's figures, not the wait before its first look at an
    arm: where plain decoding lost at 2 rows (its interval grown long there) and wins at 8 (the
    profile still says speculate), the policy measures plain at 8 rows within FIRST_LOOK steps
    and runs it."""
    policy = GoodputPolicy(k=4, cost=COST, has_draft_model=True, config=FROZEN)  # COST says: speculate, throughout
    cheap = lambda lengths, prev: 0.005 + 0.0005 * sum(lengths)  # 2 rows: verification nearly free
    modes = _drive(policy, 2, 400, cheap)
    assert "plain" not in modes[-4 * CFG.explore_every:]  # its looks grown far apart at 2 rows
    dear = lambda lengths, prev: 0.005 + 0.010 * sum(lengths)  # 8 rows: every proposal costs
    modes = _drive(policy, 8, 200, dear)
    assert "plain" in modes[: CFG.first_look + CFG.burst + 1], modes[:40]
    assert modes[100:].count("plain") / 100 > 0.8, modes[100:]


def test_first_look_at_a_new_batch_size_ignores_the_budget():
    """An arm without steps of its own at a batch size, with no catch-up to start with, is looked
    at even with the exploration budget in debt (its first look is what measures it); once
    measured there, its looks wait for the credit to cover what its last one cost."""
    near = Arms(CFG)
    near.record("full", committed=6.0, expected=8.0, seconds=0.02, predicted=0.01, switched=False)
    near.look_cost["full"] = 0.05
    arms = Arms(CFG, seed=near)
    assert all(d <= CFG.first_look for d in arms.due.values())
    assert arms.affordable("full", credit=-0.01)
    arms.record("full", committed=6.0, expected=8.0, seconds=0.02, predicted=0.01, switched=False)
    assert not arms.affordable("full", credit=-0.01)
    assert arms.affordable("full", credit=0.06)


def test_a_first_look_that_starts_with_a_catch_up_waits_for_the_budget():
    """The drafter's catch-up a look would start with (rows that have not drafted: their whole
    prompts) is known before the look: a first look at a drafting arm at a new batch size whose
    catch-up is dearer than the credit's cap waits for a full credit, while one with little or
    nothing to catch up on does not wait."""
    plain = (32.0, 0.068, 0.0)
    full = (31.0, 0.080, 0.0)  # 388 tokens/s: behind, not far behind
    assert CFG.far * 32.0 / 0.068 < 31.0 / 0.080 < 32.0 / 0.068

    def picks(start, credit):
        arms = Arms(CFG)
        return [arms.choose({"spec": plain, "full": full, "plain": plain}, credit, CFG.credit_cap, last="plain",
                            start=start) for _ in range(CFG.first_look + 4 * CFG.burst)]

    assert "full" in picks({"full": 0.0, "spec": 0.0, "plain": 0.0}, credit=-1.0)  # its first look is free
    assert "full" not in picks({"full": 2.0, "spec": 0.0, "plain": 0.0}, credit=-1.0)  # 2 s to catch up: in debt
    assert "full" not in picks({"full": 2.0, "spec": 0.0, "plain": 0.0}, credit=0.5 * CFG.credit_cap)
    assert "full" in picks({"full": 2.0, "spec": 0.0, "plain": 0.0}, credit=CFG.credit_cap)  # the cap: looks
    assert "full" in picks({"full": 0.5 * CFG.credit_cap, "spec": 0.0, "plain": 0.0}, credit=-1.0)  # cheap: free


def test_goodput_leaves_the_switch_to_plain_out_of_the_plain_arm():
    """A plain step right after drafting ones is slower than the plain steps after it (caches hold
    the drafting's data): a cost of switching, as the drafter's catch-up is for drafting after
    plain steps. Left out of the plain arm's figures, plain decoding that is faster in its own
    steady state (4 tokens in 3 ms against 12 in 12 ms) wins although each burst of it starts with
    a slow switch (8 ms); counted, bursts of 3 would rate it at 12 tokens in 14 ms, behind."""
    policy = GoodputPolicy(k=4, cost=COST, has_draft_model=True, config=FROZEN)

    def seconds(lengths, prev):
        if any(lengths):
            return 0.012
        return 0.003 + (0.005 if any(prev) else 0.0)

    modes = _drive(policy, 4, 600, seconds)
    assert modes[300:].count("plain") / 300 > 0.8, modes[300:]


def test_arms_rate_by_measurement_and_a_neighbours_by_its_ratios():
    """An arm with steps of its own at this batch size is rated by what they measured (tokens per
    second); one seeded from a neighbouring batch size by the model's figures times the
    neighbour's measured / predicted ratios (its rates belong to another batch size); the first own
    step replaces the neighbour's seconds, while its committed / expected tokens only add to the
    neighbour's (a prior of TOKEN_PRIOR its weight: tokens do not drift with the machine)."""
    near = Arms(CFG)
    near.record("full", committed=6.0, expected=8.0, seconds=0.02, predicted=0.01, switched=False)
    near.record("plain", committed=2.0, expected=2.0, seconds=0.01, predicted=0.01, switched=False)
    assert near.rating("full", (100.0, 1.0, 0.0)) == pytest.approx(6.0 / 0.02)  # measured, whatever predicted
    arms = Arms(CFG, seed=near)
    pred = (16.0, 0.05, 0.01)  # this batch size's expectation, profile seconds, catch-up
    assert arms.rating("full", pred) == pytest.approx(16.0 * 0.75 / (0.05 * 2.0 + 0.01))
    assert arms.rating("plain", pred) == pytest.approx(16.0 / (0.05 + 0.01))
    arms.record("full", committed=20.0, expected=16.0, seconds=0.04, predicted=0.05, switched=False)
    w, d = CFG.token_prior, CFG.token_decay
    accuracy = (6.0 * w * d + 20.0) / (8.0 * w * d + 16.0)
    assert arms.rating("full", pred) == pytest.approx(16.0 * accuracy / (0.04 + 0.01))


def test_arms_rate_tokens_over_many_more_steps_than_seconds():
    """Committed tokens vary far more from step to step than seconds, and a burst's few steps of
    them misjudge an arm; tokens do not drift with the
    machine, so an arm's committed / expected ratio follows its last ~50 steps (TOKEN_DECAY), its
    seconds the last ~10 (DECAY). Three unlucky steps (4 tokens where 10 were expected) move the
    rating by under 10%; rated by the last ~10 steps' tokens it fell by 16%."""
    arms = Arms(CFG)
    for _ in range(40):
        arms.record("full", committed=10.0, expected=10.0, seconds=0.01, predicted=0.01, switched=False)
    assert arms.rating("full", (10.0, 0.01, 0.0)) == pytest.approx(1000.0)
    for _ in range(3):
        arms.record("full", committed=4.0, expected=10.0, seconds=0.01, predicted=0.01, switched=False)
    assert 900.0 < arms.rating("full", (10.0, 0.01, 0.0)) < 1000.0
    for _ in range(200):  # a lasting change of acceptance is followed
        arms.record("full", committed=4.0, expected=10.0, seconds=0.01, predicted=0.01, switched=False)
    assert arms.rating("full", (10.0, 0.01, 0.0)) == pytest.approx(400.0, rel=0.02)


def test_the_plan_runs_only_when_clearly_ahead_of_fixed_speculation():
    """"spec" (the planned lengths) is chosen over "full" (every proposal: fixed speculation) only
    when rated more than PLAN_EDGE ahead: their ratings are estimates from a few noisy steps, and
    a plan that ties with fixed speculation risks shorter blocks for nothing."""
    arms = Arms(CFG)
    arms.due = {a: 10**9 for a in arms.arms}  # no exploration due
    full, plain = (3.0, 0.010, 0.0), (1.0, 0.008, 0.0)
    assert CFG.plan_edge > 1.0
    near = {"spec": (3.0 * (1.0 + CFG.plan_edge) / 2, 0.010, 0.0), "full": full, "plain": plain}  # ahead a little
    assert arms.choose(near) == "full"
    clear = {"spec": (3.0 * (CFG.plan_edge + 0.01), 0.010, 0.0), "full": full, "plain": plain}
    assert arms.choose(clear) == "spec"
    behind = {"spec": (3.0 * (CFG.plan_edge + 0.01), 0.010, 0.0), "full": full, "plain": (5.0, 0.008, 0.0)}
    assert arms.choose(behind) == "plain"  # plain ahead of both: no edge needed


def test_switching_between_drafting_and_plain_steps_needs_a_clear_lead():
    """Drafting after plain steps first feeds the drafter all it missed (its catch-up), so the
    measured check keeps the step before's side (drafting or not) unless the other side is rated
    more than SWITCH ahead; between two drafting arms ("spec" and "full") nothing sticks."""
    assert CFG.switch > 1.0
    plain = (1.0, 0.010, 0.0)  # 100 tokens/s
    slightly = (1.0 * (1.0 + CFG.switch) / 2, 0.010, 0.0)  # ahead, by less than SWITCH
    clearly = (1.0 * (CFG.switch + 0.02), 0.010, 0.0)
    low = (0.5, 0.010, 0.0)
    for last, want in (("plain", "plain"), ("full", "full"), (None, "full")):
        arms = Arms(CFG)
        arms.due = {a: 10**9 for a in arms.arms}  # no exploration due
        assert arms.choose({"spec": low, "full": slightly, "plain": plain}, last=last) == want
    arms = Arms(CFG)
    arms.due = {a: 10**9 for a in arms.arms}
    assert arms.choose({"spec": low, "full": clearly, "plain": plain}, last="plain") == "full"
    assert arms.choose({"spec": low, "full": plain, "plain": slightly}, last="full") == "full"
    assert arms.choose({"spec": low, "full": plain, "plain": clearly}, last="full") == "plain"
    # "spec" to "full" (both draft): the better one, no stickiness
    assert arms.choose({"spec": (1.0, 0.010, 0.0), "full": slightly, "plain": low}, last="spec") == "full"


def test_idle_plan_coasts_plain_against_full_alone():
    """Where the plan drafts for no row, its "spec" step is a plain one: "plain" and "spec" rate
    alike, and coasting (no plan for a few steps) then needs "plain" to lead "full" only; with a
    plan that drafts, "spec" is a rival, and coasting needs that `choose` would keep plain
    decoding against it (it leads, or "spec" is not ahead by the margin to leave plain)."""
    arms = Arms(CFG)
    pred = {"spec": (1.0, 0.0101, 0.0), "plain": (1.0, 0.01, 0.0), "full": (1.2, 0.03, 0.0)}
    arms.due = {a: 10**9 for a in arms.arms}  # no exploration due
    assert arms.choose(pred) == "plain"
    assert arms.coast(idle=True) is None  # rated by the model alone: not before steps of its own here
    arms.own.update(arms.arms)  # (as if measured: `rating` reads figures only for arms with steps)
    arms.rates["spec"] = arms.rates["plain"] * (CFG.switch + 0.01)  # a plan that drafts, clearly ahead
    assert arms.coast() is None  # a rival while the plan drafts: decide
    arms.rates["spec"] = arms.rates["plain"] * 1.01  # within the margin `choose` asks to leave plain
    assert arms.coast() == "plain"  # (choose would keep plain decoding: only the plan is skipped)
    arms.lease = 0
    assert arms.coast(idle=True) == "plain"
    arms.current, arms.lease = "spec", 0  # a near tie the other way: the idle plan's spec step is plain anyway
    assert arms.coast(idle=True) == "plain"  # (the lease ends: this test sets what `coast` reads directly)
    arms.due["full"], arms.lease = 0, 0  # a burst of "full" due: decide instead
    assert arms.coast(idle=True) is None
    arms.due["full"] = 10**9
    arms.coasted = CFG.coast_steps  # far ahead of "full" (2.5x): coasts longer
    assert arms.coast(idle=True) == "plain"
    arms.coasted, arms.lease = CFG.far_coast_steps, 0  # coasted long enough: decide again
    assert arms.coast(idle=True) is None
    arms.rates["full"] = 0.85 * arms.rates["plain"]  # ahead, not far ahead: COAST_STEPS
    arms.coasted = CFG.coast_steps - 1
    assert arms.coast(idle=True) == "plain" and arms.coast(idle=True) is None


def test_full_plan_coasts_full_against_plain_alone():
    """Where the plan drafts all it may for every row, its "spec" step is a "full" one: the two rate
    alike, and coasting as "full" (no plan, no admission for a few steps) then needs "full" to lead
    "plain" only; with a plan that leaves proposals out, "spec" is a rival; either way it coasts
    while `choose` would keep it (a rival ahead by less than the margin it asks)."""
    arms = Arms(CFG)
    pred = {"spec": (3.0, 0.0101, 0.0), "full": (3.0, 0.01, 0.0), "plain": (1.0, 0.01, 0.0)}
    arms.due = {a: 10**9 for a in arms.arms}  # no exploration due
    assert arms.choose(pred) == "full"  # (the plan must beat "full" clearly)
    assert arms.coast(full=True) is None  # rated by the model alone: not before steps of its own here
    arms.own.add("spec")  # the plan's steps measured here: they are "full"'s too
    assert arms.coast() is None  # a plan leaving some out: "full" has no steps of its own here
    assert arms.coast(full=True) == "full"
    arms.current, arms.lease = "spec", 0  # a near tie the other way: the full plan's spec step is "full" anyway
    assert arms.coast(full=True) == "full"
    arms.due["plain"], arms.lease = 0, 0  # a burst of "plain" due: decide instead
    assert arms.coast(full=True) is None
    arms.due["plain"] = 10**9
    arms.rates["full"] = 1.05 * arms.rates["plain"]  # ahead, under COAST: choose would keep it (SWITCH)
    assert arms.coast(full=True) == "full"
    arms.rates["plain"], arms.lease = arms.rates["full"] * (CFG.switch + 0.01), 0  # plain clearly ahead
    assert arms.coast(full=True) is None


def test_coasting_on_a_lease_decides_as_the_full_checks_would():
    """`coast` skips its checks for the steps its lease covers (before the limit and any rival's
    turn): over random decisions, credits and ratings, it answers exactly as without the lease."""
    class NoLease(Arms):
        def coast(self, *a, **k):
            self.lease = 0
            return super().coast(*a, **k)

    rng = random.Random(5)
    leased, checked = Arms(CFG), NoLease(CFG)
    for arms in (leased, checked):
        arms.own.update(arms.arms)  # (as if measured here: only a measured leader coasts)
    used, idle, full = 0, True, False
    for step in range(4000):
        credit = rng.choice([0.0, 0.001, 1.0])
        answers = [arms.coast(credit, 0.25, idle=idle, full=full) for arms in (leased, checked)]
        assert answers[0] == answers[1], step
        used += leased.lease > 0
        if answers[0] is None:  # a plan runs (only it can change `idle`) and the check decides
            idle = rng.random() < 0.6
            full = not idle and rng.random() < 0.7
            lead, last = rng.choice(["plain", "full", "spec"]), rng.choice(["plain", "full"])
            pred = {a: (1.0 if a != lead else rng.choice([1.02, 1.2, 3.0]), 0.01, 0.0) for a in ARMS}
            choices = [arms.choose(pred, credit, 0.25, last=last) for arms in (leased, checked)]
            assert choices[0] == choices[1], step
    assert used > 100  # the leases were used


def _looking_cost(budget: float, cap: float, steps: int = 6000) -> tuple[float, float, int]:
    """A clock where plain decoding leads at 4 rows and every look away costs: verified tokens
    2 ms each, and the first drafting step after plain ones 100 ms of drafter catch-up. Returns
    the seconds the looks cost against plain decoding's rate, the run's seconds, and the looks."""
    config = GoodputConfig(explore_budget=budget, credit_cap=cap)
    policy = GoodputPolicy(k=4, cost=COST, has_draft_model=True, config=config)  # COST says: speculate
    seqs = [SimpleNamespace(seq_id=i, params=SamplingParams(temperature=0), num_tokens=50) for i in range(4)]
    plain_rate = 4 / 0.005
    lost = total = 0.0
    looks, prev, seen_plain = 0, "plain", False
    for _ in range(steps):
        lengths = policy.plan(seqs, [4] * 4)
        blocks = [DraftBlock([1] * n, None, [0.9] * n) for n in lengths]
        admitted = policy.admit(seqs, blocks, 0.0)
        for s, blk, n in zip(seqs, blocks, admitted):
            policy.observe(s, blk, n, min(n, 2))
        tokens = 4 + sum(admitted)
        catch_up = 0.1 if any(lengths) and prev == "plain" else 0.0
        seconds = 0.005 + 0.002 * (tokens - 4) + catch_up
        policy.observe_step(timing(4, tokens, lengths, seconds, catch_up))
        committed = 4 + sum(min(n, 2) for n in admitted)
        if any(lengths) and seen_plain:  # (the steps before: the profile's word, not a look)
            lost += seconds - committed / plain_rate
            looks += prev == "plain"
        total += seconds
        prev = "drafting" if any(lengths) else "plain"
        seen_plain = seen_plain or prev == "plain"
    return lost, total, looks


def test_goodput_looks_away_within_its_budget():
    """Where plain decoding leads clearly and each look at speculation pays a long drafter
    catch-up, the looks (bursts of the other arms, engine-wide probes) cost about EXPLORE_BUDGET
    of the run, after the first look at each arm (free: its cost is not known); without the
    budget the same run spends several times that."""
    lost, total, looks = _looking_cost(CFG.explore_budget, CFG.credit_cap)
    first_look = 0.1 + CFG.burst * (0.005 + 0.002 * 16)  # its cost not known yet
    assert looks >= 2  # it still looks
    assert lost <= CFG.explore_budget * total + first_look, (lost, total, looks)
    lost_free, total_free, looks_free = _looking_cost(1.0, float("inf"))  # every due look affordable
    assert lost_free > 1.5 * lost and looks_free > looks, (lost_free, lost, looks_free, looks)


def test_a_look_that_ties_waits_longer_and_one_that_leads_resets():
    """After a burst of an arm: its next look comes EXPLORE_EVERY steps later only when the burst
    put it more than 5% (MARGIN) ahead of the others; a tie doubles its interval as being behind
    does (each look at drafting after plain steps pays the drafter's catch-up, outside the arms'
    figures, for a rate that hardly differs)."""
    def burst(own_rate: float) -> int:
        arms = Arms(CFG)
        arms.own = set(arms.arms)
        arms.interval = {a: 4 * CFG.explore_every for a in arms.arms}
        arms.due = {a: 10**9 for a in arms.arms}
        arms.due["full"] = 0  # its turn now
        start = {"spec": (0.5, 0.010, 0.0), "full": (0.9, 0.010, 0.0), "plain": (1.0, 0.010, 0.0)}
        assert arms.choose(start, last="plain") == "full"  # plain leads; the burst of "full" starts
        for _ in range(CFG.burst - 1):
            assert arms.choose(start, last="full") == "full"
        measured = dict(start, full=(own_rate, 0.010, 0.0))  # what the burst measured
        arms.choose(measured, last="full")  # the burst ends: its interval is set from the ratings
        return arms.interval["full"]

    assert burst(1.0) == 8 * CFG.explore_every  # a tie: later
    assert burst(1.02) == 8 * CFG.explore_every  # ahead, not clearly: later
    assert burst(0.9) == 8 * CFG.explore_every  # behind: later
    assert burst(0.5) == 16 * CFG.explore_every  # far behind: much later
    assert burst(1.2) == CFG.explore_every  # clearly ahead: soon again



def test_goodput_is_sure_of_plain_steps_only_while_coasting_on_plain():
    """`plain_next` (the scheduler may then give a lone row several target steps a call) holds
    only while the policy coasts on plain decoding at that batch size: the next plan then drafts
    nothing, for certain. Another batch size, or a coast on fixed speculation, is not plain for
    certain."""
    for verify_seconds, accept, coasts_plain in ((0.010, 0, True), (0.0002, 4, False)):
        policy = GoodputPolicy(k=4, cost=COST, has_draft_model=True, config=FROZEN)
        seqs, sure = rows(1), 0
        for _ in range(400):
            told = policy.plain_next(1)
            assert not policy.plain_next(2)  # not the batch size it decided for
            lengths = policy.plan(seqs, [4])
            if told:
                sure += 1
                assert lengths == [0] and policy.hints().arm == "plain"
            blocks = [DraftBlock([1] * n, None, [0.9] * n) for n in lengths]
            admitted = policy.admit(seqs, blocks, 0.0)
            policy.observe(seqs[0], blocks[0], admitted[0], min(admitted[0], accept))
            policy.observe_step(timing(1, 1 + admitted[0], lengths, 0.005 + verify_seconds * admitted[0]))
        # (coasting on plain, the first look at fixed speculation, early while it is unmeasured,
        # leaves the exploration budget in debt on this 5 ms clock: until it is repaid the coast
        # is checked step by step, without a lease)
        assert sure > 100 if coasts_plain else sure == 0, sure


def test_rows_of_a_step_sure_to_be_plain_reach_plan_with_nothing_to_draft(target_dir, draft_dir):
    """A step the policy is sure runs plain (`plain_next`) reserves no K/V for drafted proposals:
    its rows still reach `plan` (which counts its lease down), with 0 to draft whatever the policy
    would like: no proposal, no drafter K/V, plain decoding's tokens."""
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(target_dir)).generate(PROMPTS[:4], sp)]
    llm = LLM(str(target_dir), draft=str(draft_dir), spec=SpecConfig(method="draft", k=3), multi_step=1)
    seen = []

    def greedy_plan(seqs, max_draft):  # a policy that would draft all it may, and is told 0
        seen.append(list(max_draft))
        return list(max_draft)

    llm.engine.policy.plan = greedy_plan
    llm.engine.scheduler.plain_next = lambda num_seqs: True
    assert [o.token_ids for o in llm.generate(PROMPTS[:4], sp)] == want
    assert len(seen) >= 20 and all(m == 0 for row in seen for m in row)  # (the last step drafts nothing anyway)
    assert llm.engine.stats.proposed_tokens == 0 and not llm.engine.proposer.kv.tables


def test_goodput_coasting_on_fixed_speculation_calibrates_one_step_in_four():
    """While fixed speculation leads by far (it coasts: no plan, every proposal verified), one
    coasting step in COAST_OBSERVE_EVERY feeds the calibration; the other steps ("thin": they
    read no confidence, so their drafter skips max q_j) only count their tokens, and the decided
    steps feed it all. Thin steps draft at confidence 0.05, the others at 0.95, every proposal
    accepted: the estimates are exactly those of the other steps' observations alone."""
    policy = GoodputPolicy(k=4, cost=COST, has_draft_model=True, config=FROZEN)
    reference = Calibration()  # fed what the policy's calibration should have been fed
    seqs, thin, modes = rows(4), [], []
    for _ in range(400):
        lengths = policy.plan(seqs, [4] * 4)
        hints = policy.hints()
        thin.append(not hints.reads_confidence)
        modes.append(hints.arm)
        conf = 0.05 if thin[-1] else 0.95
        blocks = [DraftBlock([1] * n, None, [conf] * n) for n in lengths]
        admitted = policy.admit(seqs, blocks, 0.0)
        for s, blk, n in zip(seqs, blocks, admitted):
            policy.observe(s, blk, n, n)
            if n and not thin[-1]:
                reference.observe(s.seq_id, True, blk.confidence[:n], n)
        policy.observe_step(timing(4, 4 + sum(admitted), lengths, 0.005 + 0.0002 * sum(lengths)))  # nearly free
    assert modes[200:].count("full") > 180, modes[200:]
    assert sum(thin) > 200 and all(m == "full" for t, m in zip(thin, modes) if t)  # most steps coast on "full"
    fed = sum(1 for t, m in zip(thin, modes) if not t and m != "plain")
    assert fed < 0.5 * sum(m != "plain" for m in modes)
    calibration = policy.core.calibration
    for conf in (0.05, 0.95):
        assert calibration.engine_rate(True, conf) == reference.engine_rate(True, conf)
    assert calibration.engine_rate(True, 0.05) < 0.1 < 0.99 < calibration.engine_rate(True, 0.95)  # (not vacuous)
    assert calibration.position_rates(99, 4) == reference.position_rates(99, 4)


@register_policy("every-other-confidence-test")
class EveryOtherConfidence(StatelessPolicy):
    """Test only: drafts and verifies all it may (as `fixed`), and reads the drafted blocks'
    confidences in every other step (as goodput's thin steps do not)."""

    needs_confidence = True

    def __init__(self, **_):
        self.steps = 0

    def plan(self, seqs, max_draft):
        self.steps += 1
        return list(max_draft)

    def hints(self):
        return StepHints(reads_confidence=self.steps % 2 == 0)

    def admit(self, seqs, blocks, draft_seconds):
        return [len(b.token_ids) for b in blocks]


def test_steps_that_read_no_confidence_draft_without_and_keep_greedy_output(target_dir, draft_dir):
    """The engine asks the policy after each plan whether the step reads the drafted blocks'
    confidences (`hints().reads_confidence`): steps that do not draft without computing max q_j;
    the output is plain decoding's all the same."""
    sp = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(target_dir)).generate(PROMPTS[:2], sp)]
    llm = LLM(str(target_dir), draft=str(draft_dir), spec=SpecConfig(method="draft", k=3,
                                                                     policy="every-other-confidence-test"))
    proposer, policy = llm.engine.proposer, llm.engine.policy
    seen = []
    propose = proposer.propose

    def spy(seqs, plan, forced):
        blocks = propose(seqs, plan, forced)
        reads = policy.hints().reads_confidence
        seen.append((proposer.confidence, reads, all(c is None for b in blocks for c in (b.confidence or []))))
        return blocks

    proposer.propose = spy
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], sp)] == want
    assert any(reads for _, reads, _ in seen) and not all(reads for _, reads, _ in seen)
    for conf, reads, none in seen:
        assert conf == reads and (none or reads), (conf, reads, none)


def test_a_first_look_is_not_deferred_for_a_catch_up():
    """An arm never run that the model rates far behind waits 4x for its first look, but the
    drafter's catch-up (paid once, when drafting starts) does not count toward "far": fresh prompts
    to catch up on, with fixed speculation ahead in its steady state, still get their first look at
    it within FIRST_LOOK steps (and a burst of the other arm due)."""
    plain = (32.0, 0.068, 0.0)  # 470 tokens/s
    full = (70.0, 0.168, 0.034)  # 347 tokens/s counting the catch-up (< FAR x 470), 417 without
    assert 70.0 / 0.202 < CFG.far * 32.0 / 0.068 < 70.0 / 0.168
    arms = Arms(CFG)
    picks = [arms.choose({"spec": plain, "full": full, "plain": plain}, last="plain") for _ in range(40)]
    assert "full" in picks[: CFG.first_look + 2 * CFG.burst], picks  # (after a look at "spec")
    far = (50.0, 0.168, 0.0)  # behind in its steady state: deferred
    arms = Arms(CFG)
    picks = [arms.choose({"spec": plain, "full": far, "plain": plain}, last="plain") for _ in range(40)]
    assert "full" not in picks, picks


def test_a_catch_up_is_spread_over_the_steps_a_row_has_left():
    """The drafter's catch-up before a row's first proposal is spread over CATCH_UP_HORIZON steps,
    or over the steps the row has left (its tokens left over what a step drafting all it may is
    expected to commit): near a request's end a catch-up serves few steps. The plan then drafts
    for a lagging row far from its end, not for one about to finish."""
    planner = Planner(CFG, COST, has_draft_model=True)
    sp = SamplingParams(temperature=0, max_tokens=200)
    near = SimpleNamespace(seq_id=0, params=sp, num_tokens=300, output_ids=[1] * 196, draft_computed=60)
    far = SimpleNamespace(seq_id=1, params=sp, num_tokens=300, output_ids=[1] * 20, draft_computed=60)
    gains = [0.9, 0.72, 0.5, 0.3]  # prod_{m<=j} a_m
    assert planner.horizon(far, gains) == pytest.approx(min(CFG.catch_up_horizon, 180 / 3.42))
    assert planner.horizon(near, gains) == pytest.approx(4 / 3.42)  # 4 tokens left, 3.42 a step
    assert planner.horizon(SimpleNamespace(params=sp), gains) == CFG.catch_up_horizon  # no history
    catch = [240 * 1e-4 / planner.horizon(s, gains) for s in (near, far)]  # 24 ms behind each: 20 and ~0.5 ms a step
    lengths, _ = choose_lengths([gains, gains], lambda tokens: 0.010 + 0.0005 * (tokens - 2), first_cost=catch)
    assert lengths[0] == 0 and lengths[1] > 0, lengths  # equal gains: the row with less catch-up first


def test_arms_compare_their_steps_at_the_contexts_of_now():
    """A step's time grows with the rows' contexts: two arms whose steps were taken at different
    times are compared as if both ran at today's contexts, each by the profile's seconds per
    token of context of its own steps. "full" ran fast at short contexts; "plain" ran later, at
    long ones; at those contexts "full" (whose drafter steps also read the context) is the slower."""
    arms = Arms(CFG)
    for _ in range(10):  # 12 tokens in 10 ms at context 100, 3e-5 s per token of context
        arms.record("full", committed=12.0, expected=12.0, seconds=0.010, predicted=0.010, switched=False,
                    context=(100.0, 3e-5))
    for _ in range(10):  # 8 tokens in 9 ms at context 300, 1e-5 s per token of context
        arms.record("plain", committed=8.0, expected=8.0, seconds=0.009, predicted=0.009, switched=False,
                    context=(300.0, 1e-5))
    now = {"spec": (8.0, 0.010, 0.0, 300.0, 3e-5), "full": (12.0, 0.010, 0.0, 300.0, 3e-5),
           "plain": (8.0, 0.009, 0.0, 300.0, 1e-5)}
    assert arms.rating("full", now["full"]) == pytest.approx(12.0 / (0.010 + 3e-5 * 200))  # 750 tok/s
    assert arms.rating("plain", now["plain"]) == pytest.approx(8.0 / 0.009)  # its own contexts: as measured
    assert arms.rating("full", now["full"][:3]) == pytest.approx(1200.0)  # uncorrected, it would lead
    arms.due = {a: 10 ** 9 for a in arms.arms}
    assert arms.choose(now) == "plain"


def test_a_coasting_arm_keeps_measuring_its_steps():
    """The leading arm coasts (no plan), and one coasting step in COAST_OBSERVE_EVERY is recorded
    in its figures: when its steps slow down (the machine, longer contexts), its rating follows
    them, not the steps planned before the coast. Plain decoding leads (2 tokens in 4 ms against
    4 in ~11 ms drafting) and coasts; its steps slow to 8 ms: drafting takes over within two long
    coasts (`far_coast_steps`) and stays (with the figures frozen at the coast's start, plain kept
    its lead of 500 tok/s against 360 for good)."""
    policy = GoodputPolicy(k=4, cost=COST, has_draft_model=True, config=FROZEN)
    plain_seconds = [0.004]
    seqs = rows(2)

    def drive(steps):  # the first proposal of each block accepted
        modes, sure = [], 0
        for _ in range(steps):
            sure += policy.plain_next(2)  # a lease of plain decoding: coasting
            lengths = policy.plan(seqs, [4, 4])
            modes.append(policy.hints().arm)
            blocks = [DraftBlock([1] * n, None, [0.9] * n) for n in lengths]
            admitted = policy.admit(seqs, blocks, 0.0)
            for s, blk, n in zip(seqs, blocks, admitted):
                policy.observe(s, blk, n, min(n, 1))
            seconds = 0.010 + 0.0005 * sum(admitted) if any(lengths) else plain_seconds[0]
            policy.observe_step(timing(2, 2 + sum(admitted), lengths, seconds))
        return modes, sure

    modes, sure = drive(300)
    assert modes[-200:] == ["plain"] * 200 and sure > 40  # plain decoding leads by far: it coasts
    plain_seconds[0] = 0.008
    modes, _ = drive(150)
    switch = next(i for i in range(len(modes)) if "plain" not in modes[i:])
    assert switch < 2 * CFG.far_coast_steps + CFG.burst, modes
