"""The `dspark` policy's plan and admission as the load and the drafter's cost change: fewer
verified rows per row under load, a step's whole rate for a row, nothing drafted for a useless
drafter (but probes), no drafting of what admission always cuts, coasting after a plan that drafts
nothing, the cost of a feature drafter's call, and the policy's whole interface."""
import pytest

from draftwise.policies import CostModel, Policy, StepTiming, policy_class
from draftwise.policies.cost import BlockCost
from draftwise.policies.dspark import DSparkPolicy
from draftwise.policies.goodput.plan import choose_lengths
from draftwise.policies.goodput import GoodputConfig
from draftwise.proposers import DraftBlock
from policy_helpers import COST, never_right, rows

FROZEN = GoodputConfig(learn_step_cost=False)
DEAR_DRAFTER = CostModel(COST.target, (0.02, 0.01, 0.0))  # a drafter step dearer than any gain


def blocks_of(confidences, rows_):
    return [DraftBlock([1] * len(confidences), None, list(confidences)) for _ in range(rows_)]


def test_dspark_verifies_less_per_row_under_load():
    """The same confidences: one row verifies all four proposals, sixteen rows fewer each (the
    profile's verified token costs more of a loaded step)."""
    conf = [0.9, 0.8, 0.7, 0.6]
    got = {}
    for b in (1, 16):
        policy = DSparkPolicy(k=4, cost=COST, has_draft_model=False, config=FROZEN)
        seqs = rows(b)
        policy.plan(seqs, [4] * b)
        got[b] = sum(policy.admit(seqs, blocks_of(conf, b), 0.0)) / b
    assert got[1] == 4 and got[16] <= 2, got


def test_dspark_prices_rows_at_the_whole_steps_rate():
    """Theta's seconds are the planned drafting plus the verification: the plan predicts its
    drafter steps, and with drafting as dear as a verification a proposal too weak to pay for its
    row at the verification-only rate is verified, as the long-run rate (drafting included) says."""
    policy = DSparkPolicy(k=4, cost=CostModel(COST.target, (0.0006, 0.0002, 0.0)), has_draft_model=True,
                          config=FROZEN)
    seqs = rows(1)
    lengths = policy.plan(seqs, [4])
    assert sum(lengths) >= 1 and policy.draft_seconds == pytest.approx(0.0008 * lengths[0])
    conf = [0.9, 0.5, 0.5, 0.5]  # survivals about 0.93, 0.49, 0.25, 0.13
    policy.draft_seconds = 0.004  # four such drafter steps planned
    with_drafting = policy.admit(seqs, blocks_of(conf, 1), 0.0)
    policy.draft_seconds = 0.0  # the verification-only Theta
    verification_only = policy.admit(seqs, blocks_of(conf, 1), 0.0)
    assert with_drafting[0] > verification_only[0], (with_drafting, verification_only)


def test_dspark_drafts_nothing_for_a_useless_drafter_but_probes():
    """After a drafter that is never right (observed through the interface), the plan drafts for no
    row but the probes: one row at a time, the first after `probe_every` idle steps."""
    policy = DSparkPolicy(k=4, cost=COST, has_draft_model=True, config=FROZEN)
    never_right(policy, confidences=[(b + 0.5) / 20 for b in range(20)] + [None])
    seqs, drafted = rows(4), []
    for _ in range(3 * GoodputConfig().probe_every):
        lengths = policy.plan(seqs, [4] * 4)
        drafted.append(sum(lengths))
        if any(lengths):
            admitted = policy.admit(seqs, [DraftBlock([1] * n, None, [0.1] * n) for n in lengths], 0.0)
            assert sum(admitted) == 1  # the probe's first proposal, nothing more at that confidence
            for s, n in zip(seqs, admitted):
                policy.observe(s, DraftBlock([1] * n, None, [0.1] * n), n, 0)
        policy.observe_step(StepTiming(4, 4 + sum(lengths), 50.0, lengths, 0.004))
    assert 1 <= sum(drafted) <= 3 and max(drafted) == 1, drafted


