"""How long a suffix draft is: the length that maximises the step's expected committed tokens per second.

A verified proposal costs a row of the target's forward whether it is accepted or not, and the
tokens after the first rejection are never tested. So for the rows of a step, with
G_{i,j} = prod_{l <= j} a_{i,l} the probability that proposals 1..j of row i are all accepted,

    maximise  (B + sum_i sum_{j <= L_i} G_{i,j}) / seconds(B, B + sum_i L_i)

(B rows each commit at least one token; seconds: the step's cost at B rows and that many tokens fed
to the target). `best_lengths` solves it by adding candidate positions in decreasing order of
their gain (a row's gains fall along it, so every row keeps a prefix) and keeping the best prefix
of that order: exact for a cost linear in tokens.

a_{i,l}, the probability that proposal l is accepted given that the ones before it were, comes from
`AcceptanceTable`: per bucket of the draft's match length m and position l, a decayed count of
tested / accepted proposals with a weak prior, the index's own estimate (proposers/suffix.py:
f_l (1 - 1/(m + l))). Only tested proposals count: those up to and including the first rejected
one among the verified (a proposal after a rejection, or one the policy did not verify, says
nothing). Both inputs are functions of the past (committed history, earlier verifications), so
the length, like the draft, is causal.

The step's seconds come from the engine (`StepCosted.set_step_cost`): its measured steps fitted in
rows and tokens (policies/cost.py's `OnlineCost` over an empty profile); before any step is
measured the cost is flat and every drafted proposal is kept.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Callable, Sequence

# lower bounds of the match-length buckets: short matches are guesses, long ones copies
MATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)
PRIOR_WEIGHT = 2.0  # observations the prior is worth
DECAY = 0.999  # per observation: the table follows drift slowly


def match_bucket(m: int) -> int:
    return max(0, bisect_right(MATCH_BUCKETS, m) - 1)


class AcceptanceTable:
    """P(proposal l accepted | proposals 1..l-1 accepted) by (match-length bucket, l), learned from verified drafts."""

    def __init__(self):
        self.cells: dict[tuple[int, int], list[float]] = {}  # (bucket, position) -> [accepted, tested], decayed

    def rate(self, m: int, position: int, prior: float) -> float:
        """The calibrated rate of proposal `position` (1-based) of a draft that matched m tokens;
        `prior` (the index's estimate) before any observation, pulled towards what was measured."""
        acc, n = self.cells.get((match_bucket(m), position), (0.0, 0.0))
        return min(0.999, max(0.0, (acc + PRIOR_WEIGHT * prior) / (n + PRIOR_WEIGHT)))

    def gains(self, m: int, priors: Sequence[float]) -> list[float]:
        """G_j = prod_{l <= j} a_l for a draft of len(priors) proposals (non-increasing)."""
        out, run = [], 1.0
        for pos, p in enumerate(priors, 1):
            run *= self.rate(m, pos, p)
            out.append(run)
        return out

    def observe_one(self, m: int, position: int, accepted: bool) -> None:
        """One tested proposal at `position` of a draft of match length m (a tree's node at that depth)."""
        cell = self.cells.setdefault((match_bucket(m), position), [0.0, 0.0])
        cell[0] = cell[0] * DECAY + (1.0 if accepted else 0.0)
        cell[1] = cell[1] * DECAY + 1.0

    def observe(self, m: int, num_verified: int, num_accepted: int) -> None:
        """A verified draft of match length m: proposals 1..num_accepted accepted, then (when
        num_verified > num_accepted) one rejected; the rest were never tested."""
        for pos in range(1, min(num_verified, num_accepted + 1) + 1):
            self.observe_one(m, pos, pos <= num_accepted)


def best_lengths(gains: Sequence[Sequence[float]], seconds: Callable[[int], float]) -> list[int]:
    """The number of proposals each row keeps: `gains[i][j]` = G_{i,j+1} (non-increasing along a
    row), `seconds(T)` the step's cost when T tokens are fed (B of them the rows' own)."""
    b = len(gains)
    order = sorted(((g, j, i) for i, row in enumerate(gains) for j, g in enumerate(row)), key=lambda t: (-t[0], t[1], t[2]))
    expected, tokens = float(b), b
    best, best_n = expected / max(seconds(tokens), 1e-12), 0
    for n, (g, _, _) in enumerate(order, 1):
        expected += g
        tokens += 1
        value = expected / max(seconds(tokens), 1e-12)
        if value > best:
            best, best_n = value, n
    out = [0] * b
    for _, j, i in order[:best_n]:
        out[i] = max(out[i], j + 1)
    return out
