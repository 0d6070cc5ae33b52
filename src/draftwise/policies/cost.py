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
