"""The measured arms at one batch size: what each way of running a step gave, and which runs next.

Three arms: "spec" (the plan's lengths), "full" (every row drafts and verifies all it may, as the
fixed policy does) and "plain" (no drafting). `Arms` keeps, per arm, decayed sums of its steps'
committed tokens and seconds as measured and what the model expected of them; `choose` runs the
best-rated arm and looks at the others in bursts, less and less often while they stay behind;
`coast` lets a clear leader run on without the plan. The choice reads the history only (causal;
"full" admits every proposal, reading none).

Rating an arm (`rating`): its tokens per step over its measured seconds per step plus the catch-up
that running it now would start with. Its tokens per step: what the calibration expected of the
steps its seconds are of, times its committed / expected tokens over many more steps (tokens vary
far more from step to step than seconds, and do not drift with the machine). Its seconds are
moved to the contexts of now (a step's time grows with the rows' contexts, and two arms' figures
are of steps taken at different times) by the profile's seconds per token of context of its own
steps. An arm never run at this batch size is rated by the model's figures, corrected by a
neighbouring batch size's measured / predicted ratios when one was seeded (`seed`).

Deciding (`choose`): the best-rated arm runs, "spec" only when clearly ahead of "full", and between
drafting and plain steps the step before's side unless the other is clearly ahead (each switch
pays: the drafter's catch-up one way, caches holding the drafting's data the other). Another arm
is looked at in a burst when its turn is due; a look that leaves it behind or tied makes its next
turn wait longer, one that puts it clearly ahead brings the turn back soon. A rival whose last
step is old is measured again (a burst) before it takes over: contexts grow and the machine
drifts, so two arms compare only from steps taken close together. A step that switches sides is
a cost of switching, left out of the arm's figures (`record`'s `switched`).

Coasting (`coast`): while "plain" or "full" leads by a wide margin (or no rival passes it by the
margin `choose` asks), no burst is due and it has steps of its own here, it runs again unplanned
for a few steps; once it coasts, the steps before its limit or the next rival's turn coast on a
lease without these checks (nothing they read changes meanwhile). While "full" has no steps of
its own here, it is rated there as if every proposal were accepted (`full_bound`): a lead that a
probe or a look could overturn does not coast.
"""
from __future__ import annotations

import math
from typing import Sequence

from .config import GoodputConfig

ARMS = ("spec", "full", "plain")  # planned lengths, every row its maximum (fixed k), no drafting

# what the model expects of an arm's step now: (expected tokens, the profile's seconds, the
# catch-up it would start with[, mean context, the profile's seconds per token of context])
Prediction = tuple


def batch_bucket(num_seqs: int) -> int:
    """Batch sizes rated together: half octaves (1, 2, 3, 4, 5-6, 7-9, 10-13, 14-18, 19-26, 27-38,
    ...): a level's batch and the smaller ones of its tail (requests ending, others arriving) stay
    apart, where the best arm can differ."""
    return int(2 * math.log2(max(1, num_seqs)) + 0.5)


def _one_step(sums: list[float]) -> list[float]:
    """Decayed sums whose last entry is their weight, brought to the weight of one step (their
    means); sums of no weight (nothing recorded) stay as they are."""
    if sums[-1] <= 0:
        return list(sums)
    return [v / sums[-1] for v in sums[:-1]] + [1.0]


