"""`adaptive`: a per-request draft length from acceptance, the peers' heuristic (Hugging Face's
assisted generation "heuristic" schedule): after a round in which every proposal was accepted the
request's length grows by 2, otherwise it shrinks by 1 (never below 1, never above k). Every
drafted proposal is verified. Kept as the baseline the goodput policy must beat; it never stops
drafting, so a useless drafter still costs a drafter step per round."""
from __future__ import annotations

from .base import StatelessPolicy, register_policy


@register_policy("adaptive")
class AdaptivePolicy(StatelessPolicy):
    def __init__(self, k: int = 4, **_):
        self.k = k
        self.length: dict[int, int] = {}

    def plan(self, seqs, max_draft):
        return [min(m, self.length.get(s.seq_id, self.k)) for s, m in zip(seqs, max_draft)]

    def admit(self, seqs, blocks, draft_seconds):
        return [len(b.token_ids) for b in blocks]

    def observe(self, seq, block, num_verified, num_accepted):
        if num_verified == 0:
            return
        n = self.length.get(seq.seq_id, self.k)
        self.length[seq.seq_id] = min(self.k, n + 2) if num_accepted == num_verified else max(1, n - 1)

    def forget(self, seq_id):
        self.length.pop(seq_id, None)
