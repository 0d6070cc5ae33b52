"""`goodput`: per request, per step, the verification lengths that maximise the step's expected
committed tokens per second.

    maximise  sum_i E_i(L_i) / (t_draft + cost(B, sum_i (1 + L_i)))
    E_i(L)  = 1 + sum_{j <= L} prod_{m <= j} a_{i,m}

a_{i,m}: the estimated acceptance of proposal m of row i given the earlier ones were accepted
(calibration.py: from the drafter's confidence at m, calibrated online, engine-wide and per
request); cost(.) and t_draft: the measured hardware profile's cost model (cost.py).

- `plan` (before drafting) solves the whole problem with a_{i,m} = the engine's conditional
  acceptance at position m scaled by the request's recent rate (`choose_lengths`); the drafting time is part of the objective (one drafter
  step per position, over the rows that draft that far), so a loaded step or a useless drafter
  drafts little or nothing. While the plan drafts for some rows, a row it leaves out that has not
  verified for `probe_every` steps drafts and verifies one proposal (a probe: its estimate can
  recover); when the plan drafts for no row (the load or the engine-wide estimate stops them
  all), only one row of the batch probes, when no row has verified for the engine-wide interval
  (the engine-wide estimate, which new requests start from, can recover too; per-row probes there
  would each pay the drafter's catch-up over the row's whole context for nothing), and only while
  the measured check rates fixed speculation above plain steps at this batch size (where it does
  not, its bursts of "full" calibrate the estimates: `_plain_leads`). A row's probe
  that accepts nothing doubles its interval (up to `max_probe_every`); one that accepts resets
  it. The engine-wide probe that accepts resets the engine-wide interval only while the measured
  check rates fixed speculation above plain steps (the estimate, not the load, stops drafting);
  otherwise it doubles it whatever it accepts, and only a plan that drafts again brings it back.
  The optimum's value, lambda
  (expected committed tokens per second of the planned step), is kept for `admit`.
- `admit` (after drafting) keeps proposal j of row i while its gain prod_{m<=j} a_{i,m}, now from
  the confidences of q_1..q_j, pays for its marginal verification time at the planned rate:
  gain >= lambda * dcost/dtoken. This is the optimality condition of the ratio for a cost linear
  in tokens, and it is causal by construction: the decision on proposal j reads q_1..q_j (through
  their confidences) and plan-time figures, never x_j nor anything drafted after it (a rule that
  picked the best prefix from all the row's confidences would read q_{j+1}, a function of x_j).

A measured check on top (`_Arms`): per batch size (half octaves, `batch_bucket`), the policy
keeps decayed committed-tokens-per-second figures of three arms, as measured: the steps it ran as
planned ("spec"), steps where every row drafted and verified all it may, as the fixed policy does
("full"), and steps it ran without verifying ("plain", no probes either; the plan's own Python
time is left out of "plain"'s and "full"'s seconds: leading, they coast without it); it runs the best and
tries the others in bursts of a few steps, less and less often while they stay clearly behind.
It decides also when the plan drafts nothing: estimates that an unlucky start made pessimistic
recover through its bursts of "full", not only through one-proposal probes. The choice reads the
history only (causal; "full" admits every proposal, reading none). A cost model or estimates that
are off (a profile measured on a loaded machine, the step's Python work, a calibration that
overrates short blocks) then cost at most the exploration, not the operating point. A drafting
step right after plain ones pays the drafter's catch-up, and a plain step right after drafting
ones runs slower than the plain steps after it: costs of switching, left out of the arms'
figures. While "plain" or "full" leads the others clearly at a batch size, `plan` skips the
optimisation (its Python work is ~0.3 ms a step at 8 rows, 1 ms at 32), and of those plain steps
one in four updates the cost model (the update is ~1% of a batch-1 plain step). Looking away from the
leading arm (a burst of another, an engine-wide probe) has a budget (`_spend`): ~2% of the run's
step time, so that where one arm leads clearly the looks (mostly the drafter's catch-up after
plain steps) cost little whatever the intervals say.

The arms are those of the batch the rows will decode in (`expect_batch`: this step's rows plus
those prefilling or waiting): a batch filling up is decided as the full one, its steps recorded
nowhere (for `FILL_PLANS` plans at most: a batch that does not fill is then decided at its size).

`choose_lengths` adds candidate positions in decreasing order of their gain (a row's gains
decrease along it, so every row keeps a prefix) and keeps the best prefix of that order: exact
for a cost linear in tokens, and it accounts for the jump of a new drafter step.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Sequence

from ..proposers.draft_model import DraftModelProposer
from .base import causal_lengths, register_policy
from .calibration import Calibration, RequestEstimate
from .cost import CostModel, OnlineCost


def choose_lengths(
    gains: Sequence[Sequence[float]],  # [B][<= K] prod_{m<=j} a_{i,m}, non-increasing along a row
    step_seconds: Callable[[int], float],  # total tokens fed -> seconds of the target forward (+ fixed costs)
    draft_step_seconds: Callable[[int], float] | None = None,  # rows in a drafter step -> seconds
    minimum: Sequence[int] | None = None,  # [B] lengths that must be kept (probes)
    first_cost: Sequence[float] | None = None,  # [B] seconds a row's first proposal adds (its drafter catch-up)
) -> tuple[list[int], float]:  # lengths [B], the objective's value (expected tokens per second)
    b = len(gains)
    fc = first_cost if first_cost is not None else [0.0] * b
    # by gain; among equal gains the rows with less catch-up first (a row's own positions keep their order)
    order = sorted(((g, j, i) for i, row in enumerate(gains) for j, g in enumerate(row)),
                   key=lambda t: (-t[0], fc[t[2]], t[1]))
    lengths = [0] * b
    count_ge: dict[int, int] = {}  # position j -> rows drafting past it
    tokens, expected, draft_s = b, float(b), 0.0
    best, best_n = expected / max(step_seconds(tokens), 1e-12), 0
    forced = 0
    if minimum is not None:  # forced positions first, whatever they gain
        forced_pos = {(i, j) for i, m in enumerate(minimum) for j in range(min(m, len(gains[i])))}
        order = [t for t in order if (t[2], t[1]) in forced_pos] + [t for t in order if (t[2], t[1]) not in forced_pos]
        forced = len(forced_pos)
    for n, (g, j, i) in enumerate(order):
        if lengths[i] != j:  # cannot happen with non-increasing gains; keep prefixes regardless
            continue
        lengths[i] += 1
        if first_cost is not None and j == 0:
            draft_s += first_cost[i]
        if draft_step_seconds is not None:
            c = count_ge.get(j, 0) + 1
            count_ge[j] = c
            draft_s += draft_step_seconds(c) - (draft_step_seconds(c - 1) if c > 1 else 0.0)
        tokens += 1
        expected += g
        value = expected / max(draft_s + step_seconds(tokens), 1e-12)
        if n + 1 <= forced or value > best:
            best, best_n = value, n + 1
    out = [0] * b
    for g, j, i in order[:best_n]:
        out[i] = max(out[i], j + 1)
    return out, best


def batch_bucket(num_seqs: int) -> int:
    """Batch sizes the measured check rates together: half octaves (1, 2, 3, 4, 5-6, 7-9, 10-13,
    14-18, 19-26, 27-38, ...): a level's batch and the smaller ones of its tail (requests ending,
    others arriving) stay apart, where the best arm can differ (e.g. speculation at 16, not at 32)."""
    return int(2 * math.log2(max(1, num_seqs)) + 0.5)


@register_policy("goodput")
class GoodputPolicy:
    needs_cost_model = True
    needs_confidence = True
    probe_every = 32
    ARMS = ("spec", "full", "plain")  # planned lengths, every row its maximum (fixed k), no drafting
    max_probe_every = 512
    EXPLORE_BUDGET = 0.02  # of the run's step time, spent at most on looking away from the leading arm
    CREDIT_CAP = 0.25  # seconds: the budget does not bank more (no cluster of looks after a long run)
    CATCH_UP_HORIZON = 64  # steps a drafter catch-up is spread over when deciding to start drafting
    LONG_CATCH_UP = DraftModelProposer.LONG_CATCH_UP  # lags fed in forwards of their own (timed apart)
    FILL_PLANS = 64  # plans a batch may take to fill up to the batch ahead (then: its own size)
    COAST_OBSERVE_EVERY = 4  # coasting steps (plain or full): one in this many updates the cost model
    # (and, coasting on "full", the calibration)

    def __init__(self, k: int = 4, cost: CostModel | None = None, has_draft_model: bool = False, **_):
        if cost is None:
            raise ValueError("the goodput policy needs a cost model (a hardware profile)")
        self.k = k
        self.cost = cost
        self.model = OnlineCost(cost)  # the profile + what it misses of a whole step, learned online
        self.has_draft_model = has_draft_model
        self.calibration = Calibration()
        self._probes: set[int] = set()  # seq_ids probing this step
        self._rate = 0.0  # the planned step's expected committed tokens per second
        self._idle_steps = 0  # steps since any row verified a proposal
        self._step = 0  # decode steps observed (a request's probe is due `probe_every` after its last verification)
        # probe intervals: doubled after a probe that accepted nothing (up to max_probe_every), back
        # to probe_every after one that accepted: a useless drafter costs ever fewer probes
        self._probe_interval: dict[int, int] = {}  # seq_id -> steps
        self._engine_probe_interval = self.probe_every
        self._arms: dict[int, _Arms] = {}  # batch bucket (batch_bucket(B)) -> the measured check's figures
        self._last_mode = "plain"  # the previous step's arm (a drafting arm after plain steps catches up)
        # (tokens, seconds, catch-up, context, the seconds' growth per token of context) predicted for this step
        self._pred: tuple[float, float, float, float, float] | None = None
        # seconds per token of the drafter's catch-up, learned from the long ones (timed by the
        # proposer); at first the profile's per-sequence cost of a drafter step
        self._catch_up_per_token = cost.draft[1] if cost.draft[1] > 0 else 2e-5
        self._long_catch_up = 0  # tokens this step's long catch-ups feed
        self._mode = "spec"  # this step's arm
        self._coasted = 0  # coasting steps seen (the cost model observes one in COAST_OBSERVE_EVERY)
        # coasting "full" steps planned; of them, one in COAST_OBSERVE_EVERY feeds the calibration,
        # the others are `_thin` (`observe` only counts their tokens): per row ~14 us of Python on
        # the EPYC in the engine, ~0.7% of the step time at 4 rows, for estimates that no decision
        # reads while the coast lasts (the arms record no coasting step)
        self._coast_full = 0
        self._thin = False
        self._plan_seconds = 0.0  # the last plan's own Python time
        self._idle_plan = False  # the last plan drafted for no row (its "spec" step is a plain one)
        self._full_plan = False  # the last plan drafted all it may for every row (its "spec" step is a "full" one)
        self._bucket = 0
        self._plan_b = 0  # the batch size `_bucket` is of (the rows decoding)
        self._ahead = 0  # `expect_batch`'s figure for the next plan (0: not told)
        self._plan_ahead = 0  # the batch ahead `_bucket` is of
        self._own_bucket = self._ahead_bucket = 0  # batch_bucket of _plan_b and of _plan_ahead
        self._filling = False  # this step's rows are fewer than the batch ahead's bucket
        self._fill_plans = 0  # consecutive plans whose batch ahead was in another bucket
        self._committed = [0, 0]  # this step: tokens committed and rows seen by `observe`
        # the exploration budget: seconds of steps that looked away from the leading arm (bursts of
        # the others, engine-wide probes) may cost at most EXPLORE_BUDGET of the time run
        self._credit = 0.0  # seconds of exploration the budget allows now (negative: overspent)
        self._looking: str | None = None  # this step explores: the arm of a burst, or "probe"
        self._lead_rate = 0.0  # the leading arm's rating when this step was decided (tokens/s)
        self._probe_cost = 0.0  # seconds an engine-wide probe cost last time (its catch-up mostly)

    def plain_next(self, num_seqs: int) -> bool:
        """The next step at this batch size runs plain for certain: a coasting lease of plain
        decoding (`_Arms.coast`), which `plan` returns unchecked. The scheduler then lets a lone
        greedy row commit several tokens in one call, as plain decoding does (at batch 1 a useless
        drafter's engine ran at 0.95x `none`: 5 tokens a call, 1 + k, against `none`'s 8)."""
        if num_seqs != self._plan_b:  # another batch size: plan decides afresh
            return False
        arms = self._arms.get(self._bucket)
        return arms is not None and arms.lease > 0 and arms.lease_arm == "plain"

    def reads_confidence(self) -> bool:
        """A coasting step of fixed speculation that only counts its tokens (`_thin`) admits every
        proposal and calibrates nothing: its drafter need not compute max q_j per proposal."""
        return not self._thin

    def expect_batch(self, num_seqs: int) -> None:
        self._ahead = num_seqs

    def _context(self, seqs) -> float:
        return sum(s.num_tokens for s in seqs) / max(1, len(seqs))

    def plan(self, seqs, max_draft):
        t = time.perf_counter()
        lengths = self._plan(seqs, max_draft)
        self._plan_seconds = time.perf_counter() - t
        return lengths

    def _plan(self, seqs, max_draft):
        b = len(seqs)
        # the arms of the batch these rows will run in: while it fills (requests arriving together,
        # prefilling in turn), its first steps decode a few rows; decided at their own batch size,
        # fixed speculation's lead at 1-3 rows started the drafter's catch-up over each new prompt
        # for a step or two, then plain decoding at the full batch (at 8 rows of code-hard, every
        # turnover of a closed loop)
        ahead = max(b, self._ahead)
        self._ahead = 0
        if (b, ahead) != (self._plan_b, self._plan_ahead):  # (batch_bucket's log2 only when they change)
            self._plan_b, self._plan_ahead = b, ahead
            self._own_bucket, self._ahead_bucket = batch_bucket(b), batch_bucket(ahead)
        filling = self._ahead_bucket != self._own_bucket
        self._fill_plans = self._fill_plans + 1 if filling else 0
        if self._fill_plans > self.FILL_PLANS:  # a batch that does not fill (the K/V pool holds fewer,
            filling = False  # an admission limit): its own size
        bucket = self._ahead_bucket if filling else self._own_bucket
        moved, self._bucket = bucket != self._bucket, bucket
        # a step of a filling batch is its bucket's decision, not its figures (another batch size)
        self._filling = filling
        arms = self._arms_at(self._bucket)
        if moved:  # back from another bucket, whose plans may have changed what `coast` reads (`idle`)
            arms.lease = 0
        self._looking = None
        coast = arms.coast(self._credit, self.CREDIT_CAP, idle=self._idle_plan, full=self._full_plan)
        self._thin = False
        if coast == "plain":  # plain by a wide margin here: no plan for a few steps
            self._mode, self._rate, self._probes, self._pred, self._long_catch_up = "plain", math.inf, set(), None, 0
            return [0] * b
        if coast == "full":  # fixed speculation by a wide margin: every row drafts all it may, unplanned
            self._mode, self._rate, self._probes, self._pred = "full", 0.0, set(), None
            self._coast_full += 1
            self._thin = self._coast_full % self.COAST_OBSERVE_EVERY != 0
            self._long_catch_up = sum(n - 1 for n, m in zip(self._lags(seqs), max_draft) if m and n > self.LONG_CATCH_UP)
            return list(max_draft)
        ctx = self._context(seqs)
        cal = self.calibration
        gains, due = [], []
        for s, m in zip(seqs, max_draft):
            row, g = [], 1.0
            for a in cal.position_rates(s.seq_id, m):
                g *= a
                row.append(g)
            gains.append(row)
            r = cal.requests.get(s.seq_id)
            if r is None:  # (the same estimates as none: the engine-wide ones)
                r = cal.requests[s.seq_id] = RequestEstimate(last_verified=self._step)
            every = self._probe_interval.get(s.seq_id, self.probe_every)
            due.append(1 if m and self._step - r.last_verified >= every else 0)
        draft = None
        if self.has_draft_model:
            per_rows = [self.model.draft_step_seconds(n, ctx) for n in range(b + 1)]  # rows in a drafter step
            draft = per_rows.__getitem__
        # the drafter's catch-up before a row's first proposal (a new prompt, steps without
        # drafting), spread over the steps it serves (`_horizon`): what starting costs
        lag = self._lags(seqs)
        catch = [(n - 1) * self._catch_up_per_token / self._horizon(s, row) if n > 1 else 0.0
                 for n, s, row in zip(lag, seqs, gains)]
        lengths, self._rate = choose_lengths(gains, self.model.tokens_seconds(b, ctx), draft, first_cost=catch)
        if any(lengths):  # the rows the plan leaves out probe when due (their estimates may be stale)
            probes = due
            self._engine_probe_interval = self.probe_every  # speculation pays: a later stop probes soon
        else:  # the load or the engine-wide estimate stops every row: one engine-wide probe now and then
            probes = [0] * b
            i = next((i for i, m in enumerate(max_draft) if m), None)
            if self._idle_steps >= self._engine_probe_interval and i is not None \
                    and self._credit >= min(self._probe_cost, self.CREDIT_CAP) and not self._plain_leads():
                probes[i] = 1
        lengths = [max(n, p) for n, p in zip(lengths, probes)]
        self._probes = {s.seq_id for s, p in zip(seqs, probes) if p}
        planned_plain = not any(n > p for n, p in zip(lengths, probes))
        self._idle_plan = planned_plain
        self._full_plan = any(max_draft) and all(n >= m for n, m in zip(lengths, max_draft))
        # what the model expects of each arm now (committed tokens, seconds): the measured check
        # corrects these by what each arm's steps actually gave at this batch size
        pred = {"spec": self._predict(gains, lengths, b, ctx, catch),
                "full": self._predict(gains, max_draft, b, ctx, catch),
                "plain": self._predict(gains, [0] * b, b, ctx, catch)}
        # the measured check decides even when the plan drafts nothing: estimates that an unlucky
        # start made pessimistic (a few rejections at temperature 1) recover through its bursts of
        # "full", which test every proposal, not only through one-proposal probes
        self._mode = arms.choose(pred, self._credit, self.CREDIT_CAP, last=self._last_mode)
        self._lead_rate = arms.lead_rate
        if arms.exploring is not None:
            self._looking = arms.exploring
        if planned_plain and self._mode == "spec":
            self._mode = "plain"
        self._pred = pred["spec"] if planned_plain and self._mode == "plain" else pred[self._mode]
        if self._mode == "plain":
            self._rate = math.inf
            # only a plan that drafts nothing probes; chosen by the measured check, a plain step has
            # no probes (the estimates are not what stops speculation there: the "spec" arm's
            # steps probe the rows that are due)
            lengths = [min(n, p) for n, p in zip(lengths, probes)] if planned_plain else [0] * b
            self._probes = {s.seq_id for s, n in zip(seqs, lengths) if n}
            if self._probes and self._looking is None:
                self._looking = "probe"
        elif self._mode == "full":  # every row drafts and verifies all it may: fixed speculation
            self._rate = 0.0
            lengths = list(max_draft)
        # the tokens the proposer will feed in forwards of their own (see observe_step)
        self._long_catch_up = sum(n - 1 for n, m in zip(lag, lengths) if m and n > self.LONG_CATCH_UP)
        return lengths

    def _horizon(self, seq, gains) -> float:
        """Steps a row's drafter catch-up is spread over: the steps the row has left (its tokens
        left, max_tokens less its output, over the tokens a step drafting all it may is expected to
        commit), up to CATCH_UP_HORIZON: a catch-up serves the row's steps after it, few near a
        request's end (at 16 rows of code-hard, each first step of a smaller batch at the end of a
        run drafted for every row, its catch-up spread over 16 steps that the rows no longer had),
        ~36 for a fresh 128-token one (a cap of 16 charged it more than twice that)."""
        out = getattr(seq, "output_ids", None)
        if out is None:
            return self.CATCH_UP_HORIZON
        steps = (seq.params.max_tokens - len(out)) / (1.0 + sum(gains))
        return min(self.CATCH_UP_HORIZON, max(1.0, steps))

    def _spend(self, committed: float, seconds: float) -> None:
        """The exploration budget: every step adds EXPLORE_BUDGET of its seconds (up to
        CREDIT_CAP); a step that looked away from the leading arm takes off what it cost against
        that arm's rate (its seconds less the time the leader would have taken for its tokens,
        the drafter's catch-up included), counted to the burst's arm (`_Arms.spend`) or as the
        engine-wide probe's cost. A look is started only while the credit covers what the same
        look cost last time, so where one arm leads clearly, looking costs at most about
        EXPLORE_BUDGET of the run (the first look at an arm is free: its cost is not known)."""
        self._accrue(seconds)
        if self._looking is None or self._lead_rate <= 0 or math.isinf(self._lead_rate):
            return
        cost = seconds - committed / self._lead_rate
        self._credit -= cost
        if self._looking == "probe":
            self._probe_cost = max(0.0, cost)
        else:
            self._arms_at(self._bucket).spend(self._looking, cost)

    def _accrue(self, seconds: float) -> None:
        """Every step adds EXPLORE_BUDGET of its seconds to the exploration credit (up to CREDIT_CAP)."""
        self._credit = min(self.CREDIT_CAP, self._credit + self.EXPLORE_BUDGET * seconds)

    def _lags(self, seqs) -> list[int]:
        """Tokens each row's drafter cache is behind (fed before its first proposal; 0 for n-gram)."""
        if not self.has_draft_model:
            return [0] * len(seqs)
        return [max(0, s.num_tokens - getattr(s, "draft_computed", s.num_tokens)) for s in seqs]

    def _predict(self, gains, lengths, b: int, ctx: float, catch) -> tuple[float, float, float, float, float]:
        """Expected committed tokens and seconds of a step drafting `lengths`: the estimates', the
        hardware profile's alone (fixed: the online residual moves, and ratios to a moving
        prediction would not compare), the drafting rows' catch-up (amortised), and the mean
        context with the profile's seconds per token of it for this step (`_Arms.rating` moves an
        arm's measured seconds to the contexts of now)."""
        expected = b + sum(sum(row[:n]) for row, n in zip(gains, lengths))
        fed = b + sum(lengths)
        drafted = lengths if self.has_draft_model else ()
        seconds = self.model.profile_seconds(b, fed, ctx, drafted)
        return (expected, seconds, sum(c for c, n in zip(catch, lengths) if n),
                ctx, self.model.context_slope(b, drafted))

    def _arms_at(self, bucket: int) -> "_Arms":
        """The bucket's figures; a new bucket starts from its nearest measured neighbour's (the
        best arm rarely changes between neighbouring batch sizes: warming every bucket up again,
        bursts of each arm, cost more than the neighbour's figures, which its own steps replace)."""
        arms = self._arms.get(bucket)
        if arms is None:
            near = min(self._arms, key=lambda b: (abs(b - bucket), b), default=None)
            arms = self._arms[bucket] = _Arms(self.ARMS, seed=self._arms[near] if near is not None else None)
        return arms

    def admit(self, seqs, blocks, draft_seconds):
        if self._mode == "full" or not any(blk.token_ids for blk in blocks):  # all, or nothing drafted
            return [len(blk.token_ids) for blk in blocks]
        b, ctx = len(seqs), self._context(seqs)
        cal = self.calibration
        # marginal seconds of one more verified token, and the rate it must pay for
        threshold = self._rate * (self.model.step_seconds(b, b + 1, ctx) - self.model.step_seconds(b, b, ctx))
        gain = [1.0] * b

        def keep(i: int, j: int, conf: float | None) -> bool:  # reads q_j's confidence, never x_j
            s = seqs[i]
            gain[i] *= cal.rate(s.seq_id, s.params.is_greedy, conf)
            return gain[i] >= threshold or (j == 0 and s.seq_id in self._probes)

        return causal_lengths(blocks, keep)

    def observe(self, seq, block, num_verified, num_accepted):
        if not num_verified:  # nothing tested: one committed token, as `observe_step` counts a row not seen
            return  # (how long since the row last verified is kept as a step number: nothing to count)
        self._committed[0] += num_accepted + 1
        self._committed[1] += 1
        r = self.calibration.requests.get(seq.seq_id)
        if r is None:
            r = self.calibration.requests[seq.seq_id] = RequestEstimate()
        r.last_verified = self._step
        if self._thin:  # coasting on fixed speculation: one step in COAST_OBSERVE_EVERY calibrates
            return
        if seq.seq_id in self._probes:
            every = self._probe_interval.get(seq.seq_id, self.probe_every)
            every = self.probe_every if num_accepted else min(self.max_probe_every, 2 * every)
            self._probe_interval[seq.seq_id] = every
            if self._idle_steps >= self._engine_probe_interval:  # it was the engine-wide probe too
                if num_accepted and not self._plain_leads():  # the estimate stops drafting: probe soon
                    self._engine_probe_interval = self.probe_every
                else:
                    # nothing accepted, or plain steps measure ahead of fixed speculation here (the
                    # load stops it, whatever the estimate): the next one waits twice as long; a
                    # plan that drafts again (`_plan`) brings the wait back. Reset by every
                    # accepting probe (and by a burst of "full" that accepted), at 4 and 8 rows of
                    # code-hard, where the drafter is fair and the load is what stops it, a probe
                    # came every ~76 steps, each catching a row's drafter up over its whole context
                    # for one proposal (~1.5% of the time) for a plan that still drafted nothing
                    self._engine_probe_interval = min(self.max_probe_every, 2 * self._engine_probe_interval)
        elif num_accepted:
            self._probe_interval.pop(seq.seq_id, None)
        conf = (block.confidence or [None] * len(block.token_ids))[:num_verified]
        self.calibration.observe(seq.seq_id, seq.params.is_greedy, conf, num_accepted)

    def _plain_leads(self) -> bool:
        """The measured check's last decision at this batch size rated plain steps at least as high
        as fixed speculation (or none was made yet): the load, not the estimate, stops drafting.
        No engine-wide probe is started then: the bursts of "full" that the check still runs now
        and then verify every row at every position, which calibrates the estimates more than a
        probe's one proposal (at 8 rows of code-hard, where fixed speculation ran at ~0.8x plain
        decoding's rate, ~20 probes in 3 rounds each caught a row's drafter up over its whole
        context: ~0.5% of the run); and an accepting probe, were one made, does not say that
        speculation would pay."""
        rates = self._arms_at(self._bucket).rates
        return rates.get("plain", 0.0) >= rates.get("full", 0.0)

    def forget(self, seq_id):
        self.calibration.forget(seq_id)
        self._probe_interval.pop(seq_id, None)

    def observe_step(self, num_seqs, num_tokens, context, draft_lengths, seconds, catch_up_seconds=0.0,
                     untimed_seconds=None):
        self._step += 1
        self._idle_steps = 0 if num_tokens > num_seqs else self._idle_steps + 1
        committed = self._committed[0] + max(0, num_seqs - self._committed[1])  # rows not observed: 1 each
        self._committed = [0, 0]
        if untimed_seconds is not None:  # a plain multi-step step (several forwards): its time still
            self._accrue(untimed_seconds)  # adds to the budget, which would not grow at batch 1 otherwise
        if seconds is None:  # a mixed or multi-step step (not the forward modelled): nothing to learn from
            self._last_mode = self._mode
            return None
        self._spend(committed, seconds)
        if catch_up_seconds > 0 and self._long_catch_up > 0:
            per = catch_up_seconds / self._long_catch_up
            self._catch_up_per_token += 0.2 * (per - self._catch_up_per_token)
        if self._pred is None and self._last_mode == self._mode:  # coasting (no plan, nothing to correct)
            self._coasted += 1
            if self._coasted % self.COAST_OBSERVE_EVERY:  # the cost model samples these: its update
                return None  # (~50-70 us a step in the engine) is ~1% of a plain step at batch 1
        # a drafting step right after plain ones also feeds the drafter everything it missed: a cost
        # of switching, not of the arm (counted, a burst of exploration after a long plain run would
        # rate speculation by its catch-up); the drafter's prefill of a new prompt while drafting is
        # the arm's (plain decoding never pays it: left out, the drafting arms were rated ~20-40%
        # above what their steps gave at 8 rows of code-hard, and ran at 0.86x plain's rate)
        catch_up = self._mode != "plain" and self._last_mode == "plain" and self.has_draft_model
        # the other way round, a plain step right after drafting ones is slower than the plain steps
        # after it (on the AVX-512 EPYC at 4 rows of code-hard: 4-5 against 2.6-3.2 ms, the caches
        # holding the drafter's and the verification's data): a cost of switching too, left out
        # (counted, the plain arm's bursts, one switch in three steps, rated it below "full", 897
        # against 1002 tok/s, where plain decoding ran at 1.1x fixed speculation's rate)
        switched = self._mode == "plain" and self._last_mode != "plain"
        # a coasting plain step had no prediction (nothing to correct); a plan's probing plain step
        # pays the probes' catch-ups over whole contexts, which plain decoding never does
        if self._pred is not None and not (self._mode == "plain" and self._probes):
            # a switch (the catch-up included) is not recorded: `record` drops it; "plain" and "full",
            # run as the leader, coast: no plan to pay
            arm_seconds = seconds - (self._plan_seconds if self._mode != "spec" else 0.0)
            self._arms_at(self._bucket).record(self._mode, committed, self._pred[0], arm_seconds,
                                               self._pred[1], switched=catch_up or switched or self._filling,
                                               context=self._pred[3:5])
        lengths = list(draft_lengths) if self.has_draft_model else []
        profile_only = self.model.profile_seconds(num_seqs, num_tokens, context, lengths)
        if self._pred is None and self._last_mode == self._mode and self._mode in ("plain", "full"):
            # a coasting step (one in COAST_OBSERVE_EVERY gets here): the leader's figures follow the
            # steps it runs (unrecorded, they stayed those of its last planned steps: at batch 1 of
            # grounded, "full" coasted ~1000 steps rated 570 tok/s from steps before, where it ran
            # ~900, and every look at "spec" put that ahead); no plan, so no estimate of its tokens:
            # what it committed, scaled so that the arm's committed / expected ratio stays as it is
            arms = self._arms_at(self._bucket)
            got, meant = arms.tokens[self._mode]
            expected = committed * (meant / got if got > 0 and meant > 0 else 1.0)
            arms.record(self._mode, committed, expected, seconds - self._plan_seconds, profile_only,
                        switched=self._filling,
                        context=(context, self.model.context_slope(num_seqs, lengths)))
        self._last_mode = self._mode
        predicted = profile_only + self.model.residual(num_seqs, num_tokens, max(lengths, default=0))
        # the cost model is of the decode step proper; the arms pay for everything (a drafting
        # arm is what makes the drafter prefill new prompts)
        self.model.observe(num_seqs, num_tokens, context, lengths, seconds - catch_up_seconds, profile=profile_only)
        return predicted, profile_only


