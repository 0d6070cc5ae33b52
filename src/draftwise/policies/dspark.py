"""`dspark`: DSpark's hardware-aware prefix scheduler (Algorithm 1 of arXiv 2607.05147) over
calibrated survival probabilities and the hardware profile's step curve.

After drafting, for every (row r, proposal j) the survival a_{r,j} = prod_{i<=j} c_{r,i}: c_{r,i}
is the calibrated acceptance of proposal i given the earlier ones were accepted, read from the
drafter's confidence at i (`DraftBlock.confidence`, max_x q_i(x)) through goodput's online
calibration (calibration.py). `prefix_schedule` sorts all candidates by survival, descending, and
admits one at a time while the expected throughput

    Theta = (R + sum of admitted a) * SPS(R + admitted),   SPS(T) = 1 / seconds(T)

keeps rising (R rows, each feeding its last committed token; seconds(T) the whole step at T
tokens: the drafting planned for it plus the verification, the profile plus the online residual,
`OnlineCost.tokens_seconds`); it stops at the first candidate that does not raise Theta.

**Why the drafting counts although it is spent.** Over many steps the rate is the sum of the
committed tokens over the sum of the steps' seconds; a step maximises it by verifying proposal j
while a_j / (its marginal seconds) exceeds that long-run rate, which the step's own ratio with its
drafting in the denominator estimates. Verification alone in the denominator sets the price of a
row as high as the step's verification-only rate, above the rate the engine runs at, and cuts
proposals that pay (on the embedded pair at c=1 it verified 2.2-3.0 of fixed k=4's 3.35 tokens a
round). The drafting seconds are the plan's prediction for the lengths it chose before drafting
(the cost model's drafter steps and catch-ups): a constant of the step, read before any proposal.

**Why the early stop keeps it exact.** Survivals fall along a row, so until the first drop the
admitted candidates are exactly those processed, and the next one is the best of each row's next
position: the search is a sequential process that reads c_{r,j+1} (a function of x_{r,j}) only
once x_{r,j} is admitted. Whether x_{r,j} is verified therefore reads x_{r,1..j-1} and other
rows' admitted drafts, never x_{r,j}: a stopping time, as rejection sampling needs, and the rows'
outputs are jointly the targets' (independent rows, although each row's admission reads the
others' drafts). A search that runs past the first drop and keeps the best prefix reads
c_{r,j+1} to decide on x_{r,j}: the paper's Appendix A, target (0.7, 0.3) and draft (0.5, 0.5)
come out as (0.85, 0.15). tests/test_dspark_policy.py has both in exact fractions.

Before drafting, `plan` is goodput's core (`Planner.plan`): the same objective over the expected
survivals by position, with the drafter's steps and catch-up in the step's seconds (no token is
drawn yet, so the best prefix of the whole greedy path may be kept), plus its probes (a row left
out drafts and verifies one proposal now and then, so its estimate can recover). A drafter on the
target's features (`block_drafter`: DSpark's one block forward a round, EAGLE-3's k steps) has no
model the profile times: its seconds a round, learned from the engine's measured drafting (cost.py's
`BlockCost`), are what a step that drafts pays; the plan drafts a row's whole block (its maximum) or
none (plain steps where the drafting does not pay for itself), and Theta counts that drafting. A
drafter without a model or a measured cost (n-gram, suffix) drafts for free in the cost model:
every row drafts its maximum and the admission, reading the proposals' own confidences, decides.
There are no measured arms: what the profile and the calibration predict is what runs.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..proposers.base import DraftBlock, History
from .base import StepHints, StepPrediction, StepTiming, register_policy
from .calibration import Calibration
from .cost import CostModel
from .goodput.config import GoodputConfig
from .goodput.plan import Planner


def prefix_schedule(survivals: Sequence[Sequence[float]], step_seconds: Callable[[int], float],
                    minimum: Sequence[int] | None = None) -> list[int]:
    """Algorithm 1: admitted lengths [R] from survivals [R][<= K] (a_{r,j}, non-increasing along a
    row) and a verification step's seconds at T tokens fed (1 / SPS(T)). `minimum` [R]: proposals
    admitted before the search (decided before drafting: probes); they count in Theta's start.
    Works on floats and on Fractions alike (the exact tests)."""
    rows = len(survivals)
    lengths = [min(m, len(a)) for m, a in zip(minimum, survivals)] if minimum is not None else [0] * rows
    tokens = rows + sum(lengths)
    expected = rows + sum(sum(a[:n]) for a, n in zip(survivals, lengths))
    best = expected / step_seconds(tokens)
    # by survival; among equal survivals earlier positions first, so a row's own candidates keep their order
    order = sorted(((a, j, r) for r, row in enumerate(survivals) for j, a in enumerate(row)
                    if j >= lengths[r] and a > 0), key=lambda t: (-t[0], t[1], t[2]))
    for a, j, r in order:
        if lengths[r] != j:  # a gap in row r (a later position scored higher): survivals were not monotone
            break
        value = (expected + a) / step_seconds(tokens + 1)
        if not value > best:  # the first drop: stop before reading anything that depends on this proposal
            break
        best, expected, tokens = value, expected + a, tokens + 1
        lengths[r] = j + 1
    return lengths


def survival_table(seqs: Sequence[History], blocks: Sequence[DraftBlock],
                   calibration: Calibration) -> list[list[float]]:
    """[R][len(block)] a_{r,j} = prod_{i<=j} c_{r,i}, c from each proposal's confidence through the
    calibration (greedy and sampled rows apart, times the request's correction)."""
    out = []
    for s, b in zip(seqs, blocks):
        conf = b.confidence or [None] * len(b.token_ids)
        row, a = [], 1.0
        for c in conf[: len(b.token_ids)]:
            a *= calibration.rate(s.seq_id, s.params.is_greedy, c)
            row.append(a)
        out.append(row)
    return out


def _never() -> bool:
    return False


@register_policy("dspark")
class DSparkPolicy:
    """Algorithm 1 at admission on goodput's plan core (its plan, probes, calibration and cost)."""

    name = "dspark"
    needs_cost_model = True
    needs_confidence = True

    def __init__(self, k: int = 4, cost: CostModel | None = None, has_draft_model: bool = False,
                 config: GoodputConfig | None = None, block_drafter: bool = False, **_):
        if cost is None:
            raise ValueError("the dspark policy needs a cost model (a hardware profile)")
        self.k = k
        self.core = Planner(config or GoodputConfig(), cost, has_draft_model, block_drafter=block_drafter)
        self.draft_seconds = 0.0  # the planned step's predicted drafting seconds (a constant of admission)
        self.coast: list[int] | None = None  # [batch size, held steps left] after a plan that drafted nothing
        self.held = 0  # held steps so far (one in coast_observe_every teaches the cost model)

    def plan(self, seqs: Sequence[History], max_draft: Sequence[int]) -> list[int]:
        core = self.core
        if not any(max_draft):  # no row may draft (a held step: `plain_next`): nothing to plan
            core.set_probes(seqs, [0] * len(seqs))
            core.count_catch_ups([0] * len(seqs), [0] * len(seqs))
            self.draft_seconds = 0.0
            return [0] * len(seqs)
        plan = core.plan(seqs, max_draft)
        # no measured check here: an engine-wide probe is always allowed
        probes = core.probe_rows(seqs, plan, max_draft, lambda: True)
        if core.block is not None:  # one drafting round per row, whatever its length: all or nothing
            lengths = [m if n or p else 0 for n, p, m in zip(plan.lengths, probes, max_draft)]
            self.draft_seconds = core.block.seconds(sum(1 for n in lengths if n))
        elif not core.has_draft_model:  # drafting is free in the cost model: admission reads every proposal
            self.draft_seconds = 0.0
            return list(max_draft)
        else:
            lengths = [max(n, p) for n, p in zip(plan.lengths, probes)]
            core.count_catch_ups(plan.lags, lengths)
            self.draft_seconds = self.planned_draft_seconds(plan.context, lengths, plan.catch)
        self.coast = None if any(lengths) else [len(seqs), core.config.coast_steps]
        return lengths

    def planned_draft_seconds(self, context: float, lengths: Sequence[int], catch: Sequence[float]) -> float:
        """Predicted seconds of drafting `lengths`: drafter step j over the rows drafting past j,
        plus the drafting rows' catch-up (amortised, as the plan prices it)."""
        return self.core.model.drafting_seconds(lengths, context) + sum(c for c, n in zip(catch, lengths) if n)

    def hints(self) -> StepHints:
        return StepHints(reads_confidence=True)

    def admit(self, seqs: Sequence[History], blocks: Sequence[DraftBlock], draft_seconds: float) -> list[int]:
        if not any(b.token_ids for b in blocks):
            return [0] * len(blocks)
        core, rows = self.core, len(seqs)
        verify = core.model.tokens_seconds(rows, core.context(seqs))
        drafting = self.draft_seconds  # predicted at plan time: never this step's measured drafting

        def seconds(tokens: int) -> float:
            return drafting + verify(tokens)

        probes = [1 if s.seq_id in core.probes and b.token_ids else 0 for s, b in zip(seqs, blocks)]
        return self.schedule(survival_table(seqs, blocks, core.calibration), seconds, probes)

    def schedule(self, survivals: list[list[float]], step_seconds: Callable[[int], float],
                 minimum: list[int]) -> list[int]:
        """The admitted lengths from the survivals (Algorithm 1, `prefix_schedule`)."""
        return prefix_schedule(survivals, step_seconds, minimum)

    def observe(self, seq: History, block: DraftBlock, num_verified: int, num_accepted: int) -> None:
        core = self.core
        if num_verified:
            core.observe(seq, block, num_verified, num_accepted, calibrate=True, plain_leads=_never)
        elif block.token_ids:  # drafted, all cut: nothing tested (the probe clock runs on), but the
            # plan learns what admission saw, or it drafts for ever what is never verified
            conf = block.confidence[0] if block.confidence else None
            rate = core.calibration.rate(seq.seq_id, seq.params.is_greedy, conf)
            core.calibration.observe_unverified(seq.seq_id, rate)

    def observe_step(self, timing: StepTiming) -> StepPrediction | None:
        core = self.core
        core.count_step(timing)
        if timing.seconds is None or timing.cold:  # a mixed, multi-step or cold step: not the warm decode
            return None  # step the cost model describes (a cold one pays the caches other work filled)
        held = self.coast is not None and timing.num_tokens == timing.num_seqs
        if held and self.held % core.config.coast_observe_every:  # plain steps alike: a few teach enough
            return None
        core.learn_catch_up(timing.catch_up_seconds)
        lengths = list(timing.draft_lengths) if core.has_draft_model else []
        profile = core.model.profile_seconds(timing.num_seqs, timing.num_tokens, timing.context, lengths)
        return core.observe_cost(timing, lengths, profile)

    def plain_next(self, num_seqs: int) -> bool:
        """After a plan that drafted for no row, the next `coast_steps` steps of the same batch run
        plain without a plan (the scheduler may then give a lone greedy row several steps in one
        call), unless the engine-wide probe comes due or a request ends: with no proposal
        verified the estimates do not move, and the plan would say the same."""
        coast, core = self.coast, self.core
        if coast is None or coast[0] != num_seqs or coast[1] <= 0 or core.idle_steps + 1 >= core.engine_probe_interval:
            return False
        coast[1] -= 1
        self.held += 1
        return True

    def forget(self, seq_id: int) -> None:
        self.core.forget(seq_id)
        self.coast = None  # the batch changed: plan again
