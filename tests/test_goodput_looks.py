"""The goodput policy's looks at the arms it is not running: new batch sizes start from a
neighbour, first looks and their budget, arms rated by measurement, the plan's lead, coasting on
leases, and the exploration budget.

Driven through the policy's interface on synthetic clocks (tests/policy_helpers.py).
"""
import random
from types import SimpleNamespace

import pytest

from draftwise import SamplingParams
from draftwise.policies.goodput import ARMS, Arms, GoodputConfig, GoodputPolicy
from draftwise.proposers import DraftBlock

from policy_helpers import COST, CFG, FROZEN, rows, timing


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
