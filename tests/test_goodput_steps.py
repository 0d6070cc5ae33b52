"""The goodput policy in the engine's steps: steps sure to be plain, calibration while coasting,
steps that read no confidence, drafter catch-ups, and a coasting arm's measurements.
"""
from types import SimpleNamespace

import pytest

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.policies import StatelessPolicy, StepHints, register_policy
from draftwise.policies.calibration import Calibration
from draftwise.policies.goodput import Arms, GoodputPolicy, choose_lengths
from draftwise.policies.goodput.plan import Planner
from draftwise.proposers import DraftBlock

from policy_helpers import COST, CFG, FROZEN, PROMPTS, rows, timing


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


def test_a_cold_step_is_left_out_of_the_arms_figures(monkeypatch):
    """Steps the engine began after being away longer than they took (another engine's time
    slice, an idle wait) run with cold caches: goodput adds their time to the exploration budget
    but records none of them in any arm's figures, however slow; the same steps warm are recorded."""
    from draftwise.policies import StepTiming

    recorded = []
    real = Arms.record
    monkeypatch.setattr(Arms, "record", lambda self, *a, **kw: (recorded.append(a[0]), real(self, *a, **kw))[1])

    def run(cold: bool) -> int:
        policy = GoodputPolicy(k=4, cost=COST, has_draft_model=True)
        seqs = rows(1)
        for _ in range(40):  # warm steps of whatever arm the policy picks
            lengths = policy.plan(seqs, [4])
            policy.observe_step(timing(1, 1 + sum(lengths), lengths, 0.004))
        recorded.clear()
        for _ in range(16):
            credit = policy.check.credit
            lengths = policy.plan(seqs, [4])
            policy.observe_step(StepTiming(1, 1 + sum(lengths), 50.0, list(lengths), 0.5, cold=cold))  # 100x slower
            assert not cold or policy.check.credit >= credit
        return len(recorded)

    assert run(cold=True) == 0
    assert run(cold=False) > 0


def test_the_engine_marks_a_step_after_a_gap_cold(target_dir, draft_dir):
    """Speculation.observe_step: a decode step that began longer after the previous one's end than
    it took (and than COLD_GAP) reaches the policy as cold; back-to-back steps do not."""
    llm = LLM(str(target_dir), draft=str(draft_dir), spec=SpecConfig(method="draft", k=4, policy="goodput"))
    spec = llm.engine.speculation
    seen = []
    real = spec.policy.observe_step

    def spy(timing):
        seen.append(timing.cold)
        return real(timing)

    spec.policy.observe_step = spy
    eng = llm.engine
    eng.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert seen and not any(seen[1:])  # (the first follows the prefill step)
    seen.clear()
    import time
    eng.add_request("s", [5, 6, 8], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    eng.step()  # the prefill
    time.sleep(0.05)
    while eng.has_unfinished():
        eng.step()
    assert seen[0] and not any(seen[1:])
