"""Suffix decoding (SuffixDecoding, arXiv 2411.04975; vLLM's `suffix` method): no model, no q.

Two `SuffixIndex`es (suffix_index.py) answer "what followed this context before, and how often":
- the request's own, over its prompt and committed output, extended as tokens commit (the
  proposer catches up on the committed history when it next drafts for the row: it reads only
  committed tokens, so a rejected proposal never enters it and rollback needs nothing);
- a global one over earlier requests' outputs (`OutputCache`): an output enters when its request
  finishes, and the least recently used outputs leave once the cache holds more than
  `suffix_cache_tokens` tokens (used = drafted from, or added).

Each index drafts from the longest suffix of the history it has seen followed by something (m
tokens, m < `suffix_depth`), following the most frequent continuation, for at most
min(num_draft, `suffix_spec_factor` x m) tokens and while the running product of the frequencies
stays >= `suffix_min_prob`; the draft whose expected accepted length (the sum of those running
products) is higher wins, the request's own on a tie. In an engine (which hands the proposer its
step cost, `set_step_cost`) the step's rows then keep the prefixes of their drafts that maximise
expected committed tokens per second, with acceptance rates calibrated on verified drafts
(suffix_length.py); of the steps where the rule keeps nothing, every `PROBE_EVERY`-th verifies its
drafts whole (a probe: the step cost learns what a verified row costs only from steps that verify
rows, and a step with nothing to verify runs as plain multi-step decoding, which it does not
observe, so a row cost overrated once, e.g. by a slow first step, would otherwise stand for good).
The parameters:
- `suffix_depth` (24): the longest context that conditions the frequencies. Matches run out well
  before 24 tokens in text that is not a copy, and a copy keeps drafting past it (the draft
  re-anchors on the last depth - 1 tokens). Indexing does not depend on it (a token enters three
  position lists); a longer match compares more tokens of each occurrence.
- `suffix_spec_factor` (1.0): draft length per matched token. A match of 1-2 tokens is a weak
  guess (n-gram lookup measured 17-24% acceptance after one), a match of 12 or more is nearly
  always a copy (97%): long matches draft long (up to k, at most 16), short ones barely.
- `suffix_min_prob` (0.1): stop where earlier occurrences disagree so much that the estimated
  probability of reaching the next token falls below 1 in 10.
- `suffix_cache_tokens` (8192): the global index's budget.

The proposal is a function of committed history and earlier requests' outputs only, and q is a
point mass (`probs=None`): the rejection sampler accepts x with probability p(x), so sampled
outputs keep the target's distribution exactly (sampling/verify.py, rejection.py).

Confidence (for a policy that reads it): proposal j's is f_j (1 - 1/(m + j)), f_j its frequency
among the continuations seen: n-gram lookup's measured rule (proposers/ngram.py) where the
continuation was unique, discounted where earlier occurrences disagreed.

A structured-output row's block ends before the first token its grammar forbids (verification
would reject it); the engine appends the grammar's forced tail itself.

A row more than `LONG_CATCH_UP` committed tokens behind its index (a new prompt; a stretch of
steps without drafting) indexes them in its proposal step (about a microsecond a token): its time
(`catch_up_seconds`, the index's prefill in effect) is left out of the decode-step cost model, as a
draft model's long catch-ups are (proposers/draft_model.py).
"""
from __future__ import annotations

import time
from collections import OrderedDict

from .base import DraftBlock, StepCost, register_proposer
from .suffix_index import Draft, SuffixIndex
from .suffix_length import AcceptanceTable, best_lengths