def test_dspark_stops_drafting_what_admission_always_cuts():
    """A drafter whose confidences admission always cuts (nothing verified, so no acceptance is
    ever observed): the plan learns the cut proposals' calibrated rates and stops drafting within
    a few rounds instead of paying the drafter every step."""
    policy = DSparkPolicy(k=4, cost=COST, has_draft_model=True, config=FROZEN)
    seqs, planned = rows(1), []
    for _ in range(8):
        lengths = policy.plan(seqs, [4])
        planned.append(lengths[0])
        if lengths[0]:
            block = DraftBlock([1] * lengths[0], None, [0.001] * lengths[0])
            assert policy.admit(seqs, [block], 0.0) == [0]
            policy.observe(seqs[0], block, 0, 0)
        policy.observe_step(StepTiming(1, 1, 50.0, lengths, 0.004))
    assert planned[0] > 0 and planned[-4:] == [0] * 4, planned


def test_dspark_coasts_after_a_plan_that_drafts_nothing():
    """A plan that drafts for no row: the next coast_steps steps of that batch run plain without
    a plan (`plain_next`), not past the engine-wide probe, and not after a request ends."""
    policy = DSparkPolicy(k=4, cost=DEAR_DRAFTER, has_draft_model=True, config=FROZEN)
    seqs = rows(2)
    assert not policy.plain_next(2)  # nothing planned yet
    assert policy.plan(seqs, [4, 4]) == [0, 0]
    held = 0
    while policy.plain_next(2):
        assert not policy.plain_next(3)  # another batch size plans
        assert policy.plan(seqs, [0, 0]) == [0, 0]  # a held step: no row may draft
        policy.observe_step(StepTiming(2, 2, 50.0, [0, 0], 0.004))
        held += 1
    assert held == min(FROZEN.coast_steps, FROZEN.probe_every - 1), held
    policy.plan(seqs, [4, 4])
    assert policy.plain_next(2)
    policy.forget(seqs[0].seq_id)
    assert not policy.plain_next(2)


def test_block_cost_learns_a_drafting_call():
    cost = BlockCost()
    assert cost.seconds(1) == 0.0  # nothing measured yet: the first steps draft and measure
    for _ in range(20):
        cost.observe(1, 0.003)
    assert cost.seconds(1) == pytest.approx(0.003) and cost.seconds(4) == pytest.approx(0.003)  # one batch size
    for rows_, s in ((1, 0.003), (4, 0.0045), (8, 0.0065)) * 30:
        cost.observe(rows_, s)
    assert cost.seconds(16) > cost.seconds(8) > cost.seconds(1) and cost.seconds(0) == 0.0


def test_choose_lengths_charges_a_block_drafter_once_a_row():
    """A block drafter's call costs the same for one proposal or four: a row that drafts at all
    drafts its whole block's worth of gain, and a call dearer than the gain drafts nothing."""
    gains = [[0.9, 0.8, 0.7, 0.6]]
    step = COST.target_seconds  # (the profile's target)
    call = lambda rows_: 0.002 * rows_  # noqa: E731
    lengths, _ = choose_lengths(gains, lambda t: step(1, t), call, block=True)
    per_step, _ = choose_lengths(gains, lambda t: step(1, t), call)
    assert lengths == [4] and per_step[0] < 4  # (per step, four calls: the last proposals do not pay)
    dear = lambda rows_: 0.05  # noqa: E731
    assert choose_lengths(gains, lambda t: step(1, t), dear, block=True)[0] == [0]


@pytest.mark.parametrize("call_seconds,drafts", [(0.0002, True), (0.05, False)])
def test_dspark_prices_a_feature_drafters_call(call_seconds, drafts):
    """A drafter on the target's features (`block_drafter`): the plan drafts a row's whole block
    or nothing, by the drafting seconds the engine measured; a call dearer than what its block
    gains runs plain (probes aside), a cheap one drafts every step."""
    policy = DSparkPolicy(k=4, cost=COST, has_draft_model=False, config=FROZEN, block_drafter=True)
    seqs, planned = rows(1), []
    for _ in range(12):
        lengths = policy.plan(seqs, [4])
        planned.append(lengths[0])
        assert lengths[0] in (0, 4)  # a whole block or none
        if lengths[0]:
            assert policy.draft_seconds == policy.core.block.seconds(1)
            block = DraftBlock([1] * 4, None, [0.9] * 4)
            n = policy.admit(seqs, [block], 0.0)[0]
            policy.observe(seqs[0], block, n, n)
        policy.observe_step(StepTiming(1, 1 + lengths[0], 50.0, lengths, 0.004 + (call_seconds if lengths[0] else 0),
                                       draft_seconds=call_seconds if lengths[0] else 0.0))
    assert planned[0] == 4  # before any call is measured: drafting looks free
    assert (planned[-4:] == [4] * 4) if drafts else (planned[-4:] == [0] * 4), planned


