"""The measured check across batch sizes: which arm each step runs, from what the arms' steps gave.

Per batch size (half octaves, `batch_bucket`) an `Arms` (arms.py) rates the three arms by their
measured committed tokens per second; this module picks the batch size a step belongs to, keeps
the exploration budget, and records each timed step in its arm's figures.

- A step belongs to the batch size of the rows it decodes.
- Looking away from the leading arm (a burst of another, an engine-wide probe) has a budget: every
  step adds `explore_budget` of its seconds to a credit (up to `credit_cap`); a look takes off
  what it cost against the leader's rate (its seconds less the leader's time for its tokens), and
  starts only while the credit covers what the same look cost last time. Where one arm leads
  clearly, the looks (mostly the drafter's catch-up after plain steps) cost about `explore_budget`
  of the run (the first look at an arm is free, its cost not known, unless the drafter's
  catch-up it must start with is dearer than the credit's cap).
- Switching costs are not the arms': a drafting step right after plain ones also feeds the
  drafter everything it missed, and a plain step right after drafting ones runs slower than the
  plain steps after it; both are left out of the figures, as is a cold step (`StepTiming.cold`:
  the engine was away longer than the step took, its caches holding other work's data). The
  plan's own Python time is left out of "plain"'s and "full"'s seconds: leading, they coast
  without it.
- Coasting steps (the leader run unplanned) are recorded one in `coast_observe_every`, their tokens
  as expected scaled by the arm's committed / expected ratio: the leader's figures follow the steps
  it runs, not those before the coast.
"""
from __future__ import annotations

import math

from ..base import StepTiming
from .arms import Arms, Prediction, batch_bucket
from .config import GoodputConfig


