"""The goodput policy at batch 1, where plain steps run several to a call (multi-step): the plain
arm is rated by what those calls give, not by the model (or a neighbouring batch size's figures)
alone. Driven through the policy's interface on a synthetic clock."""
from types import SimpleNamespace

from draftwise import SamplingParams
from draftwise.policies import CostModel, StepTiming
from draftwise.policies.goodput import GoodputPolicy
from draftwise.proposers import DraftBlock

# a plain step 42 ms by the profile, each verified token 8.5 ms more, a drafter step 14.4 ms
COST = CostModel((0.0335, 0.0, 0.0085, 0.0), (0.0144, 0.0, 0.0))
PLAIN_CALL = 5  # target steps of a multi-step call (1 + k)


def test_plain_steps_of_a_multi_step_call_rate_the_plain_arm():
    """Fixed speculation commits 4 tokens a step (three of four proposals accepted): 30 tokens/s
    on the clock, 1.26x plain steps by the profile. But plain steps run five to a call at half
    the profile's seconds (48 tokens/s): measured so, plain leads and the policy runs it. (Were
    plain rated by the profile alone, as when multi-step calls went unrecorded, fixed speculation
    would lead.)"""
    policy = GoodputPolicy(k=4, cost=COST, has_draft_model=True)
    seqs = [SimpleNamespace(seq_id=0, params=SamplingParams(temperature=0), num_tokens=200)]
    arms = []
    for step in range(1500):
        lengths = policy.plan(seqs, [4])
        arms.append(policy.hints().arm)
        blocks = [DraftBlock([1] * n, None, [0.9] * n) for n in lengths]
        admitted = policy.admit(seqs, blocks, 0.0)
        if admitted[0]:
            policy.observe(seqs[0], blocks[0], admitted[0], min(admitted[0], 3))
            seconds = COST.target_seconds(1, 1 + admitted[0]) + lengths[0] * COST.draft_seconds(1)
            policy.observe_step(StepTiming(1, 1 + admitted[0], 200.0, list(lengths), seconds))
        else:  # plain: the scheduler's multi-step call, at half the profile's seconds a step
            half = PLAIN_CALL * COST.target_seconds(1, 1) / 2
            policy.observe_step(StepTiming(1, 1, 200.0, list(lengths), None, untimed_seconds=half,
                                           num_steps=PLAIN_CALL))
    late = arms[750:]
    assert late.count("plain") >= 0.8 * len(late), late
