"""The cost model: predicted seconds of one target forward and one drafter step.

Fitted from a measured hardware profile (profile.py) by least squares; the goodput policy asks it
what a step would cost for a candidate choice of verification lengths:

    target_seconds(B, T, C) = t0 + t_seq * B + t_tok * T + t_ctx * B * C
    draft_seconds(B, C)     = d0 + d_seq * B + d_ctx * B * C         (one drafter step)

B = sequences in the forward, T = tokens fed in all (sum over sequences of 1 + verified
proposals), C = mean context length (keys each new token attends). A coefficient that the fit
makes negative is clamped to 0 (more work never predicts less time).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CostModel:
    target: tuple[float, float, float, float]  # (t0, t_seq, t_tok, t_ctx) seconds
    draft: tuple[float, float, float]  # (d0, d_seq, d_ctx) seconds, one drafter step

    def target_seconds(self, num_seqs: int, num_tokens: int, context: float = 0.0) -> float:
        t0, t_seq, t_tok, t_ctx = self.target
        return t0 + t_seq * num_seqs + t_tok * num_tokens + t_ctx * num_seqs * context

    def draft_seconds(self, num_seqs: int, context: float = 0.0) -> float:
        if num_seqs <= 0:
            return 0.0
        d0, d_seq, d_ctx = self.draft
        return d0 + d_seq * num_seqs + d_ctx * num_seqs * context

    def to_dict(self) -> dict:
        return {"target": list(self.target), "draft": list(self.draft)}

    @staticmethod
    def from_dict(d: dict) -> "CostModel":
        t, dr = d["target"], d["draft"]
        if len(t) != 4 or len(dr) != 3:
            raise ValueError(f"cost model: expected 4 target and 3 draft coefficients, got {len(t)} and {len(dr)}")
        return CostModel(tuple(float(x) for x in t), tuple(float(x) for x in dr))


class OnlineCost:
    """The profile's cost model plus what it misses, learned online from the engine's step times.

    A whole engine step also pays for work outside the two forwards (scheduling, processing the
    logits, verification, postprocess: Python work that grows with the rows B and the tokens T),
    and the machine's speed drifts. The residual (measured step - profile's prediction) of every
    step without prefill is fitted as e0 + e1 * B + e2 * T by exponentially weighted least
    squares (a small ridge keeps it near 0 until steps have been seen); `step_seconds` is the
    profile's prediction plus that residual. The goodput policy optimises against it.
    """

    DECAY = 0.98  # per observed step: the fit follows the last ~50 steps
    RIDGE = 1e-3

    def __init__(self, cost: CostModel):
        self.cost = cost
        self._a = [[0.0] * 3 for _ in range(3)]  # decayed X^T X
        self._y = [0.0] * 3  # decayed X^T r
        self._w = [0.0, 0.0, 0.0]

    @staticmethod
    def draft_lengths_seconds(cost: CostModel, lengths, context: float) -> float:
        """Drafter time for rows drafting `lengths` tokens: step j runs the rows drafting past j."""
        lengths = list(lengths)
        return sum(cost.draft_seconds(sum(n > j for n in lengths), context) for j in range(max(lengths, default=0)))

    def residual(self, num_seqs: int, num_tokens: int) -> float:
        e0, e1, e2 = self._w
        return e0 + e1 * num_seqs + e2 * num_tokens

    def profile_seconds(self, num_seqs: int, num_tokens: int, context: float, draft_lengths=()) -> float:
        return (self.draft_lengths_seconds(self.cost, draft_lengths, context)
                + self.cost.target_seconds(num_seqs, num_tokens, context))

    def step_seconds(self, num_seqs: int, num_tokens: int, context: float, draft_lengths=()) -> float:
        return self.profile_seconds(num_seqs, num_tokens, context, draft_lengths) + self.residual(num_seqs, num_tokens)

    def observe(self, num_seqs: int, num_tokens: int, context: float, draft_lengths, measured: float) -> None:
        r = measured - self.profile_seconds(num_seqs, num_tokens, context, draft_lengths)
        x = (1.0, float(num_seqs), float(num_tokens))
        for i in range(3):
            self._y[i] = self._y[i] * self.DECAY + x[i] * r
            for j in range(3):
                self._a[i][j] = self._a[i][j] * self.DECAY + x[i] * x[j]
        self._w = _solve3([[self._a[i][j] + (self.RIDGE if i == j else 0.0) for j in range(3)] for i in range(3)],
                          self._y)


def _solve3(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting on a 3x3 system (no numpy in the hot path)."""
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(3):
        p = max(range(c, 3), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-18:
            return [0.0, 0.0, 0.0]
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, 3):
            f = m[r][c] / m[c][c]
            for k in range(c, 4):
                m[r][k] -= f * m[c][k]
    out = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        out[r] = (m[r][3] - sum(m[r][k] * out[k] for k in range(r + 1, 3))) / m[r][r]
    return out