class Arms:
    """The measured check at one batch size (see the module docstring)."""

    def __init__(self, config: GoodputConfig, seed: "Arms | None" = None, arms: Sequence[str] = ARMS):
        self.config = config
        self.arms = tuple(arms)
        # decayed sums per arm: tokens measured, tokens predicted, seconds measured, seconds predicted, steps
        self.figures = {a: [0.0, 0.0, 0.0, 0.0, 0.0] for a in arms}
        self.tokens = {a: [0.0, 0.0] for a in arms}  # committed, expected (decayed by token_decay: many more steps)
        # the profile's seconds per token of context x the context, those seconds per token, steps (decayed as figures)
        self.context = {a: [0.0, 0.0, 0.0] for a in arms}
        self.steps = 0  # decisions made
        self.current = "spec"
        self.burst_left = 0
        self.exploring: str | None = None  # the arm of the running burst
        self.interval = {a: config.explore_every for a in arms}
        self.rates: dict[str, float] = {}  # the arms' ratings at the last decision
        # "full"'s rating at the last decision were every proposal accepted (None: it has steps of its own here)
        self.full_bound: float | None = None
        self.coasted = 0  # steps run without a decision since the last one
        self.lease, self.lease_arm = 0, "plain"  # further steps `coast` returns lease_arm unchecked
        self.deferred: set[str] = set()  # arms whose first look was put off (the model rates them far behind)
        self.own: set[str] = set()  # arms with steps of their own here (the others: a neighbour's figures)
        self.lead_rate = 0.0  # the best arm's rating at the last decision (tokens/s)
        self.look_cost: dict[str, float] = {}  # arm -> seconds its last burst cost against the leader
        self._spent: dict[str, float] = {}  # arm -> seconds the running burst has cost so far
        # arm -> seconds of the drafter's catch-up a look at it would start with (the rows' lags at
        # the last decision; they only grow while plain steps coast)
        self.start_cost: dict[str, float] = {}
        if seed is not None:  # a neighbour's figures at the weight of one step each, its intervals and costs
            for a, f in seed.figures.items():
                if f[4] > 0:
                    self.figures[a] = _one_step(f)
                    self.context[a] = _one_step(seed.context[a])
            # its committed / expected tokens as a prior, which this batch size's own steps add to
            self.tokens = {a: [v * config.token_prior for v in t] for a, t in seed.tokens.items()}
            self.interval = dict(seed.interval)
            self.look_cost = dict(seed.look_cost)
        # an arm's first look here comes soon whatever the neighbour's interval: the neighbour's
        # ratios carry the model's errors at that batch size, not this one's
        self.due = {a: min(i, config.first_look) for a, i in self.interval.items()}

    def rating(self, arm: str, pred: Prediction, bound: bool = False) -> float:
        """Committed tokens per second: measured over the arm's recent steps (decayed), the catch-up
        that running it now would start with added; an arm with only a neighbour's figures, the
        model's figures corrected by that neighbour's measured / predicted ratios; an arm never
        run, the model's figures. `bound`: `pred`'s tokens are an upper bound (every proposal
        accepted), which stands as it is: the arm's seconds as rated, its tokens not measured."""
        _, tok_p, sec_m, sec_p, n = self.figures[arm]
        expected, seconds, catch_up, *now = pred
        got, meant = self.tokens[arm]
        # committed / expected tokens, over many steps
        accuracy = got / meant if meant > 0 and not bound else 1.0
        if arm in self.own and sec_m > 0:
            expected, seconds = (expected if bound else accuracy * tok_p / n), sec_m / n
            c_sum, slope, c_n = self.context[arm]
            if now and c_n > 0:  # its steps as if at the contexts of now, by the profile's seconds
                # per token of context of the arm's own steps (this step's lengths are not theirs)
                # (the part that is not the context's is never below 0: a profile whose context
                # cost exceeds what was measured would otherwise rate the arm at any speed)
                seconds = max(0.0, seconds - c_sum / c_n) + slope * now[0] / c_n
        elif n > 0 and sec_p > 0:  # a neighbour's: its rates belong to another batch size,
            expected *= accuracy  # its ratios to the model's figures carry over
            seconds *= sec_m / sec_p
        return expected / max(seconds + catch_up, 1e-12)

    def affordable(self, arm: str, credit: float, cap: float = math.inf) -> bool:
        """The exploration budget covers a burst of `arm` now: what its last burst cost, or the
        credit's cap for a look dearer than that (it leaves the credit in debt, repaid before the
        next look: the budget holds on average). An arm with no steps of its own here is looked at
        whatever the credit (its first look is what measures it), unless the drafter's catch-up it
        must start with (`start_cost`, known before the look) is dearer than the credit's cap: then
        it waits for a full credit."""
        start = self.start_cost.get(arm, 0.0)
        if arm not in self.own:
            return start <= cap or credit >= cap
        return credit >= min(max(self.look_cost.get(arm, 0.0), start), cap)

    def spend(self, arm: str, seconds: float) -> None:
        """A step of the running burst of `arm` cost `seconds` against the leading arm."""
        self._spent[arm] = self._spent.get(arm, 0.0) + seconds

    def coast(self, credit: float = math.inf, cap: float = math.inf, idle: bool = False,
              full: bool = False) -> str | None:
        """The arm to run again without planning ("plain" or "full"), or None: it led every rival
        by more than `coast` at the last decision (or `choose` would keep it, `_keeps`), at most
        `coast_steps` steps ago (`far_coast_steps` when it led by more than 1 / far); it is not
        exploring, no rival's turn is due (and affordable), and it has steps of its own here (a
        lead that is the model's is measured first).
        `idle`: the last plan drafted for no row, so a "spec" step is a plain one: "plain" and
        "spec" are one arm, which coasts while it leads "full". `full`: the last plan drafted all
        it may for every row, so "spec" and "full" are one arm, which coasts as "full" while it
        leads "plain". Once it coasts, the steps before its limit or the next rival's turn coast
        on a lease without these checks (`choose` ends it)."""
        if self.lease > 0:
            self.lease -= 1
            self.steps += 1
            self.coasted += 1
            return self.lease_arm
        cfg = self.config
        current = self.current
        if current == "spec" and (idle or full):
            current = "plain" if idle else "full"
        if current == "spec" or self.burst_left > 0 or self.exploring is not None:
            return None
        same = (idle and current == "plain") or (full and current == "full")  # "spec" steps are this arm's
        if current not in self.own and not (same and "spec" in self.own):
            return None  # its lead is the model's (a neighbour's ratios): measure it here first
        # "spec" is "plain" (idle) or "full" (full) now: no rival of its own
        rivals = [a for a in self.arms if a != current and not ((idle or full) and a == "spec")]
        rates = dict(self.rates)
        if self.full_bound is not None and current != "full":  # a lead a probe or look could overturn
            rates["full"] = max(rates.get("full", 0.0), self.full_bound)
        lead = rates.get(current, 0.0) / max(max(rates.get(a, 0.0) for a in rivals), 1e-12)
        limit = cfg.coast_steps if lead * cfg.far < 1 else cfg.far_coast_steps
        if not self._keeps(current, rivals, rates) or self.coasted >= limit:
            return None
        if any(self.steps + 1 >= self.due[a] and self.affordable(a, credit, cap) for a in rivals):
            return None
        self.steps += 1
        self.coasted += 1
        # the next calls that would pass every check above whatever the credit: before the limit
        # and before any rival's turn
        self.lease = min(limit - self.coasted, min(self.due[a] for a in rivals) - self.steps - 1)
        self.lease_arm = current
        return current

    def _keeps(self, current: str, rivals, rates: dict[str, float]) -> bool:
        """`choose` would keep `current` on the last decision's ratings (`rates`), whatever a
        rival's look: it leads by `coast`, or no rival passes it by the margin `choose` asks of
        that rival (`switch` across drafting and plain, `plan_edge` for "spec" over "full")."""
        cfg = self.config
        rate = rates.get(current, 0.0)
        if rate >= cfg.coast * max(rates.get(a, 0.0) for a in rivals):
            return True
        for a in rivals:
            if (a == "plain") != (current == "plain"):
                margin = cfg.switch
            elif current == "full" and a == "spec":
                margin = cfg.plan_edge
            else:
                return False
            if rate * margin < rates.get(a, 0.0):
                return False
        return True

    def choose(self, pred: dict[str, Prediction], credit: float = math.inf,
               cap: float = math.inf, last: str | None = None, start: dict[str, float] | None = None,
               bound: Prediction | None = None) -> str:
        """The arm this step runs, from the model's predictions of each (`pred`) and the arms'
        figures; `last`: the arm the step before ran; `start`: seconds of the drafter's catch-up
        running each arm now would start with (not amortised: what a look pays at once); `bound`:
        "full"'s prediction were every proposal accepted, while it has no steps of its own here
        (its rating kept as `full_bound`; its first look is put off only where even that is far
        behind: the estimates alone, a prior at first, do not put it off)."""
        cfg = self.config
        if start is not None:
            self.start_cost = dict(start)
        self.steps += 1
        self.coasted = 0
        self.lease = 0
        rate = {a: self.rating(a, pred[a]) for a in self.arms}
        self.full_bound = self.rating("full", bound, bound=True) if bound is not None and "full" in rate else None
        if self.burst_left > 0:
            self.burst_left -= 1
            return self.current
        if self.exploring is not None:
            self._end_burst(rate)
        best = max(self.arms, key=lambda a: rate[a])
        if best == "spec" and "full" in rate and rate["full"] * cfg.plan_edge >= rate["spec"]:
            best = "full"  # the plan must beat fixed speculation clearly: their rates are noisy estimates
        if last in rate and last != best and (last == "plain") != (best == "plain") \
                and rate[last] * cfg.switch >= rate[best]:
            best = last  # between drafting and not, the step before's side unless the other is clearly ahead
        self.rates = rate
        self.lead_rate = rate[best]
        for arm in self.arms:
            if arm != best and self.steps >= self.due[arm] and self.affordable(arm, credit, cap):
                if arm == "full" and self.full_bound is not None:  # its bound (catch-up aside)
                    could = self.rating(arm, bound[:2] + (0.0,), bound=True)
                else:
                    could = self.rating(arm, pred[arm][:2] + (0.0,))
                if self.figures[arm][4] == 0 and could < cfg.far * rate[best] and arm not in self.deferred:
                    # never run, and the model puts it far behind (its catch-up aside): its first look waits longer
                    self.deferred.add(arm)
                    self.interval[arm] = min(cfg.max_explore_every, cfg.look_much_later * self.interval[arm])
                    self.due[arm] = self.steps + self.interval[arm]
                    continue
                return self._burst(arm)
        self.current = best
        return best

    def _end_burst(self, rate: dict[str, float]) -> None:
        """A burst has ended: when to look at its arm again (not clearly ahead: later; far
        behind: much later; clearly ahead: it leads now, and the arms it passed are looked at
        again soon)."""
        cfg = self.config
        arm, self.exploring = self.exploring, None
        self.look_cost[arm] = max(0.0, self._spent.pop(arm, 0.0))
        others = max(rate[a] for a in self.arms if a != arm)
        if rate[arm] * cfg.margin <= others:
            grow = cfg.look_much_later if rate[arm] < cfg.far * others else cfg.look_later
            self.interval[arm] = min(cfg.max_explore_every, grow * self.interval[arm])
        else:
            self.interval[arm] = cfg.explore_every
        self.due[arm] = self.steps + self.interval[arm]

    def _burst(self, arm: str) -> str:
        self.current, self.exploring, self.burst_left = arm, arm, self.config.burst - 1
        f = self.figures[arm]
        if arm in self.own and f[4] > 1:  # the burst's steps rate it, its older ones at one step's weight
            self.figures[arm] = _one_step(f)
            self.context[arm] = _one_step(self.context[arm])
        return arm

    def record(self, arm: str, committed: float, expected: float, seconds: float, predicted: float,
               switched: bool, context: tuple[float, float] | None = None) -> None:
        """A step of `arm`; `context`: its mean context and the profile's seconds per token of it;
        `switched`: it switched sides (its cost is the switch's, not the arm's: not recorded)."""
        if switched:
            return
        if arm not in self.own:  # its first step here replaces the neighbour's figures
            self.own.add(arm)
            self.figures[arm] = [0.0] * 5
            self.context[arm] = [0.0, 0.0, 0.0]
        f, d = self.figures[arm], self.config.decay
        for i, v in enumerate((committed, expected, seconds, predicted, 1.0)):
            f[i] = f[i] * d + v
        if context is not None:
            c, (ctx, slope) = self.context[arm], context
            c[0], c[1], c[2] = c[0] * d + slope * ctx, c[1] * d + slope, c[2] * d + 1.0
        t, d = self.tokens[arm], self.config.token_decay
        t[0], t[1] = t[0] * d + committed, t[1] * d + expected