class MeasuredCheck:
    def __init__(self, config: GoodputConfig):
        self.config = config
        self.arms: dict[int, Arms] = {}  # batch bucket -> its arms
        self.mode = "spec"  # this step's arm
        self.last_mode = "plain"  # the previous step's arm (a drafting arm after plain steps catches up)
        self.pred: Prediction | None = None  # the model's figures for this step's arm (None: coasting)
        self.plan_seconds = 0.0  # the last plan's own Python time
        self.idle_plan = False  # the last plan drafted for no row (its "spec" step is a plain one)
        self.full_plan = False  # the last plan drafted all it may for every row (its "spec" step is a "full" one)
        self.coasted = 0  # coasting steps seen (one in coast_observe_every is recorded)
        # coasting "full" steps; of them, one in coast_observe_every feeds the calibration, the
        # others are thin: their rows' observations are only counted (nothing the coast reads)
        self.coast_full = 0
        self.thin = False
        self.bucket = 0
        self.plan_b = 0  # the batch size `bucket` is of (the rows decoding)
        self.own_bucket = 0  # batch_bucket(plan_b)
        self.committed = [0, 0]  # this step: tokens committed and rows seen by `count_row`
        self.credit = 0.0  # seconds of exploration the budget allows now (negative: overspent)
        self.looking: str | None = None  # this step explores: the arm of a burst, or "probe"
        self.lead_rate = 0.0  # the leading arm's rating when this step was decided (tokens/s)
        self.probe_cost = 0.0  # seconds an engine-wide probe cost last time (its catch-up mostly)

    def arms_at(self, bucket: int) -> Arms:
        """The bucket's arms; a new bucket starts from its nearest measured neighbour's (the best
        arm rarely changes between neighbouring batch sizes; its own steps replace the figures)."""
        arms = self.arms.get(bucket)
        if arms is None:
            near = min(self.arms, key=lambda b: (abs(b - bucket), b), default=None)
            arms = self.arms[bucket] = Arms(self.config, seed=self.arms[near] if near is not None else None)
        return arms

    def enter(self, num_seqs: int) -> Arms:
        """The arms this step of `num_seqs` rows is decided by: its batch size's."""
        if num_seqs != self.plan_b:  # (batch_bucket's log2 only when the size changes)
            self.plan_b, self.own_bucket = num_seqs, batch_bucket(num_seqs)
        bucket = self.own_bucket
        moved, self.bucket = bucket != self.bucket, bucket
        arms = self.arms_at(bucket)
        if moved:  # back from another bucket, whose plans may have changed what `coast` reads (`idle`)
            arms.lease = 0
        self.looking = None
        return arms

    def coast(self, arms: Arms) -> str | None:
        """"plain" or "full" when the leader runs again unplanned this step (`Arms.coast`), else None."""
        coast = arms.coast(self.credit, self.config.credit_cap, idle=self.idle_plan, full=self.full_plan)
        self.thin = False
        if coast is not None:
            self.mode, self.pred = coast, None
        if coast == "full":
            self.coast_full += 1
            self.thin = self.coast_full % self.config.coast_observe_every != 0
        return coast

    def plain_next(self, num_seqs: int) -> bool:
        """The next step at this batch size runs plain for certain: a coasting lease of plain
        decoding, which `plan` returns unchecked."""
        if num_seqs != self.plan_b:  # another batch size: plan decides afresh
            return False
        arms = self.arms.get(self.bucket)
        return arms is not None and arms.lease > 0 and arms.lease_arm == "plain"

    def plain_leads(self) -> bool:
        """The last decision at this batch size rated plain steps at least as high as fixed
        speculation (or none was made yet): the load, not the estimate, stops drafting. The bursts
        of "full" then calibrate every row at every position, more than a probe's one proposal.
        While fixed speculation has no steps of its own here its rating is the estimates' (at
        first a prior, or a probe or two), not a measurement: it is rated as if every proposal
        were accepted (`Arms.full_bound`), so plain leads only where even that loses (the load
        alone stops drafting); elsewhere a probe can change the decision."""
        arms = self.arms_at(self.bucket)
        full = arms.rates.get("full", 0.0) if arms.full_bound is None else arms.full_bound
        return arms.rates.get("plain", 0.0) >= full

    def engine_probe_allowed(self) -> bool:
        """An engine-wide probe may start: the budget covers what the last one cost, and plain steps
        do not lead (there an accepting probe would not say that speculation pays)."""
        return self.credit >= min(self.probe_cost, self.config.credit_cap) and not self.plain_leads()

    def decide(self, arms: Arms, pred: dict[str, Prediction], planned_plain: bool,
               start: dict[str, float] | None = None, bound: Prediction | None = None) -> str:
        """This step's arm, from the model's figures of each; `planned_plain`: the plan drafts
        nothing beyond probes (its "spec" step is a plain one); `start`: each arm's catch-up now;
        `bound`: "full"'s figures were every proposal accepted (only while it has no steps here)."""
        self.mode = arms.choose(pred, self.credit, self.config.credit_cap, last=self.last_mode, start=start,
                                bound=bound)
        self.lead_rate = arms.lead_rate
        if arms.exploring is not None:
            self.looking = arms.exploring
        if planned_plain and self.mode == "spec":
            self.mode = "plain"
        self.pred = pred["spec"] if planned_plain and self.mode == "plain" else pred[self.mode]
        return self.mode

    def count_row(self, num_accepted: int) -> None:
        """A row verified something this step and committed num_accepted + 1 tokens."""
        self.committed[0] += num_accepted + 1
        self.committed[1] += 1

    def take_committed(self, num_seqs: int) -> int:
        """The step's committed tokens (rows not counted: one each); the count starts again."""
        committed = self.committed[0] + max(0, num_seqs - self.committed[1])
        self.committed = [0, 0]
        return committed

    def accrue(self, seconds: float) -> None:
        """Every step adds explore_budget of its seconds to the credit (up to credit_cap)."""
        self.credit = min(self.config.credit_cap, self.credit + self.config.explore_budget * seconds)

    def spend(self, committed: float, seconds: float) -> None:
        """A step that looked away from the leading arm takes off what it cost against that arm's
        rate, counted to the burst's arm or as the engine-wide probe's cost."""
        self.accrue(seconds)
        if self.looking is None or self.lead_rate <= 0 or math.isinf(self.lead_rate):
            return
        cost = seconds - committed / self.lead_rate
        self.credit -= cost
        if self.looking == "probe":
            self.probe_cost = max(0.0, cost)
        else:
            self.arms_at(self.bucket).spend(self.looking, cost)

    def skips(self) -> bool:
        """A coasting step (no plan, nothing to correct) that is not one sampled by the figures
        and the cost model (one in coast_observe_every)."""
        if self.pred is None and self.last_mode == self.mode:
            self.coasted += 1
            return self.coasted % self.config.coast_observe_every != 0
        return False

    def record_steps(self, steps: int, seconds: float, profile: float, context: float, slope: float) -> None:
        """A lone greedy row's plain steps in one call (multi-step): `steps` tokens in `seconds`,
        the profile's seconds for them and its seconds per token of context. At batch 1 plain
        steps run so (the scheduler's multi-step), and the plain arm is rated by what they give;
        the first after drafting steps is a switch's cost, not recorded."""
        if self.mode == "plain" and self.last_mode == "plain":
            self.arms_at(self.bucket).record("plain", steps, steps, seconds - self.plan_seconds, profile,
                                             switched=False, context=(context, slope))

    def record(self, timing: StepTiming, committed: int, profile: float, slope: float, probing: bool,
               has_draft_model: bool) -> None:
        """The step's figures into its arm: `profile` its seconds by the profile, `slope` the
        profile's seconds per token of context; `probing`: rows probed this step."""
        mode, last, seconds = self.mode, self.last_mode, timing.seconds
        catch_up = mode != "plain" and last == "plain" and has_draft_model  # the drafter catches up
        switched = mode == "plain" and last != "plain"  # caches hold the drafting's data
        # a coasting plain step has no prediction; a plan's probing plain step pays the probes'
        # catch-ups over whole contexts, which plain decoding never does
        if self.pred is not None and not (mode == "plain" and probing):
            arm_seconds = seconds - (self.plan_seconds if mode != "spec" else 0.0)
            self.arms_at(self.bucket).record(mode, committed, self.pred[0], arm_seconds, self.pred[1],
                                             switched=catch_up or switched,
                                             context=self.pred[3:5])
        if self.pred is None and last == mode and mode in ("plain", "full"):
            # a sampled coasting step: no plan, so no estimate of its tokens; what it committed,
            # scaled so that the arm's committed / expected ratio stays as it is
            arms = self.arms_at(self.bucket)
            got, meant = arms.tokens[mode]
            expected = committed * (meant / got if got > 0 and meant > 0 else 1.0)
            arms.record(mode, committed, expected, seconds - self.plan_seconds, profile,
                        switched=False, context=(timing.context, slope))
        self.last_mode = mode
