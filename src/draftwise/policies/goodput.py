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
  drafts little or nothing. A row that has not verified for `probe_every` steps drafts and
  verifies one proposal (a probe: its estimate can recover); so does one row of the batch when
  no row has verified for `probe_every` steps (the engine-wide estimate, which new requests start
  from, can recover too). A probe that accepts nothing doubles that interval (up to
  `max_probe_every`); one that accepts resets it. The optimum's value, lambda
  (expected committed tokens per second of the planned step), is kept for `admit`.
- `admit` (after drafting) keeps proposal j of row i while its gain prod_{m<=j} a_{i,m}, now from
  the confidences of q_1..q_j, pays for its marginal verification time at the planned rate:
  gain >= lambda * dcost/dtoken. This is the optimality condition of the ratio for a cost linear
  in tokens, and it is causal by construction: the decision on proposal j reads q_1..q_j (through
  their confidences) and plan-time figures, never x_j nor anything drafted after it (a rule that
  picked the best prefix from all the row's confidences would read q_{j+1}, a function of x_j).

A measured check on top (`_choose_mode`): per batch size (powers of two), the policy keeps
decayed committed-tokens-per-second figures of three arms: the steps it ran as planned ("spec"),
steps where every row drafted and verified all it may, as the fixed policy does ("full"), and
steps it ran without verifying ("plain"); it runs the best, trying another on 1 step in 16 to 64
(more often when the best two are close; "full" is tried only there, never in the warm-up:
where the plan drafts little it can cost several plain steps; the choice uses its own random numbers and the history
only: causal, and "full" admits every proposal, reading none). A profile that is off
(measured on a loaded machine, or missing the step's Python work) then costs at most the
exploration, not the operating point.

`choose_lengths` adds candidate positions in decreasing order of their gain (a row's gains
decrease along it, so every row keeps a prefix) and keeps the best prefix of that order: exact
for a cost linear in tokens, and it accounts for the jump of a new drafter step.
"""
from __future__ import annotations

import math
import random
from typing import Callable, Sequence

from .base import causal_lengths, register_policy
from .calibration import Calibration, RequestEstimate
from .cost import CostModel, OnlineCost


def choose_lengths(
    gains: Sequence[Sequence[float]],  # [B][<= K] prod_{m<=j} a_{i,m}, non-increasing along a row
    step_seconds: Callable[[int], float],  # total tokens fed -> seconds of the target forward (+ fixed costs)
    draft_step_seconds: Callable[[int], float] | None = None,  # rows in a drafter step -> seconds
    minimum: Sequence[int] | None = None,  # [B] lengths that must be kept (probes)
) -> tuple[list[int], float]:  # lengths [B], the objective's value (expected tokens per second)
    b = len(gains)
    order = sorted(((g, j, i) for i, row in enumerate(gains) for j, g in enumerate(row)), key=lambda t: (-t[0], t[1]))
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


@register_policy("goodput")
class GoodputPolicy:
    needs_cost_model = True
    needs_confidence = True
    probe_every = 32
    ARMS = ("spec", "full", "plain")  # planned lengths, every row its maximum (fixed k), no drafting
    max_probe_every = 512
    arm_decay = 0.8  # per step of that arm: the figures follow the last ~5 of its steps

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
        # probe intervals: doubled after a probe that accepted nothing (up to max_probe_every), back
        # to probe_every after one that accepted: a useless drafter costs ever fewer probes
        self._probe_interval: dict[int, int] = {}  # seq_id -> steps
        self._engine_probe_interval = self.probe_every
        self._arms: dict[int, dict[str, list[float]]] = {}  # batch bucket -> arm -> [tokens, seconds, steps]
        self._mode = "spec"  # this step's arm
        self._bucket = 0
        self._committed = [0, 0]  # this step: tokens committed and rows seen by `observe`
        self._rng = random.Random(0)  # exploration only: independent of every proposal

    def _context(self, seqs) -> float:
        return sum(s.num_tokens for s in seqs) / max(1, len(seqs))

    def plan(self, seqs, max_draft):
        b, ctx = len(seqs), self._context(seqs)
        cal = self.calibration
        gains, probes = [], []
        for s, m in zip(seqs, max_draft):
            row, g = [], 1.0
            for a in cal.position_rates(s.seq_id, m):
                g *= a
                row.append(g)
            gains.append(row)
            r = cal.requests.get(s.seq_id)
            every = self._probe_interval.get(s.seq_id, self.probe_every)
            probes.append(1 if m and r is not None and r.steps_without_verifying >= every else 0)
        if self._idle_steps >= self._engine_probe_interval and not any(probes):  # engine-wide probe: one row
            i = next((i for i, m in enumerate(max_draft) if m), None)
            if i is not None:
                probes[i] = 1
        self._probes = {s.seq_id for s, p in zip(seqs, probes) if p}
        draft = (lambda n: self.model.draft_step_seconds(n, ctx)) if self.has_draft_model else None
        lengths, self._rate = choose_lengths(gains, lambda t: self.model.step_seconds(b, t, ctx), draft, probes)
        self._bucket = b.bit_length()
        if any(n > p for n, p in zip(lengths, probes)):
            self._mode = self._choose_mode(self._bucket)  # "plain": only the probes verify (they also
            # keep the drafter's catch-up short for the steps that speculate again)
        else:
            self._mode = "plain"  # the plan drafts nothing: only the probes verify
        if self._mode == "plain":
            self._rate = math.inf
            lengths = [min(n, p) for n, p in zip(lengths, probes)]
        elif self._mode == "full":  # every row drafts and verifies all it may: fixed speculation
            self._rate = 0.0
            lengths = list(max_draft)
        return lengths

    def _arms_of(self, bucket: int) -> dict[str, list[float]]:
        return self._arms.setdefault(bucket, {arm: [0.0, 0.0, 0.0] for arm in self.ARMS})

    def _choose_mode(self, bucket: int) -> str:
        arms = self._arms_of(bucket)
        for arm in ("spec", "plain"):
            if arms[arm][2] < 3:  # as planned and plain measured a few times first
                return arm
        # "full" is only tried when exploring (it can cost several plain steps where the plan
        # drafts little): never measured, it ranks last
        rate = {a: v[0] / max(v[1], 1e-12) if v[2] > 0 else -1.0 for a, v in arms.items()}
        ranked = sorted(self.ARMS, key=lambda a: -rate[a])
        best, second = ranked[0], ranked[1]
        margin = rate[best] / max(rate[second], 1e-12)
        explore = 1 / 16 if margin < 1.2 else 1 / 32 if margin < 1.5 else 1 / 64  # close arms: look more often
        if self._rng.random() < explore:
            return self._rng.choice(ranked[1:])
        return best

    def admit(self, seqs, blocks, draft_seconds):
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
        self._committed[0] += num_accepted + 1
        self._committed[1] += 1
        r = self.calibration.requests.setdefault(seq.seq_id, RequestEstimate())
        if num_verified and seq.seq_id in self._probes:
            every = self._probe_interval.get(seq.seq_id, self.probe_every)
            every = self.probe_every if num_accepted else min(self.max_probe_every, 2 * every)
            self._probe_interval[seq.seq_id] = every
            if self._idle_steps >= self._engine_probe_interval:  # it was the engine-wide probe too
                self._engine_probe_interval = (self.probe_every if num_accepted
                                               else min(self.max_probe_every, 2 * self._engine_probe_interval))
        elif num_verified and num_accepted:
            self._probe_interval.pop(seq.seq_id, None)
            self._engine_probe_interval = self.probe_every
        if num_verified:
            r.steps_without_verifying = 0
            conf = (block.confidence or [None] * len(block.token_ids))[:num_verified]
            self.calibration.observe(seq.seq_id, seq.params.is_greedy, conf, num_accepted)
        else:
            r.steps_without_verifying += 1

    def forget(self, seq_id):
        self.calibration.forget(seq_id)
        self._probe_interval.pop(seq_id, None)

    def observe_step(self, num_seqs, num_tokens, context, draft_lengths, seconds):
        self._idle_steps = 0 if num_tokens > num_seqs else self._idle_steps + 1
        committed = self._committed[0] + max(0, num_seqs - self._committed[1])  # rows not observed: 1 each
        self._committed = [0, 0]
        # the arms count every step, a drafter's catch-up after plain steps included: it is what
        # switching costs (leaving those steps out let a loaded batch never measure speculation)
        arm = self._arms_of(self._bucket)[self._mode]
        d = self.arm_decay
        arm[0], arm[1], arm[2] = arm[0] * d + committed, arm[1] * d + seconds, arm[2] * d + 1.0
        lengths = draft_lengths if self.has_draft_model else ()
        predicted = self.model.step_seconds(num_seqs, num_tokens, context, lengths)
        profile_only = self.model.profile_seconds(num_seqs, num_tokens, context, lengths)
        self.model.observe(num_seqs, num_tokens, context, lengths, seconds)
        return predicted, profile_only
