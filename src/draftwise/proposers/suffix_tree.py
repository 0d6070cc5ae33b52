"""`SuffixTrie`: every substring of up to `depth` tokens of a set of documents, with counts.

The structure behind suffix decoding (proposers/suffix.py; SuffixDecoding, arXiv 2411.04975): a
trie holding, for every position i of every document, the path of tokens doc[i : i + depth]. A
node is one substring s; its `count` is how many positions of the documents s occurs at, so among
the children of s, count(s + t) / sum over t' of count(s + t') is the empirical frequency with
which s was followed by t: the continuation scores.

- Appending a token to a document extends the `depth` suffixes that end at its end by one node
  each (the document's frontier): O(depth) dictionary operations per token, incremental as tokens
  commit; nothing is ever undone because only committed tokens are appended.
- Removing a document walks its windows again and decrements (a node whose count reaches 0 is cut
  off with its subtree, whose counts are no larger): how the global trie evicts.
- `match(context)` finds the longest suffix of `context` (at most depth - 1 tokens) that occurs
  followed by some token: "followed by something" is monotone in the suffix length (the shorter
  suffix occurs one position later with the same continuation), so a binary search of O(log
  depth) walks finds it.
- `draft` follows the most frequent child from there; past depth - 1 tokens of context (a node at
  the depth bound has no children) it re-anchors on the context's last depth - 1 tokens, which
  occur wherever the longer path did: a copy can run on for any length.

Memory: at most (tokens x depth) nodes of four slots each plus a dict of children; in text
that repeats (the workloads this serves) far fewer, since repeats share paths.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class _Node:
    __slots__ = ("count", "children", "seen", "doc")

    def __init__(self):
        self.count = 0
        self.children: dict[int, _Node] | None = None
        self.seen = 0  # when it last occurred (the trie's token clock): ties go to the most recent
        self.doc = None  # the document it last occurred in (which one a draft came from)


@dataclass
class Draft:
    """A continuation: the tokens, each one's estimated probability given the context and the
    tokens before it (its frequency among the continuations seen), the length of the context it
    matched, and the document it was last seen in."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_length: int = 0
    doc: object = None

    @property
    def score(self) -> float:
        """The expected number of tokens accepted if the estimates hold: sum of the running products."""
        total, run = 0.0, 1.0
        for p in self.probs:
            run *= p
            total += run
        return total


class SuffixTrie:
    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"suffix trie depth must be >= 2, got {depth}")
        self.depth = depth
        self.root = _Node()
        self._frontier: dict[object, list[_Node]] = {}  # doc -> nodes of its suffixes of 0..depth-1 tokens
        self.num_nodes = 0
        self._clock = 0  # tokens appended so far, to all documents

    def append(self, doc, tokens) -> None:
        """Append `tokens` to document `doc` (a new one starts empty)."""
        frontier = self._frontier.setdefault(doc, [self.root])
        keep = self.depth - 1
        for t in tokens:
            self._clock += 1
            grown = [self.root]
            for node in frontier:
                kids = node.children
                if kids is None:
                    kids = node.children = {}
                child = kids.get(t)
                if child is None:
                    child = kids[t] = _Node()
                    self.num_nodes += 1
                child.count += 1
                child.seen = self._clock
                child.doc = doc
                grown.append(child)
            frontier = grown[: keep + 1]  # suffixes of depth tokens never grow again
        self._frontier[doc] = frontier

    def close(self, doc) -> None:
        """No more tokens for `doc`: drop its frontier (its paths stay)."""
        self._frontier.pop(doc, None)

    def remove(self, doc, tokens: list[int]) -> None:
        """Take out every window of `tokens`, the whole content of document `doc`."""
        self._frontier.pop(doc, None)
        for i in range(len(tokens)):
            node = self.root
            for t in tokens[i : i + self.depth]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:
                    del node.children[t]
                    self.num_nodes -= self._size(child)
                    break
                node = child

    def _size(self, node: _Node) -> int:
        n, stack = 0, [node]
        while stack:
            x = stack.pop()
            n += 1
            if x.children:
                stack.extend(x.children.values())
        return n

    def _walk(self, tokens) -> _Node | None:
        node = self.root
        for t in tokens:
            kids = node.children
            node = kids.get(t) if kids else None
            if node is None:
                return None
        return node

    def match(self, context: list[int]) -> tuple[_Node, int]:
        """(node, m): the longest suffix of `context`, m <= depth - 1 tokens, that occurs followed
        by a token; (root, 0) when even the empty one is not (an empty trie)."""
        lo, hi, best = 0, min(self.depth - 1, len(context)), self.root
        while lo < hi:  # invariant: the suffix of lo tokens has a continuation (lo = 0: unless empty)
            mid = (lo + hi + 1) // 2
            node = self._walk(context[len(context) - mid :])
            if node is not None and node.children:
                lo, best = mid, node
            else:
                hi = mid - 1
        return best, lo

    def draft(self, context: list[int], max_tokens: int, min_prob: float, spec_factor: float = 1.0) -> Draft:
        """Up to min(max_tokens, spec_factor x m) tokens continuing `context`, m the length of the
        context matched: at each step the most frequent child (the most recently seen on a tie),
        while the running product of frequencies stays >= min_prob."""
        node, m = self.match(context)
        out = Draft(match_length=m)
        limit = min(max_tokens, int(spec_factor * m))
        tail, run = list(context[len(context) - m :]), 1.0
        while len(out.token_ids) < limit:
            if not node.children:  # at the depth bound (or a path seen only at a document's end)
                node, n = self.match(tail)
                tail = tail[len(tail) - n :]
                if not node.children:
                    break
            total, tok, child = 0, -1, None
            for t, c in node.children.items():
                total += c.count
                if child is None or (c.count, c.seen) > (child.count, child.seen):
                    tok, child = t, c
            run *= child.count / total
            if run < min_prob:
                break
            out.token_ids.append(tok)
            out.probs.append(child.count / total)
            out.doc = child.doc
            node = child
            tail.append(tok)
        return out
