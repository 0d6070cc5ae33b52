"""Choosing each drafted token from q: what the drafters that draft left to right in one batched
loop share (DSpark's Markov draw, EAGLE-3's autoregressive steps).

At step k, `process_logits` (temperature, top-k/top-p, penalties over history + the tokens drafted
before k, a constrained row's grammar bitmask from a fork of its matcher) turns a row's logits into
q_k; a greedy row takes its argmax, a sampled row draws from it with its own generator and keeps q_k
(DraftBlock.probs: the rejection sampler reads exactly the q the token was drawn from). Greedy
rows with nothing to process and no grammar take the raw logits' argmax (q's).

p is the target, q the draft.
"""
from __future__ import annotations

import torch

from ..sampling import process_logits
from ..sampling.grammar import bitmask_width
from ..sampling.processors import changes_logits
from ..sampling.rejection import categorical_from_uniform


def raw_greedy(seq) -> bool:
    """Whether a row's q is its raw logits for the whole round: greedy, nothing to process, no grammar
    (its tokens are the logits' argmax; a drafter may draft such rows on a faster path)."""
    return seq.params.is_greedy and seq.grammar is None and not changes_logits(seq.params, len(seq.output_ids))


def temperature_only(seq) -> bool:
    """Whether a sampled row's q is softmax(logits / temperature) for the whole round: no grammar, no
    bias, penalties, min_tokens mask, top-k, top-p or min-p (a drafter may draw such rows on a
    faster path, with the row's generator)."""
    sp = seq.params
    return (not sp.is_greedy and seq.grammar is None and not sp.logit_bias and sp.repetition_penalty == 1.0
            and sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0 and len(seq.output_ids) >= sp.min_tokens
            and sp.top_k <= 0 and sp.top_p >= 1.0 and sp.min_p <= 0.0)


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:  # [N, V] -> [len(rows), V]
    """x's rows, a copy: `index_select`, the same values as x[rows] at a small fraction of advanced
    indexing's cost on a CPU (a step's whole budget is a few of these)."""
    return x.index_select(0, torch.tensor(rows, device=x.device))


class StepChooser:
    """`choose(k, logits [B, V]) -> [B]` for a drafter that drafts left to right (`DSparkDrafter.draw`,
    `Eagle3Drafter.draft`): q_k per row, the token drawn from it, and what the row keeps while it
    still drafts (tokens, q_k of sampled rows, max q_k)."""

    def __init__(self, seqs, lengths: list[int], eos_ids: list[int]):
        self.seqs, self.lengths, self.eos_ids = seqs, lengths, eos_ids
        self.tokens: list[list[int]] = [[] for _ in seqs]
        self.probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        self.max_q: list[list[float]] = [[] for _ in seqs]  # max_x q_k(x): a confidence of q_k alone
        self.cursors = {i: s.grammar.cursor() for i, s in enumerate(seqs) if s.grammar is not None}
        self.raw = [raw_greedy(s) for s in seqs]

    def active(self, i: int, k: int) -> bool:
        return k < self.lengths[i] and not (i in self.cursors and self.cursors[i].done)

    def __call__(self, k: int, logits: torch.Tensor) -> torch.Tensor:  # [B, V] float32 -> [B]
        rows = [i for i in range(len(self.seqs)) if self.active(i, k)]
        out = logits.argmax(-1)  # [B] (rows done drafting: unused)
        todo = [i for i in rows if not self.raw[i]]
        if todo:
            seqs = [self.seqs[i] for i in todo]
            q_logits = process_logits(
                _rows(logits, todo), [s.params for s in seqs], [s.prompt_ids for s in seqs],
                [s.output_ids + self.tokens[i] for s, i in zip(seqs, todo)],
                eos_ids=[self.eos_ids] * len(todo), token_bitmask=self._bitmask(todo, logits.shape[1]),
            )  # [T, V]
            for r, i in enumerate(todo):
                self.max_q[i].append(float(torch.softmax(q_logits[r], -1).max()))
            sampled = [r for r, i in enumerate(todo) if not self.seqs[i].params.is_greedy]
            if sampled:
                q = torch.softmax(_rows(q_logits, sampled), dim=-1)  # [S, V]
                gens = [self.seqs[todo[r]].generator for r in sampled]
                u = torch.cat([torch.rand(1, dtype=torch.float64, generator=g,
                                          device=g.device if g is not None else "cpu").cpu() for g in gens])
                drawn = categorical_from_uniform(q, u.to(q.device))
                for n, r in enumerate(sampled):
                    self.probs[todo[r]].append(q[n])
                    out[todo[r]] = drawn[n]
            for r, i in enumerate(todo):
                if self.seqs[i].params.is_greedy:
                    out[i] = q_logits[r].argmax()
        raw = [i for i in rows if self.raw[i]]
        if raw:
            for i, m in zip(raw, torch.softmax(_rows(logits, raw), -1).amax(-1).tolist()):
                self.max_q[i].append(m)
        for i in rows:
            tok = int(out[i])
            self.tokens[i].append(tok)
            if i in self.cursors:
                self.cursors[i].accept(tok)
        return out

    def _bitmask(self, rows: list[int], vocab: int) -> torch.Tensor | None:  # [T, W] int32 or None
        if not any(i in self.cursors for i in rows):
            return None
        out = torch.full((len(rows), bitmask_width(vocab)), -1, dtype=torch.int32)
        for r, i in enumerate(rows):
            if i in self.cursors:
                self.cursors[i].fill(out[r])
        return out
