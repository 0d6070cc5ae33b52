"""A lookup before the drafter (`--lookup ngram|suffix` beside a drafting method): each row's
proposals come from n-gram lookup or suffix decoding where its match is strong, from the drafter
elsewhere (Arctic Inference's suffix decoding beside a model speculator does the same).

Grounded and repetitive text (a reply quoting its prompt, an edited file returned whole, JSON
re-emitted) is where a lookup proposes long runs the target accepts, for no drafting time; open
text is where a trained drafter is right more often than an earlier occurrence. Per row and round:
1. the lookup proposes up to num_draft[i] tokens (`lookup_k`, default k: its blocks cost nothing
   to draft, so they may be longer than the drafter's);
2. where its first proposal's own acceptance estimate (the lookup's confidence: n-gram lookup's
   1 - 1/(m + 1) after a match of m tokens; suffix decoding's, discounted by how often earlier
   continuations agreed) is at least `lookup_min`, the row verifies the lookup's block;
3. the other rows go to the drafter, capped at its own `k` proposals, in one `propose` call (the
   drafter sees a round in which only those rows decode, as after a prefill).

Exact: which proposer drafts a row is a function of the committed history (and, for suffix
decoding, of earlier requests' outputs), as the lookup's block itself is, never of the drafter's
proposals; each block is exact as its proposer
makes it (q a point mass for the lookup, the drafter's q otherwise), and the rejection sampler
verifies it as such. The drafter's own state follows the committed path as after a round in which
the policy gave the row nothing to draft: a draft model catches up on the committed tokens when it
next drafts for the row; a drafter on the target's features has its rows written at every step
anyway (`commit_features`). The lookup is asked for its confidences whatever the policy reads.

The engine talks to this proposer as to the drafter (its cache, feature layers, target slots and
tree budget are the drafter's; a tree budget's per-row caps are narrowed to the drafter's rows);
`postprocess` and `finish` reach the proposer that drafted the row and both, respectively.
"""
from __future__ import annotations

from dataclasses import replace

from .base import DraftBlock

LOOKUPS = ("ngram", "suffix")
NO_BLOCK = DraftBlock([], None)


class LookupFirst:
    """`lookup` (an n-gram or suffix proposer) first, `inner` (any drafting proposer) for the rest; every
    other attribute is the inner proposer's."""

    def __init__(self, lookup, inner, k: int, lookup_min: float):
        self.lookup, self.inner = lookup, inner  # inner: the drafting proposer
        self.k, self.lookup_min = k, lookup_min
        self.name = f"{inner.name}+{lookup.name}"
        lookup.confidence = True  # the choice reads it
        self.from_lookup: set[int] = set()  # seq_ids whose last block was the lookup's
        self._tree_budget = None
        self.catch_up_seconds = 0.0  # the last propose's long catch-ups, the lookup's and the drafter's

    def __getattr__(self, attr):  # the drafter's cache, feature layers, target slots, ... (only what it has)
        if attr in ("lookup", "inner"):
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    @property
    def confidence(self) -> bool:
        return bool(getattr(self.inner, "confidence", False))

    @confidence.setter
    def confidence(self, value: bool) -> None:
        if hasattr(self.inner, "confidence"):
            self.inner.confidence = value

    def set_tree_budget(self, budget) -> None:
        """The step's budget, handed to the drafter (where it drafts trees) for its own rows."""
        self._tree_budget = budget

    def propose(self, seqs, num_draft, num_forced=None):
        forced = list(num_forced) if num_forced is not None else [0] * len(seqs)
        looked = self.lookup.propose(seqs, num_draft, forced)
        self.catch_up_seconds = getattr(self.lookup, "catch_up_seconds", 0.0)
        blocks: list[DraftBlock] = [NO_BLOCK] * len(seqs)
        rest = []
        for i, (s, b) in enumerate(zip(seqs, looked)):
            if b.token_ids and b.confidence and b.confidence[0] >= self.lookup_min:
                blocks[i] = b
                self.from_lookup.add(s.seq_id)
            else:
                rest.append(i)
                self.from_lookup.discard(s.seq_id)
        if rest:
            if self._tree_budget is not None and hasattr(self.inner, "set_tree_budget"):
                caps = self._tree_budget.caps
                self.inner.set_tree_budget(replace(self._tree_budget, caps=[min(caps[i], self.k) for i in rest]
                                                     if caps else caps))
            drafted = self.inner.propose([seqs[i] for i in rest], [min(num_draft[i], self.k) for i in rest],
                                           [forced[i] for i in rest])
            for i, b in zip(rest, drafted):
                blocks[i] = b
            self.catch_up_seconds += getattr(self.inner, "catch_up_seconds", 0.0)
        return blocks

    def drafted_by_lookup(self, seq) -> bool:
        """Whether the row's last block was the lookup's (the engine's statistics)."""
        return seq.seq_id in self.from_lookup

    def postprocess(self, seq, block, num_accepted, num_tokens_before):
        if self.drafted_by_lookup(seq):
            self.lookup.postprocess(seq, block, num_accepted, num_tokens_before)
        else:
            self.inner.postprocess(seq, block, num_accepted, num_tokens_before)

    def finish(self, seq) -> None:
        self.from_lookup.discard(seq.seq_id)
        self.lookup.finish(seq)
        self.inner.finish(seq)
