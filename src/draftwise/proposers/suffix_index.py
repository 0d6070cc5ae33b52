"""`SuffixIndex`: what followed a context in a set of documents, and how often.

The structure behind suffix decoding (proposers/suffix.py; SuffixDecoding, arXiv 2411.04975). Its
answers are those of a trie of every substring of up to `depth` tokens with its number of
occurrences (for every position i of every document the path doc[i : i + depth]): among the
continuations t of a substring s, count(s + t) / sum over t' of count(s + t') is the empirical
frequency with which s was followed by t, the continuation's score. No trie is built, though: a
document is its token list with, per token, pair and four consecutive tokens, the positions where
they end, and a query finds the occurrences of the context's last four (else two, else one)
tokens and extends them backwards.

- Appending a token is a few list appends. A trie extends `depth` nodes per token (~20 us of
  Python a token at depth 24 on a loaded AMD EPYC core), which an engine pays for every prompt
  and output it indexes, whether or not it then drafts from them.
- `match(context)` finds the longest suffix of `context` (at most depth - 1 tokens) that occurs
  followed by some token, and the positions where it ends; its cost is the occurrences of the
  context's last four tokens (of its last two or one where the match is shorter).
- `draft` follows the most frequent continuation (the most recently seen on a tie), narrowing the
  occurrences to those that continue that way; a path of `depth` tokens has no continuation (the
  trie's depth bound), so past it the draft re-anchors on the context's last depth - 1 tokens,
  which occur wherever the longer path did: a copy can run on for any length.
- Removing a document takes its positions out of the lists.

Memory: a few list slots per token (a trie at this depth holds up to depth nodes per token).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from heapq import heappop, heappush
from typing import Callable


@dataclass
class Draft:
    """A continuation: the tokens, each one's estimated probability given the context and the
    tokens before it (its frequency among the continuations seen), the length of the context it
    matched, and the document it was last seen in. A tree (`draft_tree`) also has each node's
    parent (-1: the context; parents[i] < i), its estimated gain (the probability that its path is
    accepted, by the rate it was drafted with) and whether it is its slot's most frequent continuation."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_length: int = 0
    doc: object = None
    parents: list[int] | None = None  # None: a chain
    gains: list[float] | None = None
    firsts: list[bool] | None = None  # a tree's: each node its slot's most frequent continuation or not

    @property
    def score(self) -> float:
        """The expected number of tokens accepted if the estimates hold: the sum over proposals of
        the product of the frequencies along its path."""
        if self.parents is None:
            total, run = 0.0, 1.0
            for p in self.probs:
                run *= p
                total += run
            return total
        runs: list[float] = []
        for parent, p in zip(self.parents, self.probs):
            runs.append((runs[parent] if parent >= 0 else 1.0) * p)
        return sum(runs)


class _Doc:
    __slots__ = ("key", "tokens", "clocks")

    def __init__(self, key):
        self.key = key
        self.tokens: list[int] = []
        self.clocks: list[int] = []  # the index's token clock at each position: ties go to the most recent


Occurrences = list  # [(doc, e)]: a substring ends at doc.tokens[e] (e = -1: the empty one, before position 0)


def _longest(toks: list[int], e: int, context: list[int], lo: int, hi: int) -> int:
    """The longest m in [lo, hi] with toks[e - m + 1 : e + 1] == context[-m:], given that lo matches
    (matching is monotone in m: a suffix of a match matches)."""
    n = len(context)
    if toks[e - hi + 1 : e + 1] == context[n - hi :]:
        return hi
    while lo < hi - 1:  # lo matches, hi does not
        mid = (lo + hi) // 2
        if toks[e - mid + 1 : e + 1] == context[n - mid :]:
            lo = mid
        else:
            hi = mid
    return lo


def _grouped(occ: Occurrences) -> dict[int, list]:
    """`SuffixIndex.continuations` with each token's occurrences moved one on (where the path
    continues with it): token -> [count, clock of its latest occurrence, its document, [(doc, e + 1)]],
    in one pass over `occ` (a draft narrows to one token's list)."""
    out: dict[int, list] = {}
    for d, e in occ:
        e += 1
        toks = d.tokens
        if e < len(toks):
            t, clock = toks[e], d.clocks[e]
            g = out.get(t)
            if g is None:
                out[t] = [1, clock, d, [(d, e)]]
            else:
                g[0] += 1
                if clock > g[1]:
                    g[1], g[2] = clock, d
                g[3].append((d, e))
    return out


