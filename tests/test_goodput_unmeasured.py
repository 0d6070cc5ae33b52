"""The goodput policy before fixed speculation has steps of its own at a batch size: its rating
there is the acceptance estimates' (at first a prior of 0.5 a position), not a measurement.
Whether the load alone stops drafting is then asked of fixed speculation rated as if every
proposal were accepted: where even that loses to plain steps no engine-wide probe is made
(`test_no_engine_wide_probes_where_the_load_stops_drafting` in tests/test_goodput_probes.py);
where it could lead, a probe and the check's first look measure it, and a pessimistic prior no
longer holds back a drafter that pays.

Driven through the policy's interface on a synthetic clock (the cost model itself)."""
from types import SimpleNamespace

from draftwise import SamplingParams
from draftwise.policies import CostModel, StepTiming
from draftwise.policies.goodput import Arms, GoodputConfig, GoodputPolicy
from draftwise.proposers import DraftBlock

# one row: a plain step 42 ms, each verified token 8.5 ms more, a drafter step 14.4 ms (the shape of
# the Qwen2.5-Coder 1.5B target with its 0.5B draft at batch 1): fixed k=4 pays from ~0.72 acceptance
# a position (every proposal accepted: 1.57x plain), not at the prior 0.5 (1.94 tokens: 0.61x)
PAYS_IF_RIGHT = CostModel((0.0335, 0.0, 0.0085, 0.0), (0.0144, 0.0, 0.0))
CFG = GoodputConfig()


def clock(b: int, tokens: int, lengths) -> float:
    """A step's seconds on the synthetic clock: the target's forward and the drafter's steps."""
    return PAYS_IF_RIGHT.target_seconds(b, tokens) + sum(
        PAYS_IF_RIGHT.draft_seconds(sum(1 for n in lengths if n > j)) for j in range(max(lengths, default=0)))


def run(policy: GoodputPolicy, steps: int, b: int = 1, accept=lambda n: n) -> tuple[list[int], list[str]]:
    """Steps of `b` greedy rows whose drafter is right `accept(n)` of n verified proposals: the
    steps at which some row verified a proposal, and each step's arm."""
    seqs = [SimpleNamespace(seq_id=i, params=SamplingParams(temperature=0), num_tokens=200) for i in range(b)]
    verified, arms = [], []
    for step in range(steps):
        lengths = policy.plan(seqs, [4] * b)
        arms.append(policy.hints().arm)
        blocks = [DraftBlock([1] * n, None, [0.9] * n) for n in lengths]
        admitted = policy.admit(seqs, blocks, 0.0)
        for s, blk, n in zip(seqs, blocks, admitted):
            policy.observe(s, blk, n, accept(n))
        if any(admitted):
            verified.append(step)
        tokens = b + sum(admitted)
        policy.observe_step(StepTiming(b, tokens, 200.0, list(lengths), clock(b, tokens, lengths)))
    return verified, arms


def test_an_unmeasured_drafter_that_could_pay_is_probed_soon_and_then_drafts():
    """At the prior the model rates fixed speculation at 0.61x plain steps (far behind: its first
    look would wait four times longer), but were every proposal accepted it would run 1.57x: the
    estimate, not the load, stops drafting, so neither that look nor the engine-wide probe is put
    off; drafting is measured within probe_every steps, and from then on the policy drafts."""
    policy = GoodputPolicy(k=4, cost=PAYS_IF_RIGHT, has_draft_model=True)
    verified, arms = run(policy, 240)
    assert verified and verified[0] <= CFG.probe_every + 1, verified[:3]
    drafting = [a != "plain" for a in arms[2 * CFG.probe_every:]]
    assert sum(drafting) >= 0.9 * len(drafting), arms


def test_an_unmeasured_drafter_that_is_wrong_stays_off():
    """The same load with a drafter that is never right: measured early (the first look and the
    probe, nothing accepted), and from then on the measured figures, no longer the bound, keep
    drafting off; the probes and looks back off as usual."""
    policy = GoodputPolicy(k=4, cost=PAYS_IF_RIGHT, has_draft_model=True)
    verified, arms = run(policy, 1000, accept=lambda n: 0)
    assert verified and verified[0] <= CFG.probe_every + 1
    assert len(verified) <= 1000 // CFG.probe_every // 2, verified  # far fewer than one a probe_every
    assert arms[100:].count("plain") >= 0.95 * len(arms[100:])


def test_the_bound_rates_an_arm_by_its_seconds_and_every_proposal_accepted():
    """`Arms.rating(bound=True)`: the prediction's tokens stand (no measured committed / expected
    ratio scales them); the seconds are the arm's as rated (here measured: 0.2 s a step)."""
    arms = Arms(CFG)
    for _ in range(5):  # "full" measured: 2 tokens committed of 4 expected, 0.2 s (the profile said 0.1)
        arms.record("full", 2.0, 4.0, 0.2, 0.1, switched=False)
    pred = (5.0, 0.1, 0.0)  # every proposal accepted: 5 tokens, the profile's 0.1 s
    assert arms.rating("full", pred) == 2.0 / 0.2  # measured: what its steps committed
    assert arms.rating("full", pred, bound=True) == 5.0 / 0.2


def test_one_rejected_proposal_does_not_put_off_measuring():
    """The same start after one proposal was verified and rejected (the estimates now 0.33 a
    position: a sample of one, not a measurement of fixed speculation): fixed speculation is still
    rated at its bound until it has steps of its own, so it is measured as soon, and then drafts."""
    policy = GoodputPolicy(k=4, cost=PAYS_IF_RIGHT, has_draft_model=True)
    other = SimpleNamespace(seq_id=99, params=SamplingParams(temperature=0), num_tokens=200)
    policy.observe(other, DraftBlock([1], None, [0.9]), 1, 0)
    policy.forget(other.seq_id)
    verified, arms = run(policy, 240)
    assert verified and verified[0] <= CFG.probe_every + 1, verified[:3]
    drafting = [a != "plain" for a in arms[2 * CFG.probe_every:]]
    assert sum(drafting) >= 0.9 * len(drafting), arms