class OutputCache:
    """Earlier requests' outputs in one index, at most `max_tokens` tokens, least recently used out first."""

    def __init__(self, depth: int, max_tokens: int):
        self.index = SuffixIndex(depth)
        self.max_tokens = max_tokens
        self.docs: OrderedDict[object, list[int]] = OrderedDict()
        self.tokens = 0

    def add(self, key, tokens: list[int]) -> None:
        if not tokens or self.max_tokens == 0:
            return
        tokens = list(tokens[-self.max_tokens :])  # an output longer than the cache keeps its end
        self.index.append(key, tokens)
        self.docs[key] = tokens
        self.tokens += len(tokens)
        while self.tokens > self.max_tokens:
            old_key, old = self.docs.popitem(last=False)
            self.index.remove(old_key)
            self.tokens -= len(old)

    def touch(self, key) -> None:
        if key in self.docs:
            self.docs.move_to_end(key)


class _Local:
    __slots__ = ("index", "indexed")

    def __init__(self, depth: int):
        self.index = SuffixIndex(depth)
        self.indexed = 0  # committed tokens (prompt, then output) appended to the index


def tail(seq, n: int) -> list[int]:
    """The last n committed tokens of a sequence, without copying its whole history."""
    out, prompt = seq.output_ids, seq.prompt_ids
    if len(out) >= n:
        return out[len(out) - n :]
    return prompt[max(0, len(prompt) - (n - len(out))) :] + out


