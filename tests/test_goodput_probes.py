"""The goodput policy's measured check and its probes: the clock settles the arm; probes back off
with a useless drafter, per row and engine-wide, and none is made where the load alone stops drafting.

Driven through the policy's interface on synthetic clocks (tests/policy_helpers.py).
"""
import random
from types import SimpleNamespace

import pytest

from draftwise import SamplingParams
from draftwise.policies import CostModel
from draftwise.policies.goodput import GoodputPolicy
from draftwise.policies.goodput.plan import Planner
from draftwise.proposers import DraftBlock

from policy_helpers import COST, DEAR, CFG, FROZEN, rows, timing, never_right, burst_starts


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


def test_grid_cost_never_predicts_less_for_more_tokens():
    """A measured dip (4 rows timed faster than 1 to 3: noise, caches) is pooled:
    seconds are non-decreasing in tokens, the least-squares such curve (pool adjacent violators)."""
    from draftwise.policies.cost import GridCost, monotone

    pooled = monotone([(1, 2.88), (2, 3.09), (3, 2.94), (4, 2.35), (5, 3.30)])
    assert [x for x, _ in pooled] == [1, 2, 3, 4, 5]
    assert [y for _, y in pooled] == pytest.approx([2.815, 2.815, 2.815, 2.815, 3.30])
    assert monotone([(1, 1.0), (2, 2.0)]) == [(1, 1.0), (2, 2.0)]
    ms = [2.88, 3.09, 2.94, 2.35, 3.30]
    g = GridCost(COST, [(1, t, 64, x / 1000) for t, x in zip(range(1, 6), ms)])
    seconds = [g.target_seconds(1, t, 64) for t in range(1, 6)]
    assert all(a <= b for a, b in zip(seconds, seconds[1:])) and seconds[0] == pytest.approx(0.002815)


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
