"""How big a drafted tree is: the price of a verified row, and each node's estimated gain.

A node of a tree adds one verified row; it pays when the tokens it is expected to add (the
probability that its whole path is accepted, its *gain*) are worth that row's marginal seconds at
the step's planned rate: gain >= lambda * dcost/dtoken, the goodput policy's own admission rule
(policies/goodput/plan.py). The policy states that price for the step it planned (`StepHints.
node_price`), the engine hands it with each row's node cap to a drafter that sizes its trees
(`SizedTrees.set_tree_budget`), and the drafter expands its most probable nodes while they pay:
at high load the price rises, siblings (less probable than the main chain) drop out first, then
the chain's tail; a plan of 0 for a row is plain decoding. Price 0 (the fixed policy, goodput's
"full" arm): the planned number of nodes.

A node's gain is the product along its path of P(accepted | parent accepted), estimated from
q(token) at its parent's slot and whether it is its slot's most probable token by
`NodeCalibration`: per kind (first, other), 20 bins of q, each a decayed count of tested /
accepted nodes with a weak prior (acceptance = the bin's centre), q scaled by its bin's observed /
prior ratio (q itself, EAGLE-2's score, before any verification). The two kinds apart: a drafter
distilled from the target is right about its argmax far more often than its q says, and about
the runner-up far less. A
greedy tree's tested nodes are the children of the root and of every accepted node: accepted
if on the accepted path, rejected otherwise (the target's argmax at their parent's slot is known).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

NUM_BINS = 20
PRIOR_WEIGHT = 2.0
DECAY = 0.999  # per observation: follows drift slowly


@dataclass(frozen=True)
class TreeBudget:
    """What a step allows a tree-drafting proposer (set before `propose`)."""

    price: float = 0.0  # a node is drafted while its gain is at least this (0: up to the planned count)
    caps: Sequence[int] = ()  # [B] the most nodes row i may hold (the K/V reserved); (): the planned counts


@runtime_checkable
class SizedTrees(Protocol):
    """A proposer whose trees take their size from the step's `TreeBudget`."""

    def set_tree_budget(self, budget: TreeBudget) -> None: ...


@dataclass
class NodeCalibration:
    """P(node accepted | parent accepted) from q(node's token), learned from verified trees."""

    # [first?][bin] -> [accepted, tested], the prior: acceptance = the bin's centre
    tables: list[list[list[float]]] = field(default_factory=lambda: [
        [[(b + 0.5) / NUM_BINS * PRIOR_WEIGHT, PRIOR_WEIGHT] for b in range(NUM_BINS)] for _ in range(2)])

    @staticmethod
    def _bin(q: float) -> int:
        return min(NUM_BINS - 1, max(0, int(q * NUM_BINS)))

    def rate(self, q: float, first: bool) -> float:
        """q times its bin's observed / prior acceptance (`first`: the slot's most probable token):
        q itself before any observation, and in the order of q within a bin."""
        b = self._bin(q)
        acc, n = self.tables[int(first)][b]
        return min(0.999, max(1e-6, q * (acc / n) / ((b + 0.5) / NUM_BINS)))

    def ratios(self) -> list[float]:
        """`rate`'s scale of q per (first?, bin), [2 * NUM_BINS] (other kind first), for the kernels."""
        return [(acc / n) / ((b + 0.5) / NUM_BINS) for kind in self.tables for b, (acc, n) in enumerate(kind)]

    def _count(self, q: float, first: bool, accepted: bool) -> None:
        row = self.tables[int(first)][self._bin(q)]
        row[0] = row[0] * DECAY + (1.0 if accepted else 0.0)
        row[1] = row[1] * DECAY + 1.0

    def observe_draws(self, parents: Sequence[int], confs: Sequence[float], path: Sequence[int]) -> None:
        """A sampled tree verified (siblings: draws without replacement, tried in turn): at the
        root and at every accepted node, its children were tested in order until one was accepted
        (the rest never were). Kinds: a slot's first draw and its later ones; bins: the slot's
        max q (`confs`, known before drawing, what the drafter decides by)."""
        on_path = set(path)
        for slot in [-1, *path]:
            for m, i in enumerate(j for j, p in enumerate(parents) if p == slot):
                self._count(confs[i], m == 0, i in on_path)
                if i in on_path:
                    break

    def observe(self, parents: Sequence[int], qs: Sequence[float], firsts: Sequence[bool],
                path: Sequence[int]) -> None:
        """A greedy tree verified: node i (under parents[i], token probability qs[i], its slot's
        most probable token or not) was tested if its parent is the root (-1) or on the accepted
        `path`, and accepted if on the path."""
        on_path = set(path)
        for i, (p, q, f) in enumerate(zip(parents, qs, firsts)):
            if p < 0 or p in on_path:
                self._count(q, f, i in on_path)


def tree_rows(budget: TreeBudget, width: int, seqs: list, num_draft: list[int],
              eligible) -> tuple[list[int], list[int]]:
    """(each row's node budget, the rows that draft a tree): a greedy row's budget with a price is up
    to its cap (the gains then decide, one node too), else as planned; a row drafts a tree where
    `width` > 0, `eligible(seq)` holds and it may hold two nodes or more (or one that pays)."""
    if not width:  # (a chain drafter's every round: nothing to weigh)
        return list(num_draft), []
    priced = [budget.price > 0 and n > 0 and len(budget.caps) == len(num_draft) and s.params.is_greedy
              for s, n in zip(seqs, num_draft)]
    nodes = [max(n, budget.caps[i]) if p else n for i, (n, p) in enumerate(zip(num_draft, priced))]
    trees = [i for i, n in enumerate(nodes) if width and (n >= 2 or priced[i]) and eligible(seqs[i])]
    return nodes, trees
