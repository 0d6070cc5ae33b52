"""Shared by the policy tests (test_policy_causal.py, test_goodput_*.py, test_dspark_policy.py):
cost models, synthetic rows and step timings, and a drafter that is never right."""
from types import SimpleNamespace

from draftwise import SamplingParams
from draftwise.policies import CostModel, StepTiming
from draftwise.policies.goodput import GoodputConfig
from draftwise.proposers import DraftBlock

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


PROMPTS = [[20 + i, 3, 4, 5, 20 + i, 3] for i in range(16)]
