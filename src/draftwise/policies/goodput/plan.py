"""The goodput policy's core: per request, per step, the verification lengths that maximise the
step's expected committed tokens per second, and the causal admission that follows from them.

    maximise  sum_i E_i(L_i) / (t_draft + cost(B, sum_i (1 + L_i)))
    E_i(L)  = 1 + sum_{j <= L} prod_{m <= j} a_{i,m}

a_{i,m}: the estimated acceptance of proposal m of row i given the earlier ones were accepted
(calibration.py); cost(.) and t_draft: the hardware profile's cost model plus what it misses of a
whole step, learned online (cost.py).

- `Planner.plan` (before drafting) solves it with a_{i,m} = the engine's conditional acceptance at
  position m scaled by the request's recent rate (`choose_lengths`). The drafting time is part of
  the objective (one drafter step per position, over the rows that draft that far; a row's first
  proposal also pays its drafter's catch-up, spread over the steps it serves), so a loaded step or
  a useless drafter drafts little or nothing. The optimum's value, lambda (expected committed
  tokens per second of the planned step), is kept for `admit`.
- Probes (`probe_rows`): while the plan drafts for some rows, a row it leaves out that has not
  verified for its interval drafts and verifies one proposal, so its estimate can recover; when
  the plan drafts for no row, only one row of the batch probes, when no row has verified for the
  engine-wide interval (the engine-wide estimate, which new requests start from, can recover too;
  per-row probes there would each pay the drafter's catch-up over the row's whole context). A
  probe that accepts nothing multiplies its interval by `probe_backoff` (up to `max_probe_every`),
  one that accepts resets it; the engine-wide one resets only while the measured check does not
  rate plain steps ahead of fixed speculation (there the load, not the estimate, stops drafting).
- A tree drafter sizes its trees by the same price (`row_price`, `StepHints.node_price`): a node
  is drafted while its path's estimated acceptance pays for its row (proposers/tree_budget.py), and
  `admit` keeps such a greedy tree whole.
- `admit` (after drafting, `admitted_lengths`) keeps proposal j of row i while its gain
  prod_{m<=j} a_{i,m}, now from the confidences of q_1..q_j, pays for its marginal verification
  time at the planned rate: gain >= lambda * dcost/dtoken. This is the optimality condition of the
  ratio for a cost linear in tokens, and it is causal by construction: the decision on proposal j
  reads q_1..q_j (through their confidences) and plan-time figures, never x_j nor anything drafted
  after it (a rule that picked the best prefix from all the row's confidences would read q_{j+1},
  a function of x_j).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ...proposers.base import DraftBlock, History
from ...proposers.draft_model import DraftModelProposer
from ..base import StepPrediction, StepTiming, causal_lengths
from ..calibration import Calibration, RequestEstimate
from ..cost import BlockCost, CostModel, OnlineCost
from .config import GoodputConfig

LONG_CATCH_UP = DraftModelProposer.LONG_CATCH_UP  # lags the proposer feeds in forwards of their own (timed apart)


def choose_lengths(
    gains: Sequence[Sequence[float]],  # [B][<= K] prod_{m<=j} a_{i,m}, non-increasing along a row
    step_seconds: Callable[[int], float],  # total tokens fed -> seconds of the target forward (+ fixed costs)
    draft_step_seconds: Callable[[int], float] | None = None,  # rows in a drafter step -> seconds
    minimum: Sequence[int] | None = None,  # [B] lengths that must be kept (probes)
    first_cost: Sequence[float] | None = None,  # [B] seconds a row's first proposal adds (its drafter catch-up)
    block: bool = False,  # the drafter drafts a row's whole block in one call: only its first position costs a step
) -> tuple[list[int], float]:  # lengths [B], the objective's value (expected tokens per second)
    """Candidate positions added in decreasing order of their gain (a row's gains decrease along
    it, so every row keeps a prefix), the best prefix of that order kept: exact for a cost linear
    in tokens, and it accounts for the jump of a new drafter step (`block`: of the one drafter call,
    `draft_step_seconds` of the rows that draft at all)."""
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
        if draft_step_seconds is not None and (j == 0 or not block):
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


def admitted_lengths(seqs: Sequence[History], blocks: Sequence[DraftBlock], calibration: Calibration,
                     threshold: float, probes: set[int]) -> list[int]:
    """The causal admission rule: proposal j of row i is verified while its gain prod_{m<=j} a_{i,m}
    (from the confidences of q_1..q_j) is at least `threshold` (lambda * dcost/dtoken), or it is
    the first proposal of a probing row. Reads q_j's confidence, never x_j."""
    gain = [1.0] * len(seqs)

    def keep(i: int, j: int, conf: float | None) -> bool:
        s = seqs[i]
        gain[i] *= calibration.rate(s.seq_id, s.params.is_greedy, conf)
        return gain[i] >= threshold or (j == 0 and s.seq_id in probes)

    lengths = causal_lengths(blocks, keep)
    # a greedy tree (point masses) was sized at drafting by the same price (`StepHints.node_price`)
    return [len(b.token_ids) if b.is_tree and b.drafting == "point" else n for b, n in zip(blocks, lengths)]


