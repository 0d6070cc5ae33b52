"""Structured output: constraints compiled by xgrammar, one matcher per sequence that follows the
committed tokens only, and the token bitmasks at proposed positions.

A constraint is `SamplingParams.structured_output` (constraints.py checks, parses, compiles and
caches it).

Exactness under speculation. `GrammarState` owns a sequence's `GrammarMatcher`, advanced only by
`accept` with committed tokens (the engine's postprocess). The bitmask at proposed position j is
taken from a *fork* of that matcher fed the proposals x_1..x_{j-1} (`verify_bitmask`; the drafter
walks its own fork with `cursor`), so a proposal, accepted or rejected, never touches the committed
matcher. The same masks go into `process_logits` for p and for q. Rows after a proposal the grammar
forbids (p gives it 0 mass: it is rejected) or after the grammar has ended are left unconstrained:
verification never commits from them, but every row must stay a usable distribution.
EOS (the stop ids) is allowed exactly where the grammar can end; accepting it terminates the matcher.
"""
from __future__ import annotations

import time

import torch

from .constraints import KINDS, compile_constraint, normalize_structured_output  # noqa: F401 (re-exported)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarState:
    """One sequence's matcher, advanced only by committed tokens."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.seconds = 0.0  # time in grammar work (masks, forks, matcher updates), drained by the engine

    @staticmethod
    def create(tokenizer, vocab_size: int, eos_ids: list[int], spec: dict | None) -> "GrammarState | None":
        if spec is None:
            return None
        return GrammarState(compile_constraint(tokenizer, vocab_size, eos_ids, spec), vocab_size)

    def accept(self, token_id: int) -> bool:
        """Advance by one committed token; True when the grammar has ended (EOS accepted)."""
        t0 = time.perf_counter()
        ok = self.matcher.accept_token(int(token_id))
        self.seconds += time.perf_counter() - t0
        if not ok:
            raise ValueError(f"structured output: committed token {token_id} is not allowed by the grammar")
        return self.matcher.is_terminated()

    def take_seconds(self) -> float:
        """The grammar work's time since the last call."""
        s, self.seconds = self.seconds, 0.0
        return s

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def cursor(self) -> "GrammarCursor":
        """A fork of the committed state, for walking proposals (the committed matcher is untouched)."""
        return GrammarCursor(self.matcher.fork(), self.vocab_size, self)

    def verify_bitmask(self, proposals: list[int]) -> torch.Tensor:  # [n+1, W] int32
        """Bitmasks at positions 0..n of a block: row j follows the committed tokens + x_1..x_{j-1}."""
        t0 = time.perf_counter()
        out = torch.full((len(proposals) + 1, bitmask_width(self.vocab_size)), -1, dtype=torch.int32)
        cur = GrammarCursor(self.matcher.fork(), self.vocab_size)  # timed here as a whole
        for j in range(len(proposals) + 1):
            if not cur.fill(out[j]) or j == len(proposals) or not cur.accept(proposals[j]):
                break  # later rows: never committed from, left unconstrained
        self.seconds += time.perf_counter() - t0
        return out


class GrammarCursor:
    """A forked matcher that walks proposed tokens (drafting or verification)."""

    def __init__(self, matcher, vocab_size: int, owner: GrammarState | None = None):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.owner = owner  # the GrammarState whose `seconds` counts this cursor's work
        self.alive = True  # False after a forbidden token or the grammar's end

    def fill(self, row: torch.Tensor) -> bool:  # row [W] int32
        """Write the allowed tokens into row; leave it unconstrained (False) when dead."""
        t0 = time.perf_counter()
        live = self.alive and not self.matcher.is_terminated()
        if live:
            self.matcher.fill_next_token_bitmask(row[None, :], 0)
        else:
            row.fill_(-1)
        self._count(t0)
        return live

    def accept(self, token_id: int) -> bool:
        t0 = time.perf_counter()
        if self.alive and not self.matcher.is_terminated():
            self.alive = self.matcher.accept_token(int(token_id))
        else:
            self.alive = False
        self._count(t0)
        return self.alive

    @property
    def done(self) -> bool:
        """After a forbidden token or the grammar's end: nothing more to propose."""
        return not self.alive or self.matcher.is_terminated()

    def _count(self, t0: float) -> None:
        if self.owner is not None:
            self.owner.seconds += time.perf_counter() - t0

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to `limit` tokens that are, one after another, the only token the grammar allows
        (EOS included), maybe []. p and the masked q are point masses there: always accepted.
        (xgrammar's jump-forward tokens were tried too: its tokenization of the forced string is
        not the model's, and the masked target rejected them often.)"""
        out, t0 = [], time.perf_counter()
        if not self.alive or self.matcher.is_terminated() or limit <= 0:
            return out
        fork = self.matcher.fork()
        row = torch.empty(1, bitmask_width(self.vocab_size), dtype=torch.int32)  # [1, W]
        while len(out) < limit and not fork.is_terminated():
            fork.fill_next_token_bitmask(row, 0)
            tok = _single_token(row[0])
            if tok is None or tok >= self.vocab_size or not fork.accept_token(tok):
                break
            out.append(tok)
        self._count(t0)
        return out


def forced_tail(state: GrammarState, proposals: list[int], limit: int) -> list[int]:
    """The tokens the grammar forces after the committed tokens + `proposals` (up to `limit`;
    [] when a proposal is forbidden): free proposals to append to a block."""
    if limit <= 0:
        return []
    cur = state.cursor()
    for t in proposals:
        if not cur.accept(t):
            return []
    return cur.forced_tokens(limit)


def _single_token(row: torch.Tensor) -> int | None:  # row [W] int32
    """The token id when exactly one bit of the bitmask row is set, else None."""
    nz = torch.nonzero(row)
    if len(nz) != 1:
        return None
    i = int(nz[0, 0])
    w = int(row[i]) & 0xFFFFFFFF
    return i * 32 + w.bit_length() - 1 if w & (w - 1) == 0 else None


def grammar_bitmask(states: list[GrammarState | None], proposals: list[list[int]],
                    vocab_size: int) -> torch.Tensor | None:  # [sum(1 + n_b), W] int32 or None
    """The verification bitmask of a batch (rows as p's: 1 + len(proposals[b]) per sequence);
    None when no sequence is constrained."""
    if all(s is None for s in states):
        return None
    parts = [
        s.verify_bitmask(d) if s is not None
        else torch.full((len(d) + 1, bitmask_width(vocab_size)), -1, dtype=torch.int32)
        for s, d in zip(states, proposals)
    ]
    return torch.cat(parts)


_BITS = torch.tensor([1 << i if i < 31 else -(1 << 31) for i in range(32)], dtype=torch.int32)  # [32]


def allowed_from_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [N, W] -> [N, V] bool
    """Token j is allowed when bit j % 32 of word j // 32 is set (xgrammar's layout)."""
    return ((bitmask[:, :, None] & _BITS) != 0).reshape(bitmask.shape[0], -1)[:, :vocab_size]
