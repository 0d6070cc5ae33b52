"""Prompt lookup (n-gram) proposer: no model and no distribution.

Find the most recent earlier occurrence of the last n tokens of prompt + output (n from
`max_n` down to `min_n`) and propose the tokens that followed it. The proposal depends only on
committed history, so it cannot bias the output; q is a point mass (`probs=None`).

A structured-output sequence is proposed token by token through a fork of its grammar matcher:
where the grammar allows exactly one token that token is proposed (from the `num_forced` budget
first, then from `num_draft`), otherwise the n-gram's next token; the block ends at the first
token the grammar forbids (verification would reject it).
"""
from __future__ import annotations

import numpy as np

from .base import DraftBlock, register_proposer


def ngram_lookup(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    L = len(tokens)
    if k <= 0 or L < 2:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        pattern = arr[L - n :]
        # windows starting at i in [0, L-n-1) so the match is strictly earlier than the suffix
        starts = np.nonzero(arr[: L - n] == pattern[0])[0]
        for i in starts[::-1]:
            if i + n < L and np.array_equal(arr[i : i + n], pattern):
                follow = arr[i + n : i + n + k]
                if len(follow):
                    return follow.tolist()
    return []


@register_proposer("ngram")
class NgramProposer:
    kv = None
    needs_draft_model = False

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1, **_):
        max_n, min_n = ngram_max, ngram_min
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs, num_draft, num_forced=None):
        forced = num_forced or [0] * len(seqs)
        return [DraftBlock(self._lookup(s, n, f), None) for s, n, f in zip(seqs, num_draft, forced)]

    def _lookup(self, seq, n: int, f: int = 0) -> list[int]:
        grammar = getattr(seq, "grammar", None)
        if grammar is None or n <= 0:
            return ngram_lookup(seq.all_ids, n, self.max_n, self.min_n)
        cursor, history, block = grammar.cursor(), seq.all_ids, []
        while n > 0:
            nxt = cursor.forced_tokens(1)
            if nxt and f > 0:
                f -= 1
            else:
                n -= 1
                nxt = nxt or ngram_lookup(history + block, 1, self.max_n, self.min_n)
            if not nxt or not cursor.accept(nxt[0]):
                break
            block.append(nxt[0])
        return block

    def postprocess(self, seq, block, num_accepted, num_tokens_before):
        pass