def _one_step(sums: list[float]) -> list[float]:
    """Decayed sums whose last entry is their weight, brought to the weight of one step (their
    means); sums of no weight (nothing recorded) stay as they are."""
    if sums[-1] <= 0:
        return list(sums)
    return [v / sums[-1] for v in sums[:-1]] + [1.0]


class _Arms:
    """The measured check at one batch size: what each arm's steps gave, and when to look at the
    others again.

    Each arm keeps decayed sums of its steps' committed tokens and seconds as measured (the
    seconds without the drafter's long catch-ups, whose per-token cost is learned apart), and of
    what the model expected of them; an arm's rating now is its tokens per step over its measured
    seconds per step plus the catch-up that running it now would start with (drafting rows that
    lag, spread over `CATCH_UP_HORIZON` steps). Its tokens per step: what the calibration expected
    of its last ~10 steps (the steps its seconds are of, `DECAY`) times its committed / expected
    tokens over its last ~50 (`TOKEN_DECAY`). Committed tokens vary far more from step to step than
    seconds (2 to 10 a step at 2 rows of code-hard), and rated by a burst's few steps of them, an
    arm that an unlucky burst put behind waited ever longer for its next look; tokens do not drift
    with the machine, so their ratio can average over many steps (in a simulation of the check
    under machine drift, where fixed speculation is 20% ahead of plain decoding: 0.96x the best
    arm's rate on average, 0.90x in the worst tenth of runs, against 0.99x and 0.98x; see
    benchmarks/arms_sim.py). Measured seconds, not the model's prediction corrected by a ratio: at
    batch 1 on the AVX2 machine the plan's shorter blocks cost nearly a full block's time (13.8
    against 14.5 ms, the drafter's steps and the step's fixed work), while the corrected
    prediction still rated them first. An arm never run is rated by the model alone. Its
    seconds are moved to the contexts of now: a step's time grows with the rows' contexts (~15%
    over a request at 16 rows of code-easy), and two arms' figures are of steps taken at different
    times; each arm keeps the profile's seconds per token of context of its steps and their
    context (`record`'s `context`, decayed as its seconds), and its rating adds that slope times
    how far the context moved since. The leader's coasting steps are recorded too (one in
    `COAST_OBSERVE_EVERY`, the tokens they committed as expected, scaled by the arm's committed /
    expected ratio): its figures follow the steps it runs, not those before the coast.

    The best-rated arm runs ("spec" only when rated more than `PLAN_EDGE` ahead of "full": two
    ratings from a few noisy steps each, and a plan that merely ties with fixed speculation
    verified shorter blocks for nothing: on grounded at 4 rows, 3.36 against 3.50 tokens a round
    and 0.88x fixed's rate, 1.03x with the edge). Between drafting and plain steps it keeps the
    previous step's side unless the other is rated more than `SWITCH` ahead: each return to
    drafting first pays the drafter's catch-up, and under open-loop arrivals the batch size (so
    the bucket, and the arm its figures favour) changes every few steps; without it the policy
    flipped sides every few steps at 16 requests/s on code-easy (TPOT p90 worse in 4 of 4 rounds of
    the same arrivals, e.g. 42.2 against 32.7 ms). Another is tried in a burst of `BURST`
    consecutive steps (one step is too noisy a sample, and its first step may pay the drafter's
    catch-up) when its turn is due:
    every `EXPLORE_EVERY` steps at first, twice as long after each burst that did not put it more
    than 5% ahead of the others (`MARGIN`; four times when it left it more than 20% behind, `FAR`),
    up to `MAX_EXPLORE_EVERY`, back to `EXPLORE_EVERY` after one that put it clearly ahead (a tie
    is not looked at again soon: the sides' rates hardly differ, and each look at drafting after
    plain steps pays the drafter's catch-up, outside the arms' figures: on the EPYC at 16 rows of
    code-hard and 32 of grounded, where fixed speculation ran at 0.76-0.95x plain's rate, goodput
    ran at 0.87-0.93x `none` with looks at tied arms every 32 steps (four runs), 1.04-1.10x without
    (one run each; 64 requests, 3 rounds); an arm never run that the model rates more
    than 20% behind, the drafter's catch-up left out, waits four times as long for its first look
    (a catch-up is paid once, not every step: counted, 32 fresh prompts' catch-up deferred the first
    look at fixed speculation ~130 steps at 32 rows in benchmarks/policy_sim.py, where it ran
    1.39x plain's rate). A clearly worse arm (speculation
    at a high load, plain decoding at batch 1) so costs ever less exploration. While "plain" or
    "full" leads every other arm by more than `COAST` (or none is ahead of it by the margin `choose`
    asks to leave it: `_keeps`) and no burst is due, `plan` is skipped for up
    to `COAST_STEPS` steps (`coast`; `FAR_COAST_STEPS` while it leads by more than 1 / FAR). A new batch size starts from a neighbour's figures and
    intervals (`seed`): until an arm has steps of its own there, it is rated by the model's figures
    times the neighbour's measured / predicted ratios (rates measured at another batch size do not
    compare with this one's), and it is looked at within `FIRST_LOOK` steps, whatever the
    exploration budget (the intervals after that first look grow from the neighbour's). A step
    that switches sides (drafting after plain steps: the drafter's catch-up; plain after drafting:
    caches holding the drafting's data) is a cost of switching, left out of the arm's figures.
    An arm whose last step here is more than `STALE` decisions old does not take over on its
    figures: it runs a burst first, and a burst rates its arm by its own steps (the arm's older
    ones kept at one step's weight): the rows' contexts grow and the machine's speed drifts, so
    two arms compare only from steps taken close together."""

    BURST = 3
    DECAY = 0.9  # per recorded step of that arm: its seconds follow the last ~10 of its steps
    TOKEN_DECAY = 0.98  # its committed / expected tokens, the last ~50 (no drift in tokens)
    TOKEN_PRIOR = 0.25  # weight of a neighbouring batch size's committed / expected tokens
    EXPLORE_EVERY = 32
    FIRST_LOOK = 16  # steps before the first look at an arm at a new batch size (a neighbour's figures until then)
    MAX_EXPLORE_EVERY = 1024
    MARGIN = 0.95
    FAR = 0.8
    COAST = 1.1
    COAST_STEPS = 16
    FAR_COAST_STEPS = 64  # while the leader's lead is beyond 1 / FAR
    PLAN_EDGE = 1.03  # "spec" runs instead of "full" only when rated this much ahead
    SWITCH = 1.05  # from drafting to plain steps or back only when the other side is rated this much ahead
    STALE = 16  # decisions: an arm whose last step is older is measured again (a burst) before it takes over

    def __init__(self, arms: Sequence[str], seed: "_Arms | None" = None):
        self.arms = tuple(arms)
        # tokens measured, tokens predicted, seconds measured, seconds predicted, steps (decayed)
        self.figures = {a: [0.0, 0.0, 0.0, 0.0, 0.0] for a in arms}
        # tokens committed and expected (decayed by TOKEN_DECAY: over many more steps)
        self.tokens = {a: [0.0, 0.0] for a in arms}
        # its steps' seconds per token of context (the profile's) times their context, those
        # seconds per token, and their weight (decayed as `figures`)
        self.context = {a: [0.0, 0.0, 0.0] for a in arms}
        self.steps = 0  # decisions made
        self.current = "spec"
        self.burst_left = 0
        self.exploring: str | None = None  # the arm of the running exploration burst
        self.interval = {a: self.EXPLORE_EVERY for a in arms}
        self.rates: dict[str, float] = {}  # the arms' ratings at the last decision
        self.coasted = 0  # steps run without a decision since the last one
        self.lease, self.lease_arm = 0, "plain"  # further steps `coast` returns lease_arm unchecked
        self.deferred: set[str] = set()  # arms whose first look was put off (the model rates them far behind)
        self.own: set[str] = set()  # arms with steps of their own here (the others: a neighbour's figures)
        self.lead_rate = 0.0  # the best arm's rating at the last decision (tokens/s)
        self.look_cost: dict[str, float] = {}  # arm -> seconds its last burst cost against the leader
        self.seen: dict[str, int] = {}  # arm -> `steps` at its last recorded step (or its last confirming burst)
        self._spent: dict[str, float] = {}  # arm -> seconds the running burst has cost so far
        if seed is not None:  # a neighbour's figures, at the weight of one step each, its intervals and costs
            for a, f in seed.figures.items():
                if f[4] > 0:
                    self.figures[a] = _one_step(f)
                    self.context[a] = _one_step(seed.context[a])
            # its committed / expected tokens as a prior (TOKEN_PRIOR of the neighbour's weight),
            # which this batch size's own steps add to: a ratio of tokens, not of time
            self.tokens = {a: [v * self.TOKEN_PRIOR for v in t] for a, t in seed.tokens.items()}
            self.interval = dict(seed.interval)
            self.look_cost = dict(seed.look_cost)
        # an arm's first look here comes within FIRST_LOOK steps whatever the neighbour's interval:
        # the neighbour's ratios carry the model's errors at that batch size, not this one's (on the
        # EPYC, code-hard at 8 rows ran fixed speculation 3 rounds long at 0.97x plain's rate, the
        # plain arm's interval inherited from 2 rows, where it had lost, never due); the intervals
        # after it follow the neighbour's
        self.due = {a: min(i, self.FIRST_LOOK) for a, i in self.interval.items()}

    def rating(self, arm: str, pred: tuple[float, ...]) -> float:
        """Committed tokens per second: measured over the arm's recent steps (decayed), the catch-up
        that running it now would start with added; an arm with only a neighbouring batch size's
        figures (`seed`), the model's figures corrected by that neighbour's measured / predicted
        ratios; an arm never run, the model's figures."""
        _, tok_p, sec_m, sec_p, n = self.figures[arm]
        expected, seconds, catch_up, *now = pred
        got, meant = self.tokens[arm]
        accuracy = got / meant if meant > 0 else 1.0  # committed / expected tokens, over many steps
        if arm in self.own and sec_m > 0:
            expected, seconds = accuracy * tok_p / n, sec_m / n
            c_sum, slope, c_n = self.context[arm]
            if now and c_n > 0:  # its steps as if at the contexts of now: a step's time grows with
                # them (~15% over a request at 16 rows of code-easy), and two arms' figures are of
                # steps taken at different times; by the profile's seconds per token of context of
                # the arm's own steps (this step's lengths are not the arm's steps')
                seconds = max(0.0, seconds + (slope * now[0] - c_sum) / c_n)
        elif n > 0 and sec_p > 0:  # a neighbour's: its rates belong to another batch size,
            expected *= accuracy  # its ratios to the model's figures carry over
            seconds *= sec_m / sec_p
        return expected / max(seconds + catch_up, 1e-12)

    def affordable(self, arm: str, credit: float, cap: float = math.inf) -> bool:
        """The exploration budget covers a burst of `arm` now: what its last burst cost, or the
        credit's cap for a look dearer than that (it leaves the credit in debt, repaid before the
        next look: the budget holds on average). An arm with no steps of its own at this batch size
        is looked at whatever the credit: its first look here is what measures it (in debt from
        looks elsewhere, 8 rows of grounded ran plain ~80 steps at 0.8x fixed speculation's rate,
        "full" rated there by a pessimistic model, unmeasured)."""
        if arm not in self.own:
            return True
        return credit >= min(self.look_cost.get(arm, 0.0), cap)

    def spend(self, arm: str, seconds: float) -> None:
        """A step of the running burst of `arm` cost `seconds` against the leading arm."""
        self._spent[arm] = self._spent.get(arm, 0.0) + seconds

    def coast(self, credit: float = math.inf, cap: float = math.inf, idle: bool = False,
              full: bool = False) -> str | None:
        """The arm to run again without planning ("plain" or "full"), or None: it led every other
        arm by more than COAST at the last decision, at most COAST_STEPS steps ago (FAR_COAST_STEPS
        when it led by more than 1 / FAR); it is not exploring and no other arm's turn is due (and
        affordable). (A request joining or leaving within the bucket waits at most that many steps
        for a decision that sees it.) Only a leader with steps of its own at this batch size coasts:
        a lead that is the model's (a new batch size rated by a neighbour's ratios) is measured
        first (at 8 rows on code-hard, a model-rated "full" coasted 37 steps at 0.5x plain's rate).
        `idle`: the last plan drafted for no row, so a "spec" step is a plain one: "plain" and
        "spec" are then one arm, which coasts while it leads "full" (a useless drafter, a load
        where nothing pays: the plan's Python work, ~0.5 ms a step at 16 rows, is skipped).
        `full`: the last plan drafted all it may for every row, so a "spec" step is a "full" one
        (admission aside): "spec" and "full" are then one arm, which coasts as "full" while it
        leads "plain" (a load where every proposal pays: the plan's and admission's Python work
        and the bursts of "spec", which cannot do better there, are skipped).
        Once it coasts, the steps before its limit or the next rival's turn coast without these
        checks (`lease`: nothing they read changes meanwhile, `choose` ends it)."""
        if self.lease > 0:
            self.lease -= 1
            self.steps += 1
            self.coasted += 1
            return self.lease_arm
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
        lead = self.rates.get(current, 0.0) / max(max(self.rates.get(a, 0.0) for a in rivals), 1e-12)
        limit = self.COAST_STEPS if lead * self.FAR < 1 else self.FAR_COAST_STEPS
        if not self._keeps(current, rivals) or self.coasted >= limit:
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

    def _keeps(self, current: str, rivals) -> bool:
        """`choose` would keep `current` on the last decision's ratings, whatever a rival's look:
        it leads by COAST, or no rival passes it by the margin `choose` asks of that rival (SWITCH
        across drafting and plain, PLAN_EDGE for "spec" over "full"). At 32 rows of code-easy,
        plain decoding led fixed speculation by 8%, under COAST: every step ran the plan (~1 ms
        of Python, 7% of a step) to keep plain decoding (goodput 0.94x `none`)."""
        rate = self.rates.get(current, 0.0)
        if rate >= self.COAST * max(self.rates.get(a, 0.0) for a in rivals):
            return True
        for a in rivals:
            if (a == "plain") != (current == "plain"):
                margin = self.SWITCH
            elif current == "full" and a == "spec":
                margin = self.PLAN_EDGE
            else:
                return False
            if rate * margin < self.rates.get(a, 0.0):
                return False
        return True

    def choose(self, pred: dict[str, tuple[float, ...]], credit: float = math.inf,
               cap: float = math.inf, last: str | None = None) -> str:
        self.steps += 1
        self.coasted = 0
        self.lease = 0
        rate = {a: self.rating(a, pred[a]) for a in self.arms}
        if self.burst_left > 0:
            self.burst_left -= 1
            return self.current
        if self.exploring is not None:  # a burst has ended: when to look at that arm again
            arm, self.exploring = self.exploring, None
            self.look_cost[arm] = max(0.0, self._spent.pop(arm, 0.0))
            others = max(rate[a] for a in self.arms if a != arm)
            if rate[arm] * self.MARGIN <= others:  # not clearly ahead: look later (far behind: much later)
                grow = 4 if rate[arm] < self.FAR * others else 2
                self.interval[arm] = min(self.MAX_EXPLORE_EVERY, grow * self.interval[arm])
            else:  # clearly ahead: it leads now, and the arms it passed are looked at again soon
                self.interval[arm] = self.EXPLORE_EVERY
            self.due[arm] = self.steps + self.interval[arm]
        best = max(self.arms, key=lambda a: rate[a])
        if best == "spec" and "full" in rate and rate["full"] * self.PLAN_EDGE >= rate["spec"]:
            best = "full"  # the plan must beat fixed speculation clearly: their rates are noisy estimates
        if last in rate and last != best and (last == "plain") != (best == "plain") \
                and rate[last] * self.SWITCH >= rate[best]:
            best = last  # between drafting and not, the step before's side unless the other is clearly ahead
        if last in rate and best != last and best in self.own and self.steps - self.seen.get(best, 0) > self.STALE:
            # its lead is of steps taken a while ago (another machine speed, the rows' shorter
            # contexts): measured again, beside the running arm's recent steps, before it takes over
            self.seen[best] = self.steps  # (once per STALE steps: a "spec" that plans nothing records as plain)
            self.rates, self.lead_rate = rate, rate[last]
            return self._burst(best)
        self.rates = rate
        self.lead_rate = rate[best]
        for arm in self.arms:
            if arm != best and self.steps >= self.due[arm] and self.affordable(arm, credit, cap):
                if self.figures[arm][4] == 0 and self.rating(arm, pred[arm][:2] + (0.0,)) < self.FAR * rate[best] \
                        and arm not in self.deferred:
                    # never run, and the model puts it far behind (its catch-up aside): its first look waits longer
                    self.deferred.add(arm)
                    self.interval[arm] = min(self.MAX_EXPLORE_EVERY, 4 * self.interval[arm])
                    self.due[arm] = self.steps + self.interval[arm]
                    continue
                return self._burst(arm)
        self.current = best
        return best

    def _burst(self, arm: str) -> str:
        self.current, self.exploring, self.burst_left = arm, arm, self.BURST - 1
        f = self.figures[arm]
        if arm in self.own and f[4] > 1:  # the burst's steps rate it, its older ones at one step's weight
            self.figures[arm] = _one_step(f)
            self.context[arm] = _one_step(self.context[arm])
        return arm

    def record(self, arm: str, committed: float, expected: float, seconds: float, predicted: float,
               switched: bool, context: tuple[float, float] | None = None) -> None:
        """A step of `arm`; `context`: its mean context and the profile's seconds per token of it."""
        if switched:  # a switch of sides: its cost is not the arm's (a burst's other steps rate it)
            return
        self.seen[arm] = self.steps
        if arm not in self.own:  # its first step here replaces the neighbour's figures
            self.own.add(arm)
            self.figures[arm] = [0.0] * 5
            self.context[arm] = [0.0, 0.0, 0.0]
        f, d = self.figures[arm], self.DECAY
        for i, v in enumerate((committed, expected, seconds, predicted, 1.0)):
            f[i] = f[i] * d + v
        if context is not None:
            c, (ctx, slope) = self.context[arm], context
            c[0], c[1], c[2] = c[0] * d + slope * ctx, c[1] * d + slope, c[2] * d + 1.0
        t, d = self.tokens[arm], self.TOKEN_DECAY
        t[0], t[1] = t[0] * d + committed, t[1] * d + expected