@dataclass
class StepPlan:
    """The optimiser's answer for one step, with what the measured check and the probes read."""

    lengths: list[int]  # [B] tokens to draft per row (probes not added)
    gains: list[list[float]]  # [B][max_draft[i]] prod_{m<=j} a_{i,m} before drafting
    due: list[int]  # [B] 1: the row's probe is due
    catch: list[float]  # [B] seconds a row's drafter catch-up adds per step it serves (amortised)
    lags: list[int]  # [B] tokens each row's drafter is behind
    context: float  # the rows' mean context


class Planner:
    """The plan, the probes and admission, with the estimates they read: the calibration (per
    request and engine-wide) and the cost model."""

    def __init__(self, config: GoodputConfig, cost: CostModel, has_draft_model: bool, block_drafter: bool = False):
        self.config = config
        self.model = OnlineCost(cost)  # the profile + what it misses of a whole step, learned online
        self.has_draft_model = has_draft_model
        # a drafter on the target's features (no profiled model: DSpark's block forward, EAGLE-3's
        # steps): its seconds a drafting round learned from the engine's measured drafting (`count_step`)
        self.block = BlockCost() if block_drafter and not has_draft_model else None
        self.calibration = Calibration()
        self.step = 0  # decode steps observed (a row's probe is due its interval after its last verification)
        self.unobserved_steps = 0  # steps of multi-step calls past their first since the cost model last learned
        self.idle_steps = 0  # steps since any row verified a proposal
        self.rate = 0.0  # the planned step's expected committed tokens per second (admission's price)
        self.probes: set[int] = set()  # seq_ids probing this step
        self.probe_interval: dict[int, int] = {}  # seq_id -> steps between its probes (absent: probe_every)
        self.engine_probe_interval = config.probe_every
        # seconds per token of the drafter's catch-up, learned from the long ones (timed by the
        # proposer); at first the profile's per-row cost of a drafter step
        self.catch_up_per_token = cost.draft[1] if cost.draft[1] > 0 else config.catch_up_per_token
        self.long_catch_up = 0  # tokens this step's long catch-ups feed

    @staticmethod
    def context(seqs: Sequence[History]) -> float:
        return sum(s.num_tokens for s in seqs) / max(1, len(seqs))

    def lags(self, seqs: Sequence[History]) -> list[int]:
        """Tokens each row's drafter cache is behind (fed before its first proposal; 0 for n-gram)."""
        if not self.has_draft_model:
            return [0] * len(seqs)
        return [max(0, s.num_tokens - getattr(s, "draft_computed", s.num_tokens)) for s in seqs]

    def horizon(self, seq: History, gains: Sequence[float]) -> float:
        """Steps a row's drafter catch-up is spread over: the steps the row has left (its tokens
        left over the tokens a step drafting all it may is expected to commit), up to
        `catch_up_horizon`: a catch-up serves the row's steps after it, few near its end."""
        out = getattr(seq, "output_ids", None)
        if out is None:
            return self.config.catch_up_horizon
        steps = (seq.params.max_tokens - len(out)) / (1.0 + sum(gains))
        return min(self.config.catch_up_horizon, max(1.0, steps))

    def plan(self, seqs: Sequence[History], max_draft: Sequence[int]) -> StepPlan:
        """The lengths that maximise the step's expected tokens per second (`rate` keeps the value)."""
        b, ctx = len(seqs), self.context(seqs)
        gains, due = self._gains(seqs, max_draft)
        draft = None
        if self.has_draft_model:
            per_rows = [self.model.draft_step_seconds(n, ctx) for n in range(b + 1)]  # rows in a drafter step
            draft = per_rows.__getitem__
        elif self.block is not None:
            draft = self.block.seconds
        # the drafter's catch-up before a row's first proposal (a new prompt, steps without
        # drafting), spread over the steps it serves: what starting costs
        lag = self.lags(seqs)
        catch = [(n - 1) * self.catch_up_per_token / self.horizon(s, row) if n > 1 else 0.0
                 for n, s, row in zip(lag, seqs, gains)]
        lengths, self.rate = choose_lengths(gains, self.model.tokens_seconds(b, ctx), draft, first_cost=catch,
                                            block=self.block is not None)
        return StepPlan(lengths, gains, due, catch, lag, ctx)

    def _gains(self, seqs: Sequence[History], max_draft: Sequence[int]) -> tuple[list[list[float]], list[int]]:
        """Per row, prod_{m<=j} a_{i,m} for j < max_draft before drafting, and whether its probe is due."""
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
                r = cal.requests[s.seq_id] = RequestEstimate(last_verified=self.step)
            every = self.probe_interval.get(s.seq_id, self.config.probe_every)
            due.append(1 if m and self.step - r.last_verified >= every else 0)
        return gains, due

    def probe_rows(self, seqs: Sequence[History], plan: StepPlan, max_draft: Sequence[int],
                   engine_probe_allowed: Callable[[], bool]) -> list[int]:
        """[B] 1: the row probes (`probes` holds their seq_ids). While the plan drafts, the rows
        whose probe is due; else at most one row, when no row has verified for the engine-wide
        interval and the measured check allows it (`engine_probe_allowed`, asked only then)."""
        if any(plan.lengths):
            self.engine_probe_interval = self.config.probe_every  # speculation pays: a later stop probes soon
            probes = plan.due
        else:
            probes = [0] * len(max_draft)
            i = next((i for i, m in enumerate(max_draft) if m), None)
            if self.idle_steps >= self.engine_probe_interval and i is not None and engine_probe_allowed():
                probes[i] = 1
        self.set_probes(seqs, probes)
        return probes

    def set_probes(self, seqs: Sequence[History], lengths: Sequence[int]) -> None:
        """The rows with a nonzero entry probe this step (admission keeps their first proposal)."""
        self.probes = {s.seq_id for s, n in zip(seqs, lengths) if n}

    def predict(self, plan: StepPlan, lengths: Sequence[int],
                every_accepted: bool = False) -> tuple[float, float, float, float, float]:
        """Expected committed tokens and seconds of a step drafting `lengths`: the estimates', the
        hardware profile's alone (fixed: the online residual moves, and ratios to a moving
        prediction would not compare), the drafting rows' catch-up (amortised), and the mean
        context with the profile's seconds per token of it (the arms move an arm's measured
        seconds to the contexts of now). `every_accepted`: the tokens' upper bound instead of
        the estimates' (b + every length)."""
        b, ctx = len(lengths), plan.context
        if every_accepted:
            expected = float(b + sum(lengths))
        else:
            expected = b + sum(sum(row[:n]) for row, n in zip(plan.gains, lengths))
        fed = b + sum(lengths)
        drafted = lengths if self.has_draft_model else ()
        seconds = self.model.profile_seconds(b, fed, ctx, drafted)
        return (expected, seconds, sum(c for c, n in zip(plan.catch, lengths) if n),
                ctx, self.model.context_slope(b, drafted))

    def catch_up_seconds(self, plan: StepPlan, lengths: Sequence[int]) -> float:
        """Seconds of the drafter's catch-up a step drafting `lengths` starts with, not amortised."""
        return sum(n - 1 for n, m in zip(plan.lags, lengths) if m and n > 1) * self.catch_up_per_token

    def count_catch_ups(self, lags: Sequence[int], lengths: Sequence[int]) -> None:
        """The tokens the proposer will feed in forwards of their own this step (`learn_catch_up`)."""
        self.long_catch_up = sum(n - 1 for n, m in zip(lags, lengths) if m and n > LONG_CATCH_UP)

    def row_price(self, seqs: Sequence[History]) -> float:
        """The expected tokens a verified row must add: its marginal seconds at the planned rate."""
        b, ctx = len(seqs), self.context(seqs)
        return self.rate * (self.model.step_seconds(b, b + 1, ctx) - self.model.step_seconds(b, b, ctx))

    def admit(self, seqs: Sequence[History], blocks: Sequence[DraftBlock]) -> list[int]:
        return admitted_lengths(seqs, blocks, self.calibration, self.row_price(seqs), self.probes)

    def observe(self, seq: History, block: DraftBlock, num_verified: int, num_accepted: int,
                calibrate: bool, plain_leads: Callable[[], bool]) -> None:
        """A row verified `num_verified` > 0 proposals: its probe clock restarts; unless
        `calibrate` is off, its probe interval and the estimates learn from it. `plain_leads`:
        the measured check rates plain steps at or above fixed speculation here (asked only
        after the engine-wide probe)."""
        r = self.calibration.requests.get(seq.seq_id)
        if r is None:
            r = self.calibration.requests[seq.seq_id] = RequestEstimate()
        r.last_verified = self.step
        if not calibrate:
            return
        if seq.seq_id in self.probes:
            self._after_probe(seq.seq_id, num_accepted, plain_leads)
        elif num_accepted:
            self.probe_interval.pop(seq.seq_id, None)
        conf = (block.confidence or [None] * len(block.token_ids))[:num_verified]
        self.calibration.observe(seq.seq_id, seq.params.is_greedy, conf, num_accepted)

    def _after_probe(self, seq_id: int, num_accepted: int, plain_leads: Callable[[], bool]) -> None:
        cfg = self.config
        every = self.probe_interval.get(seq_id, cfg.probe_every)
        every = cfg.probe_every if num_accepted else min(cfg.max_probe_every, cfg.probe_backoff * every)
        self.probe_interval[seq_id] = every
        if self.idle_steps >= self.engine_probe_interval:  # it was the engine-wide probe too
            if num_accepted and not plain_leads():  # the estimate stops drafting: probe soon
                self.engine_probe_interval = cfg.probe_every
            else:  # nothing accepted, or the load stops drafting whatever the estimate: wait longer
                # (only a plan that drafts again brings the wait back: `probe_rows`)
                self.engine_probe_interval = min(cfg.max_probe_every, cfg.probe_backoff * self.engine_probe_interval)

    def forget(self, seq_id: int) -> None:
        self.calibration.forget(seq_id)
        self.probe_interval.pop(seq_id, None)

    def count_step(self, timing: StepTiming) -> None:
        self.step += 1
        self.unobserved_steps += max(0, timing.num_steps - 1)
        self.idle_steps = 0 if timing.num_tokens > timing.num_seqs else self.idle_steps + 1
        if self.block is not None and timing.draft_seconds is not None and not timing.cold:
            rows = sum(1 for n in timing.draft_lengths if n)
            if rows:
                self.block.observe(rows, timing.draft_seconds)

    def learn_catch_up(self, catch_up_seconds: float) -> None:
        """The seconds per token of the drafter's long catch-ups, from the proposer's timing of them."""
        if catch_up_seconds > 0 and self.long_catch_up > 0:
            per = catch_up_seconds / self.long_catch_up
            # in log space: three catch-ups timed 50x slow (a cold first round) move the estimate
            # 6.7x, not 25x as a step in seconds would. An overrated catch-up stops the plan from
            # drafting after a pause, and only such restarts time it again: at 25x the dspark
            # policy at c=1 drafted in 40% of its steps for good, at 6.7x it recovered within 32
            # requests (benchmarks/cold_start_ab.py: the embedded pair, code-easy)
            if self.config.catch_up_log:
                self.catch_up_per_token *= (per / self.catch_up_per_token) ** self.config.catch_up_learning
            else:
                self.catch_up_per_token += self.config.catch_up_learning * (per - self.catch_up_per_token)

    def observe_cost(self, timing: StepTiming, lengths: list[int], profile: float) -> StepPrediction:
        """The cost model learns the decode step proper (the drafter's long catch-ups left out);
        returns what it and the profile alone predicted."""
        predicted = profile + self.model.residual(timing.num_seqs, timing.num_tokens, max(lengths, default=0))
        if self.config.learn_step_cost:
            # earlier steps fade by this one and by the steps multi-step calls ran since the last one
            # learned: once the plan stops drafting, a lone row's plain steps run several to a call,
            # unobserved, and drafting steps timed slow in a cold first round would price drafting
            # for good (benchmarks/cold_start_ab.py --slow steps)
            steps = 1 + self.unobserved_steps if self.config.cost_fade_by_steps else 1
            self.unobserved_steps = 0
            self.model.observe(timing.num_seqs, timing.num_tokens, timing.context, lengths,
                               timing.seconds - timing.catch_up_seconds, profile=profile, steps=steps)
        return StepPrediction(predicted, profile)