def test_dspark_has_the_whole_interface():
    policy = policy_class("dspark")(k=3, cost=COST, has_draft_model=True)
    assert isinstance(policy, Policy) and policy.hints().reads_confidence and not policy.plain_next(2)
    pred = policy.observe_step(StepTiming(2, 4, 50.0, [1, 1], 0.005))
    assert pred is not None and pred.profile_seconds > 0
    assert policy.observe_step(StepTiming(2, 4, 50.0, [1, 1], None)) is None  # an untimed step: nothing learned
    with pytest.raises(ValueError):
        DSparkPolicy(k=3, cost=None)


def test_catch_ups_timed_slow_move_the_learned_cost_a_few_times_not_tenfold():
    """The drafter's seconds per caught-up token are learned in log space: three catch-ups timed
    50x slow (a cold first round) leave the estimate 50 ** (1 - 0.8 ** 3) = 6.7x (a step in seconds:
    25x, which kept the dspark policy from restarting drafting for good), and timings at the old
    rate bring it back."""
    from draftwise.policies.goodput.plan import Planner

    core = Planner(GoodputConfig(), COST, has_draft_model=True)
    base = core.catch_up_per_token

    def timed(per_token):
        core.long_catch_up = 200
        core.learn_catch_up(200 * per_token)

    for _ in range(3):
        timed(50 * base)
    assert core.catch_up_per_token / base == pytest.approx(50 ** (1 - 0.8 ** 3), rel=1e-9)
    for _ in range(30):
        timed(base)
    assert core.catch_up_per_token / base == pytest.approx(1.0, abs=0.01)
    step = Planner(GoodputConfig(catch_up_log=False), COST, has_draft_model=True)  # the A/B's other rule
    for _ in range(3):
        step.long_catch_up = 200
        step.learn_catch_up(200 * 50 * base)
    assert step.catch_up_per_token / base == pytest.approx(1 + 49 * (1 - 0.8 ** 3), rel=1e-9)  # 24.9x
    core.long_catch_up = 0
    before = core.catch_up_per_token
    core.learn_catch_up(0.5)  # no long catch-up this step: nothing learned
    assert core.catch_up_per_token == before


def test_slow_drafting_steps_fade_over_unobserved_steps():
    """Drafting steps timed 10x slow put the cost of a drafted token high; once the plan stops
    drafting, a lone row's plain steps run several to a call and are not observed. Earlier
    observations fade by the steps that ran unobserved, so a few normal steps after 400 of them
    outweigh them tenfold, after 1,000 entirely; observed back to back they would still dominate."""
    from draftwise.policies.cost import OnlineCost

    def fit(gap):
        model = OnlineCost(COST)
        for _ in range(20):
            for tokens, lengths in ((5, [4]), (1, [])):
                pred = model.profile_seconds(1, tokens, 300.0, lengths)
                model.observe(1, tokens, 300.0, lengths, pred * (10 if lengths else 1))
        # a probe after `gap` engine steps, then plain steps, at the profile's cost (the fit is
        # solved every fourth observation)
        for i, (tokens, lengths) in enumerate(((2, [1]), (1, []), (1, []), (1, []))):
            model.observe(1, tokens, 300.0, lengths, model.profile_seconds(1, tokens, 300.0, lengths),
                          steps=gap if i == 0 else 1)
        return model.residual(1, 5, 4) - model.residual(1, 1, 0)  # what 4 drafted tokens add to a step

    slow = fit(1)
    assert slow > 0.02 and fit(400) < 0.1 * slow and abs(fit(1000)) < 0.0005


def test_the_planner_fades_its_cost_fit_by_multi_step_calls():
    """The planner counts a multi-step call's steps past its first as unobserved and hands them to
    the cost fit with the next observed step (none with `cost_fade_by_steps` off)."""
    from draftwise.policies.goodput.plan import Planner

    seen = []
    for fade in (True, False):
        core = Planner(GoodputConfig(cost_fade_by_steps=fade), COST, has_draft_model=True)
        core.model.observe = lambda *a, steps=1, **k: seen.append(steps)
        core.count_step(StepTiming(1, 1, 50.0, [0], None, num_steps=8))  # a multi-step plain call
        core.count_step(StepTiming(1, 1, 50.0, [0], 0.002))
        core.observe_cost(StepTiming(1, 1, 50.0, [0], 0.002), [], 0.002)
        core.observe_cost(StepTiming(1, 1, 50.0, [0], 0.002), [], 0.002)
    assert seen == [8, 1, 1, 1]
