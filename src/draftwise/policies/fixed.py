"""`fixed`: draft the scheduler's cap (k, or less near max_tokens / the context end) and verify
every proposal: the behaviour of plain speculative decoding."""
from __future__ import annotations

from .base import StatelessPolicy, register_policy


@register_policy("fixed")
class FixedPolicy(StatelessPolicy):
    def __init__(self, **_):
        pass

    def plan(self, seqs, max_draft):
        return list(max_draft)

    def admit(self, seqs, blocks, draft_seconds):
        return [len(b.token_ids) for b in blocks]