@register_proposer("suffix")
class SuffixProposer:
    drafts_trees = True  # `tree` > 0 makes trees (SpecConfig.tree)
    kv = None
    needs_draft_model = False
    feature_layers = ()  # reads no target features
    confidence = True  # the engine turns it off when the policy never reads it
    LONG_CATCH_UP = 32  # committed tokens a row's index takes in within its proposal step; more: timed apart
    PROBE_EVERY = 8  # steps whose drafts the cost rule cut to nothing, per one that verifies them whole

    def __init__(self, suffix_depth: int = 24, suffix_spec_factor: float = 1.0, suffix_min_prob: float = 0.1,
                 suffix_cache_tokens: int = 8192, tree: int = 0, **_):
        if suffix_depth < 2 or suffix_spec_factor <= 0 or not 0 <= suffix_min_prob <= 1 or suffix_cache_tokens < 0:
            raise ValueError("suffix decoding needs depth >= 2, spec_factor > 0, 0 <= min_prob <= 1, cache_tokens >= 0;"
                             f" got {suffix_depth}, {suffix_spec_factor}, {suffix_min_prob}, {suffix_cache_tokens}")
        self.depth, self.spec_factor, self.min_prob = suffix_depth, suffix_spec_factor, suffix_min_prob
        self.tree = tree  # continuations kept per slot of a drafted tree (0: chains)
        self.local: dict[int, _Local] = {}  # seq_id -> the request's own index
        self.cache = OutputCache(suffix_depth, suffix_cache_tokens)
        self.catch_up_seconds = 0.0  # the last propose's long catch-ups (left out of the step cost model)
        self.step_cost: StepCost | None = None  # set by the engine: drafts sized by suffix_length.py's rule
        self.cut_steps = 0  # steps whose drafts the rule cut to nothing (every PROBE_EVERY-th is verified whole)
        self.acceptance = AcceptanceTable()  # a slot's most frequent continuation (a chain's every proposal)
        self.sibling_acceptance = AcceptanceTable()  # a tree's other continuations
        # seq_id -> (match length, tokens, a tree's firsts) of its last draft
        self.drafted: dict[int, tuple[int, list[int], list[bool] | None]] = {}

    def set_step_cost(self, cost: StepCost) -> None:
        """Size drafts by the step's cost (suffix_length.py) instead of `suffix_spec_factor`."""
        self.step_cost = cost

    def propose(self, seqs, num_draft, num_forced=None):
        self.catch_up_seconds = 0.0
        drafts = [self._draft(s, n) if n > 0 else Draft() for s, n in zip(seqs, num_draft)]
        if self.step_cost is not None and any(d.token_ids for d in drafts):
            gains = [d.gains if d.parents is not None else self.acceptance.gains(d.match_length, _estimates(d))
                     for d in drafts]
            context = sum(len(s.prompt_ids) + len(s.output_ids) for s in seqs) / len(seqs)
            keep = best_lengths(gains, self.step_cost.tokens_seconds(len(seqs), context))
            if not any(keep):
                self.cut_steps += 1
                if self.cut_steps % self.PROBE_EVERY == 0:  # a probe: the drafts verified whole
                    keep = [len(d.token_ids) for d in drafts]
            drafts = [_cut(d, n) for d, n in zip(drafts, keep)]
        blocks = []
        for s, d in zip(seqs, drafts):
            if d.token_ids:
                self.drafted[s.seq_id] = (d.match_length, list(d.token_ids), d.firsts)
            conf = _estimates(d) if self.confidence else None
            branched = d.parents is not None and any(p != i - 1 for i, p in enumerate(d.parents))
            blocks.append(DraftBlock(d.token_ids, None, conf, parents=tuple(d.parents) if branched else None))
        return blocks

    def _draft(self, seq, n: int) -> Draft:
        """The better of the two indexes' drafts (a constrained row's ends before its grammar's first refusal)."""
        context = tail(seq, self.depth - 1)
        grammar = getattr(seq, "grammar", None)
        if self.tree and grammar is None:  # (a constrained row verifies a chain)
            def draft(index: SuffixIndex) -> Draft:
                return index.draft_tree(context, n, self.min_prob, self.spec_factor, self.tree, self._rate)
        else:
            def draft(index: SuffixIndex) -> Draft:
                return index.draft(context, n, self.min_prob, self.spec_factor)
        own = draft(self._catch_up(seq))
        best = own
        if self.cache.docs and not (self.tree and grammar is None):
            other = self._cache_chain(context, n, own)
            if other is not None:
                best = other
                self.cache.touch(other.doc)
        elif self.cache.docs:
            other = draft(self.cache.index)
            if (other.score, other.match_length) > (own.score, own.match_length):
                best = other
                self.cache.touch(other.doc)
        if grammar is not None and best.token_ids:
            best = _cut(best, len(_allowed_prefix(grammar, best.token_ids)))
        return best

    def _cache_chain(self, context: list[int], n: int, own: Draft) -> Draft | None:
        """The output cache's chain where it beats the request's own (`own`), else None. Its match
        comes first: a chain of at most L = min(n, spec_factor x m) tokens scores at most L (each
        running product is at most 1), so where `own` already scores above L, or L with a match
        as long, the cache's draft (the costly part in a long copy: a re-anchoring per token past
        the depth bound) cannot win and is not drafted."""
        if own.score >= n and own.match_length >= len(context):  # (n: every bound; the context: every match)
            return None
        matched = self.cache.index.match(context)
        bound = min(n, int(self.spec_factor * matched[0]))
        if own.score > bound or (own.score == bound and own.match_length >= matched[0]):
            return None
        other = self.cache.index.draft(context, n, self.min_prob, self.spec_factor, matched=matched)
        return other if (other.score, other.match_length) > (own.score, own.match_length) else None

    def _catch_up(self, seq) -> SuffixIndex:
        """The request's index, extended by the tokens committed since it last drafted."""
        st = self.local.get(seq.seq_id)
        prompt, out = seq.prompt_ids, seq.output_ids
        total = len(prompt) + len(out)
        if st is None or st.indexed > total:  # (committed history only grows; a new id starts afresh)
            st = self.local[seq.seq_id] = _Local(self.depth)
        t0 = time.perf_counter() if total - st.indexed > self.LONG_CATCH_UP else None
        if st.indexed < len(prompt):
            st.index.append(0, prompt[st.indexed :])
            st.indexed = len(prompt)
        if st.indexed < total:
            st.index.append(0, out[st.indexed - len(prompt) :])
            st.indexed = total
        if t0 is not None:
            self.catch_up_seconds += time.perf_counter() - t0
        return st.index

    def _rate(self, m: int, depth: int, f: float, first: bool) -> float:
        """A tree node's P(accepted | parent accepted): calibrated per (match length, depth), a
        slot's most frequent continuation and the others apart; the index's estimate as prior."""
        table = self.acceptance if first else self.sibling_acceptance
        return table.rate(m, depth, f * (1.0 - 1.0 / (m + depth)))

    def observe_verified(self, seq, block: DraftBlock, num_verified: int, num_accepted: int,
                         path: list[int] | None = None) -> None:
        """Calibrate the acceptance tables on what verification tested of the row's last draft
        (a tree: its first `num_verified` nodes, `path` the accepted ones)."""
        last = self.drafted.pop(seq.seq_id, None)
        if last is None or not num_verified or last[1][: len(block.token_ids)] != block.token_ids:
            return
        if last[2] is None:  # a chain
            self.acceptance.observe(last[0], min(num_verified, len(block.token_ids)), num_accepted)
            return
        n = min(num_verified, len(block.token_ids))  # a tree, or a tree's draft that did not branch
        parents = block.parents[:n] if block.parents is not None else tuple(range(-1, n - 1))
        path = path if path is not None else list(range(num_accepted))
        greedy = getattr(getattr(seq, "params", None), "is_greedy", True)
        for depth, first, accepted in nodes_tested(parents, last[2], path, greedy):
            (self.acceptance if first else self.sibling_acceptance).observe_one(last[0], depth, accepted)

    def postprocess(self, seq, block, num_accepted, num_tokens_before):
        pass  # the request's index catches up on committed tokens when it next drafts

    def finish(self, seq) -> None:
        self.local.pop(seq.seq_id, None)
        self.drafted.pop(seq.seq_id, None)
        self.cache.add(seq.seq_id, seq.output_ids)