class SuffixIndex:
    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"suffix index depth must be >= 2, got {depth}")
        self.depth = depth
        self.docs: dict[object, _Doc] = {}
        # (lists made on first append; lookups use .get, so no empty list is ever left behind)
        self.ends: defaultdict[int, Occurrences] = defaultdict(list)  # token -> where it occurs
        self.pairs: defaultdict[tuple[int, int], Occurrences] = defaultdict(list)  # (a, b) -> where b follows a
        self.quads: defaultdict[tuple[int, ...], Occurrences] = defaultdict(list)  # four tokens -> where they end
        self._clock = 0  # tokens appended so far, to all documents

    def append(self, doc, tokens) -> None:
        """Append `tokens` to document `doc` (a new one starts empty)."""
        d = self.docs.get(doc)
        if d is None:
            d = self.docs[doc] = _Doc(doc)
        toks, clocks, ends, pairs, quads = d.tokens, d.clocks, self.ends, self.pairs, self.quads
        i, prev, clock = len(toks), (toks[-1] if toks else None), self._clock
        for t in tokens:
            clock += 1
            toks.append(t)
            clocks.append(clock)
            ends[t].append((d, i))
            if prev is not None:
                pairs[(prev, t)].append((d, i))
                if i >= 3:
                    quads[(toks[i - 3], toks[i - 2], prev, t)].append((d, i))
            prev = t
            i += 1
        self._clock = clock

    def remove(self, doc) -> None:
        """Take document `doc` out (its positions leave the lists of its tokens, pairs and fours)."""
        d = self.docs.pop(doc, None)
        if d is None:
            return
        toks = d.tokens
        for table, keys in ((self.ends, set(toks)), (self.pairs, set(zip(toks, toks[1:]))),
                            (self.quads, set(zip(toks, toks[1:], toks[2:], toks[3:])))):
            for key in keys:
                kept = [x for x in table[key] if x[0] is not d]
                if kept:
                    table[key] = kept
                else:
                    del table[key]

    def count(self, tokens: list[int]) -> int:
        """Positions `tokens` (1 to depth of them) occur at: the trie's count of that substring."""
        n = len(tokens)
        if not 1 <= n <= self.depth:
            raise ValueError(f"count: 1 to {self.depth} tokens, got {n}")
        return sum(d.tokens[e - n + 1 : e + 1] == tokens for d, e in self.ends.get(tokens[-1], ()) if e >= n - 1)

    def match(self, context: list[int]) -> tuple[int, Occurrences | None]:
        """(m, occurrences): the longest suffix of `context`, m <= depth - 1 tokens, that occurs
        followed by a token, and the positions where it so ends; (0, None) when no token of it
        does (the empty suffix: it occurs before every position, `everywhere`)."""
        top = min(self.depth - 1, len(context))
        if top >= 4:  # the occurrences of the last four tokens, extended backwards
            best, occ = self._extend(self.quads.get(tuple(context[-4:]), ()), context, 4, top)
            if best:
                return best, occ
        if top >= 2:  # ... of the last pair (a match of 2 or 3)
            best, occ = self._extend(self.pairs.get((context[-2], context[-1]), ()), context, 2, min(top, 3))
            if best:
                return best, occ
        if top >= 1:
            occ = [(d, e) for d, e in self.ends.get(context[-1], ()) if e + 1 < len(d.tokens)]
            if occ:
                return 1, occ
        return 0, None

    @staticmethod
    def _extend(candidates: Occurrences, context: list[int], lo: int, top: int) -> tuple[int, Occurrences]:
        """The longest match m in [lo, top] among `candidates` (occurrences of the context's last lo
        tokens) that are followed by a token, and where it so ends; (0, []) when none is followed."""
        best, occ, want = 0, [], None  # want: the context's last `best` tokens
        n = len(context)
        for d, e in candidates:
            toks = d.tokens
            if e + 1 == len(toks):  # at the document's end: not followed
                continue
            hi = min(top, e + 1)
            if best > lo:  # only as long a match or longer counts
                if hi < best or toks[e - best + 1 : e + 1] != want:
                    continue
                m = best if hi == best else _longest(toks, e, context, best, hi)
            else:
                m = _longest(toks, e, context, lo, hi)
            if m > best:
                best, occ, want = m, [(d, e)], context[n - m :]
            elif m == best:
                occ.append((d, e))
        return best, occ

    def everywhere(self) -> Occurrences:
        """The empty substring's occurrences: before every position (the trie's root)."""
        return [(d, e) for d in self.docs.values() for e in range(-1, len(d.tokens) - 1)]

    @staticmethod
    def continuations(occ: Occurrences) -> dict[int, tuple[int, int, _Doc]]:
        """token -> (count, clock of its latest occurrence, its document) over the occurrences followed by a token."""
        out: dict[int, tuple[int, int, _Doc]] = {}
        for d, e in occ:
            if e + 1 < len(d.tokens):
                t, clock = d.tokens[e + 1], d.clocks[e + 1]
                got = out.get(t)
                out[t] = (1, clock, d) if got is None else (got[0] + 1, clock, d) if clock > got[1] else \
                    (got[0] + 1, got[1], got[2])
        return out

    def draft(self, context: list[int], max_tokens: int, min_prob: float, spec_factor: float = 1.0,
              matched: tuple[int, Occurrences | None] | None = None) -> Draft:
        """Up to min(max_tokens, spec_factor x m) tokens continuing `context`, m the length of the
        context matched (`matched`: `match(context)` when the caller has it already): at each step
        the most frequent continuation (the most recently seen on a tie), while the running product
        of frequencies stays >= min_prob."""
        m, occ = matched if matched is not None else self.match(context)
        out = Draft(match_length=m)
        limit = min(max_tokens, int(spec_factor * m))
        tail, n, run = list(context[len(context) - m :]), m, 1.0  # n: the path's length
        while len(out.token_ids) < limit:
            nxt = _grouped(occ) if n < self.depth else None
            if not nxt:  # at the depth bound (or a path seen only at a document's end): re-anchor
                n, occ = self.match(tail)
                tail = tail[len(tail) - n :]
                occ = self.everywhere() if occ is None else occ
                nxt = _grouped(occ)
                if not nxt:
                    break
            tok, (count, _, d, occ) = max(nxt.items(), key=lambda kv: kv[1][:2])
            total = sum(g[0] for g in nxt.values())
            run *= count / total
            if run < min_prob:
                break
            out.token_ids.append(tok)
            out.probs.append(count / total)
            out.doc = d.key
            n += 1
            tail.append(tok)
        return out

    def draft_tree(self, context: list[int], max_nodes: int, min_prob: float, spec_factor: float,
                   branches: int, rate: Callable[[int, int, float, bool], float] | None = None) -> Draft:
        """Up to `max_nodes` proposals in a tree (`Draft.parents`) of depth <= spec_factor x m,
        expanded best first by gain, the probability that a node's whole path is accepted: the
        product along it of `rate(m, depth, f, first)` (P(accepted | parent accepted) for a
        continuation of frequency f at that depth of a draft that matched m tokens, the most frequent at its slot or not; default f). A slot keeps
        its `branches` most frequent continuations, a path its running product of frequencies
        >= min_prob. Nodes come in order of decreasing gain (parents before children, siblings most
        frequent first, the most recent on a tie), so every prefix of them is a tree; its first-child
        path is `draft`'s chain where the gains let it reach that far."""
        m, occ = self.match(context)
        out = Draft(match_length=m, parents=[], gains=[], firsts=[])
        limit = min(int(spec_factor * m), max_nodes)  # depth
        if limit <= 0 or branches < 1:
            return out
        rate = rate or (lambda m_, depth, f, first: f)
        tails, occs, depths, runs = [list(context[len(context) - m :])], [occ], [0], [1.0]  # per slot: 0 the root
        heap: list = []
        tick = 0

        def expand(slot: int) -> None:
            nonlocal tick
            if depths[slot] >= limit:
                return
            n, tail, slot_occ = len(tails[slot]), tails[slot], occs[slot]
            nxt = self.continuations(slot_occ) if n < self.depth else None
            if not nxt:  # at the depth bound (or a path seen only at a document's end): re-anchor
                n, slot_occ = self.match(tail)
                tails[slot] = tail[len(tail) - n :]
                occs[slot] = slot_occ = self.everywhere() if slot_occ is None else slot_occ
                nxt = self.continuations(slot_occ)
            if not nxt:
                return
            total = sum(c for c, _, _ in nxt.values())
            ranked = sorted(nxt.items(), key=lambda kv: kv[1][:2], reverse=True)[:branches]
            parent_gain = 1.0 if slot == 0 else out_gains[slot - 1]
            for rank, (tok, (count, clock, d)) in enumerate(ranked):
                f = count / total
                if runs[slot] * f < min_prob:
                    break
                gain = parent_gain * rate(m, depths[slot] + 1, f, rank == 0)
                tick += 1
                heappush(heap, (-gain, depths[slot] + 1, rank, tick, slot, tok, f, d))

        out_gains = out.gains
        expand(0)
        while heap and len(out.token_ids) < max_nodes:
            neg_gain, depth, rank, _, slot, tok, f, d = heappop(heap)
            out.token_ids.append(tok)
            out.firsts.append(rank == 0)
            out.probs.append(f)
            out.parents.append(slot - 1)
            out_gains.append(-neg_gain)
            if out.doc is None:  # the most probable first proposal's
                out.doc = d.key
            tails.append(tails[slot] + [tok])
            occs.append([(x, e + 1) for x, e in occs[slot] if e + 1 < len(x.tokens) and x.tokens[e + 1] == tok])
            depths.append(depth)
            runs.append(runs[slot] * f)
            expand(len(tails) - 1)
        return out
