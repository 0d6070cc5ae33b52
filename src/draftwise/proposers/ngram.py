"""Prompt lookup (n-gram) proposer: no model and no distribution.

Find the most recent earlier occurrence of the last n tokens of prompt + output (n from
`max_n` down to `min_n`) and propose the tokens that followed it. The proposal depends only on
committed history, so it cannot bias the output; q is a point mass (`probs=None`).

Confidence (for a verification policy that reads it, e.g. `goodput`): the proposal is a function
of the history, so any function of the history and the earlier proposals may say how far to trust
it (causal by construction). Proposal j's is 1 - 1/(m + j), m = how many tokens the chosen
earlier occurrence matches the suffix (extended past max_n, up to MATCH_CAP): proposal j
continues a match of m + j - 1 tokens once the ones before it are accepted. Measured on SmolLM2's
greedy replies to the chat workloads, the next token followed a match of 1 token 17-24% of the
time, of 2-4 tokens 50-77%, of 12 or more 97%: the longer the copy, the surer its next token.

A structured-output sequence is proposed token by token through a fork of its grammar matcher:
where the grammar allows exactly one token that token is proposed (from the `num_forced` budget
first, then from `num_draft`), otherwise the n-gram's next token; the block ends at the first
token the grammar forbids (verification would reject it).
"""
from __future__ import annotations

import numpy as np

from .base import DraftBlock, register_proposer


MATCH_CAP = 64  # the longest match length measured for the confidence


def ngram_lookup(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    return ngram_match(tokens, k, max_n, min_n)[0]


def ngram_match(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1) -> tuple[list[int], int]:
    """(the up to k tokens that followed the most recent earlier occurrence of the longest suffix
    of n tokens, max_n >= n >= min_n; how many tokens that occurrence matches the suffix, counted
    past n up to MATCH_CAP), or ([], 0)."""
    L = len(tokens)
    if k <= 0 or L < 2:
        return [], 0
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        pattern = arr[L - n :]
        # windows starting at i in [0, L-n-1) so the match is strictly earlier than the suffix
        starts = np.nonzero(arr[: L - n] == pattern[0])[0]
        for i in starts[::-1]:
            if i + n < L and np.array_equal(arr[i : i + n], pattern):
                follow = arr[i + n : i + n + k]
                if len(follow):
                    return follow.tolist(), _match_length(arr, i + n, L, n)
    return [], 0


def _match_length(arr: np.ndarray, end: int, L: int, n: int) -> int:
    """How many tokens arr[..end) and arr[..L) agree on backwards (at least n, at most MATCH_CAP)."""
    m = min(MATCH_CAP, end)
    if m <= n:
        return n
    a, b = arr[end - m : end][::-1], arr[L - m : L][::-1]
    diff = np.nonzero(a != b)[0]
    return int(diff[0]) if len(diff) else m


def match_confidence(m: int, num: int) -> list[float]:
    """Proposals 1..num continuing a match of m tokens: 1 - 1/(m + j)."""
    return [1.0 - 1.0 / (m + j) for j in range(1, num + 1)]


@register_proposer("ngram")
class NgramProposer:
    kv = None
    needs_draft_model = False
    feature_layers = ()  # reads no target features
    confidence = True  # the engine turns it off when the policy never reads it

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1, **_):
        max_n, min_n = ngram_max, ngram_min
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs, num_draft, num_forced=None):
        forced = num_forced or [0] * len(seqs)
        blocks = []
        for s, n, f in zip(seqs, num_draft, forced):
            tokens, conf = self._lookup(s, n, f)
            blocks.append(DraftBlock(tokens, None, conf if self.confidence else None))
        return blocks

    def _lookup(self, seq, n: int, f: int = 0) -> tuple[list[int], list[float]]:
        grammar = getattr(seq, "grammar", None)
        if grammar is None or n <= 0:
            tokens, m = ngram_match(seq.all_ids, n, self.max_n, self.min_n)
            return tokens, match_confidence(m, len(tokens))
        cursor, history, block, conf = grammar.cursor(), seq.all_ids, [], []
        while n > 0:
            nxt, c = cursor.forced_tokens(1), 1.0
            if nxt and f > 0:
                f -= 1
            else:
                n -= 1
                if not nxt:
                    nxt, m = ngram_match(history + block, 1, self.max_n, self.min_n)
                    c = match_confidence(m, 1)[0] if nxt else 0.0
            if not nxt or not cursor.accept(nxt[0]):
                break
            block.append(nxt[0])
            conf.append(c)
        return block, conf

    def postprocess(self, seq, block, num_accepted, num_tokens_before):
        pass

    def finish(self, seq):
        pass