def _estimates(d: Draft) -> list[float]:
    """The index's estimate of each proposal's acceptance: f_j (1 - 1/(m + j))."""
    return [f * (1.0 - 1.0 / (d.match_length + j)) for j, f in zip(_depths(d), d.probs)]


def _cut(d: Draft, n: int) -> Draft:
    """The first n proposals (of a tree: its first n nodes, a tree again)."""
    if n >= len(d.token_ids):
        return d
    if d.parents is None:
        return Draft(d.token_ids[:n], d.probs[:n], d.match_length, d.doc)
    return Draft(d.token_ids[:n], d.probs[:n], d.match_length, d.doc, d.parents[:n], d.gains[:n], d.firsts[:n])


def _depths(d: Draft) -> list[int]:
    """Each proposal's depth (1: after the context)."""
    if d.parents is None:
        return list(range(1, len(d.token_ids) + 1))
    out: list[int] = []
    for parent in d.parents:
        out.append(out[parent] + 1 if parent >= 0 else 1)
    return out


def nodes_tested(parents, firsts, path, greedy: bool = True) -> list[tuple[int, bool, bool]]:
    """(depth, its slot's most frequent continuation (`firsts`), accepted) of each node a tree's
    verification tested (`path`: the accepted nodes, in order): greedy, every child of the context
    and of each accepted node (the target's argmax decides them all); sampled, siblings are tried
    in turn, so those after the accepted one were never tested."""
    on_path, depth, out, decided = set(path), [], [], set()
    for i, parent in enumerate(parents):
        depth.append(depth[parent] + 1 if parent >= 0 else 1)
        if (parent < 0 or parent in on_path) and (greedy or parent not in decided):
            out.append((depth[i], firsts[i], i in on_path))
            if i in on_path:
                decided.add(parent)
    return out


def _allowed_prefix(grammar, tokens: list[int]) -> list[int]:
    cursor = grammar.cursor()
    for i, t in enumerate(tokens):
        if not cursor.accept(t):
            return tokens[:i]
    return tokens


__all__ = ["Draft", "OutputCache", "SuffixIndex", "SuffixProposer", "tail"]
