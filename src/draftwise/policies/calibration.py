"""Acceptance estimates for the goodput policy, calibrated online from observed acceptances.

a(conf) = the probability that a proposal is accepted given that every proposal before it was,
as a function of the drafter's confidence at its position (max_x q_j(x); n-gram lookup's from its
match length; greedy and sampled rows apart: their acceptance rules differ). Engine-wide: 20
confidence bins (one more for drafters without a confidence), each a decayed count of accepted / observed proposals
with a weak prior (acceptance = confidence). Per request: a correction ratio (observed / predicted
acceptances over its recent rounds) and its recent acceptance rate (what `plan` uses before
anything is drafted). Only the proposals up to the first rejection are observations: the others
were never tested.
"""
from __future__ import annotations

from dataclasses import dataclass

NUM_BINS = 20
UNKNOWN = NUM_BINS  # the bin of proposals without a confidence
PRIOR_WEIGHT = 2.0
ENGINE_DECAY = 0.999  # per observation: the engine-wide tables follow drift slowly
REQUEST_DECAY = 0.8  # per round: a request's estimates follow its last ~5 rounds


def _bin(conf: float | None) -> int:
    if conf is None or conf != conf:  # None or NaN
        return UNKNOWN
    return min(NUM_BINS - 1, max(0, int(conf * NUM_BINS)))


@dataclass
class RequestEstimate:
    observed: float = 0.0  # decayed count of tested proposals
    accepted: float = 0.0  # ... of which accepted
    predicted: float = 0.0  # ... the engine-wide prediction of accepted
    last_verified: int = 0  # the policy's decode step at which it last verified a proposal (or was first planned): for probing


class Calibration:
    def __init__(self):
        centers = [(b + 0.5) / NUM_BINS for b in range(NUM_BINS)] + [0.5]
        # [greedy?][bin] -> [accepted, observed]
        self.tables = [[[c * PRIOR_WEIGHT, PRIOR_WEIGHT] for c in centers] for _ in range(2)]
        self.total = [0.5 * PRIOR_WEIGHT, PRIOR_WEIGHT]  # engine-wide acceptance, all bins
        self.by_position: list[list[float]] = []  # [position] -> [accepted, tested]: conditional acceptance
        self.requests: dict[int, RequestEstimate] = {}

    def engine_rate(self, greedy: bool, conf: float | None) -> float:
        acc, n = self.tables[int(greedy)][_bin(conf)]
        return acc / n

    def rate(self, seq_id: int, greedy: bool, conf: float | None) -> float:
        """a_{i,j}: the engine-wide rate at this confidence times the request's correction."""
        r = self.requests.get(seq_id)
        ratio = 1.0 if r is None else min(4.0, max(0.25, (r.accepted + 1.0) / (r.predicted + 1.0)))
        return min(0.995, self.engine_rate(greedy, conf) * ratio)

    def prior_rate(self, seq_id: int) -> float:
        """The request's recent acceptance rate (engine-wide rate as the prior), before drafting."""
        r = self.requests.get(seq_id)
        g = self.total[0] / self.total[1]
        if r is None:
            return g
        return (r.accepted + PRIOR_WEIGHT * g) / (r.observed + PRIOR_WEIGHT)

    def position_rates(self, seq_id: int, n: int) -> list[float]:
        """Before drafting: the acceptance of proposals 1..n given the earlier ones were accepted,
        engine-wide by position (acceptance usually rises along a block: a draft that got the
        first tokens right is on track), scaled by the request's recent rate against the
        engine's."""
        g = self.total[0] / self.total[1]
        scale = self.prior_rate(seq_id) / g if g > 0 else 0.0
        out = []
        for j in range(n):
            acc, tested = self.by_position[j] if j < len(self.by_position) else (0.0, 0.0)
            rate = (acc + PRIOR_WEIGHT * g) / (tested + PRIOR_WEIGHT)
            out.append(min(0.995, rate * scale))
        return out

    def observe(self, seq_id: int, greedy: bool, confidences: list[float | None], num_accepted: int) -> None:
        """One round's tested proposals: confidences[:num_accepted] accepted, then one rejected
        (when len(confidences) > num_accepted)."""
        r = self._new_round(seq_id)
        for j, conf in enumerate(confidences[: num_accepted + 1]):
            ok = 1.0 if j < num_accepted else 0.0
            cell = self.tables[int(greedy)][_bin(conf)]
            r.predicted += cell[0] / cell[1]
            cell[0] = cell[0] * ENGINE_DECAY + ok
            cell[1] = cell[1] * ENGINE_DECAY + 1.0
            self._tally(r, j, ok)

    def observe_unverified(self, seq_id: int, expected: float) -> None:
        """A round drafted but verified none of its proposals (an admission rule cut them all):
        nothing was tested, so the confidence bins learn nothing, but the figures the plan reads
        before drafting (first position, the request's and the engine's rates) take the first
        proposal's calibrated rate `expected` as a fractional observation. Without it a plan whose
        proposals admission always cuts keeps drafting on estimates that never move."""
        r = self._new_round(seq_id)
        r.predicted += expected
        self._tally(r, 0, expected)

    def _new_round(self, seq_id: int) -> RequestEstimate:
        """The request's estimate, its decayed counts aged by one round."""
        r = self.requests.setdefault(seq_id, RequestEstimate())
        r.observed *= REQUEST_DECAY
        r.accepted *= REQUEST_DECAY
        r.predicted *= REQUEST_DECAY
        return r

    def _tally(self, r: RequestEstimate, j: int, ok: float) -> None:
        """One tested proposal at position j (ok: accepted, or a fractional expectation): the
        engine-wide rate, the position's, the request's."""
        self.total[0] = self.total[0] * ENGINE_DECAY + ok
        self.total[1] = self.total[1] * ENGINE_DECAY + 1.0
        while len(self.by_position) <= j:
            self.by_position.append([0.0, 0.0])
        pos = self.by_position[j]
        pos[0], pos[1] = pos[0] * ENGINE_DECAY + ok, pos[1] * ENGINE_DECAY + 1.0
        r.observed += 1.0
        r.accepted += ok

    def forget(self, seq_id: int) -> None:
        self.requests.pop(seq_id, None)
