"""`GoodputPolicy`: the plan/admit core (plan.py) under the measured check (check.py, arms.py).

Each step: the check picks the batch size the step belongs to; a clear leader ("plain" or "full")
coasts, unplanned; otherwise the core plans lengths and probes, the model predicts each arm's step
from them, and the check picks the arm: "spec" runs the plan, "full" every row's maximum, "plain"
no drafting (a plan's probes aside). `admit` is the core's causal rule ("full": everything).
`observe` calibrates the estimates; `observe_step` feeds the budget, the arms and the cost model.
"""
from __future__ import annotations

import math
import time
from typing import Sequence

from ...proposers.base import DraftBlock, History
from ..base import StepHints, StepPrediction, StepTiming, register_policy
from ..cost import CostModel
from .check import MeasuredCheck
from .config import GoodputConfig
from .plan import Planner


@register_policy("goodput")
class GoodputPolicy:
    needs_cost_model = True
    needs_confidence = True

    def __init__(self, k: int = 4, cost: CostModel | None = None, has_draft_model: bool = False,
                 config: GoodputConfig | None = None, **_):
        if cost is None:
            raise ValueError("the goodput policy needs a cost model (a hardware profile)")
        self.k = k
        self.config = config or GoodputConfig()
        self.core = Planner(self.config, cost, has_draft_model)
        self.check = MeasuredCheck(self.config)
        self.node_price = 0.0  # the planned step's price of a verified row ("spec" steps only)

    def plain_next(self, num_seqs: int) -> bool:
        return self.check.plain_next(num_seqs)

    def hints(self) -> StepHints:
        # a coasting "full" step that only counts its tokens (thin) reads no confidence
        return StepHints(reads_confidence=not self.check.thin, arm=self.check.mode, node_price=self.node_price)

    def plan(self, seqs: Sequence[History], max_draft: Sequence[int]) -> list[int]:
        t = time.perf_counter()
        lengths = self._plan(seqs, max_draft)
        self.check.plan_seconds = time.perf_counter() - t
        # "full" and "plain" steps put no price on a row (every row its maximum; probes only)
        self.node_price = self.core.row_price(seqs) if self.check.mode == "spec" and any(lengths) else 0.0
        return lengths

    def _plan(self, seqs: Sequence[History], max_draft: Sequence[int]) -> list[int]:
        core, check, b = self.core, self.check, len(seqs)
        arms = check.enter(b)
        coast = check.coast(arms)
        if coast is not None:  # the leader by a wide margin: no plan for a few steps
            core.rate, core.probes = (math.inf if coast == "plain" else 0.0), set()
            lengths = [0] * b if coast == "plain" else list(max_draft)
            core.count_catch_ups(core.lags(seqs) if coast == "full" else [0] * b, lengths)
            return lengths
        plan = core.plan(seqs, max_draft)
        probes = core.probe_rows(seqs, plan, max_draft, check.engine_probe_allowed)
        lengths = [max(n, p) for n, p in zip(plan.lengths, probes)]
        planned_plain = not any(n > p for n, p in zip(lengths, probes))
        check.idle_plan = planned_plain
        check.full_plan = any(max_draft) and all(n >= m for n, m in zip(lengths, max_draft))
        # what the model expects of each arm now: the check corrects these by what each arm's
        # steps gave at this batch size; it decides even when the plan drafts nothing (estimates
        # that an unlucky start made pessimistic recover through its bursts of "full")
        pred = {"spec": core.predict(plan, lengths), "full": core.predict(plan, max_draft),
                "plain": core.predict(plan, [0] * b)}
        start = {"spec": core.catch_up_seconds(plan, lengths), "full": core.catch_up_seconds(plan, max_draft),
                 "plain": 0.0}
        # while fixed speculation has no steps of its own at this batch size, what it would give
        # were every proposal accepted: whether a probe or a look could change the decision
        # (`MeasuredCheck.plain_leads`, `Arms.choose`)
        bound = core.predict(plan, max_draft, every_accepted=True) if "full" not in arms.own else None
        mode = check.decide(arms, pred, planned_plain, start, bound=bound)
        if mode == "plain":
            core.rate = math.inf
            # only a plan that drafts nothing probes; a plain step chosen by the check has no
            # probes (the estimates are not what stops speculation there)
            lengths = [min(n, p) for n, p in zip(lengths, probes)] if planned_plain else [0] * b
            core.set_probes(seqs, lengths)
            if core.probes and check.looking is None:
                check.looking = "probe"
        elif mode == "full":  # every row drafts and verifies all it may: fixed speculation
            core.rate = 0.0
            lengths = list(max_draft)
        core.count_catch_ups(plan.lags, lengths)
        return lengths

    def admit(self, seqs: Sequence[History], blocks: Sequence[DraftBlock], draft_seconds: float) -> list[int]:
        if self.check.mode == "full" or not any(blk.token_ids for blk in blocks):  # all, or nothing drafted
            return [len(blk.token_ids) for blk in blocks]
        return self.core.admit(seqs, blocks)

    def observe(self, seq: History, block: DraftBlock, num_verified: int, num_accepted: int) -> None:
        if not num_verified:  # nothing tested: one committed token, as `observe_step` counts a row not seen
            return
        self.check.count_row(num_accepted)
        self.core.observe(seq, block, num_verified, num_accepted, calibrate=not self.check.thin,
                          plain_leads=self.check.plain_leads)

    def forget(self, seq_id: int) -> None:
        self.core.forget(seq_id)

    def observe_step(self, timing: StepTiming) -> StepPrediction | None:
        core, check = self.core, self.check
        core.count_step(timing)
        committed = check.take_committed(timing.num_seqs)
        if timing.untimed_seconds is not None:  # several forwards: its time still adds to the budget
            check.accrue(timing.untimed_seconds)
        if timing.cold and timing.seconds is not None:  # its time is the cold start's: the budget's, not an arm's
            check.accrue(timing.seconds)
        if timing.seconds is None or timing.cold:  # a mixed, multi-step or cold step: nothing to learn
            if timing.num_steps > 1 and timing.untimed_seconds is not None and not timing.cold:  # but plain steps'
                steps, model, ctx = timing.num_steps, core.model, timing.context
                check.record_steps(steps, timing.untimed_seconds, steps * model.profile_seconds(1, 1, ctx, []),
                                   ctx, steps * model.context_slope(1, []))
            check.last_mode = check.mode
            return None
        check.spend(committed, timing.seconds)
        core.learn_catch_up(timing.catch_up_seconds)
        if check.skips():  # a coasting step the figures and the cost model do not sample
            return None
        lengths = list(timing.draft_lengths) if core.has_draft_model else []
        profile = core.model.profile_seconds(timing.num_seqs, timing.num_tokens, timing.context, lengths)
        check.record(timing, committed, profile, core.model.context_slope(timing.num_seqs, lengths),
                     probing=bool(core.probes), has_draft_model=core.has_draft_model)
        # the cost model is of the decode step proper; the arms pay for everything
        return core.observe_cost(timing, lengths, profile)
