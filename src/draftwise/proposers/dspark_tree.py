"""Greedy rows' trees from the DSpark drafter: EAGLE-2's "expand the most probable, keep the best N"
over the block's base logits and the Markov head.

A DSpark block gives, in one forward, the base logits U_1..U_gamma of its positions; position k's
distribution after a drafted x_{k-1} is softmax(U_k + B(x_{k-1}, .)) (model/dspark_heads.py: the
bias reads the token before, and for the gated head h_k). So any node's children cost one rank-r
product over the vocabulary, not a drafter forward: a tree is grown depth by depth from the same
block, every frontier node that ranks among the best N expanded at once.

- The root's children are the `width` most probable tokens of q_1 (after the anchor); a node at
  depth d has the `width` most probable tokens of q_{d+1}(. | its token) as children, up to depth
  gamma (the block's positions).
- A node's score is the log of its gain, the estimated probability that its whole path is
  accepted: the product along it of `NodeCalibration.rate(q(token), first)` (tree_budget.py; learned
  from verified trees, q itself before any); only nodes whose gain pays the step's price count.
  A node outside the best N cannot bring a child into them (a child's score is at most its
  parent's), so the frontier nodes expanded are those among the best N.
- The tree is the best N counting nodes (draft_tree.TreeRow.block: parents before children),
  candidates as point masses (`drafting="point"`), verified by following the target's argmax.
- A node's confidence is the confidence head's c at its slot (what the `dspark` policy reads),
  with its parent's token as x_{k-1}; without it, max_x q(x) there.

Sampled rows (`markov_sampled_trees`) grow theirs draw by draw as the draft model's do
(draft_tree_sampled.py: the next draw where its estimated gain is highest, each slot's children
draws from q without replacement, never pruned), q at a node from the same block: the processed
softmax(U_{d+1} + B(its token, .)) with its path in the history; a node at the block's last
position has no slot.

Heads whose bias carries a state over the block (rnn) or that move h_k (mlp) draft chains.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..sampling import process_logits
from .base import DraftBlock
from .draft_tree import TreeRecord, TreeRow
from .draft_tree_sampled import SampledRow, sampled_block
from .tree_budget import NodeCalibration


def grows_trees(drafter) -> bool:
    """Whether a node's distribution is the block's base logits plus a bias of its token alone."""
    head = drafter.markov
    if head is None:
        return True
    return not head.adjusts_hidden and head.init_state(torch.zeros(1, dtype=torch.long)) is None


def tree_block(tokens: list[int], parents: list[int], confs: list[float], qs: list[float],
               firsts: list[bool]) -> tuple[DraftBlock, TreeRecord | None]:
    """A tree grown in the kernel call (kernels/dspark_tree.c: the nodes `markov_trees` keeps, parents
    first) as a block of point masses and its record (none kept: an empty chain, no record)."""
    if not tokens:
        return DraftBlock([], None, []), None
    blk = DraftBlock(list(tokens), None, list(confs), parents=tuple(parents), drafting="point")
    return blk, TreeRecord([-1] * len(tokens), tuple(parents), list(qs), list(firsts))


def markov_trees(drafter, hidden: torch.Tensor, base: torch.Tensor, anchors: list[int], budgets: list[int],
                 width: int, calibration: NodeCalibration, price: float = 0.0,
                 confidence: bool = True) -> list[tuple[DraftBlock, TreeRecord | None]]:
    """One tree per row (module docstring): hidden [B, gamma, H] the block's hidden states, base
    [B, gamma, V] float32 its base logits U_k, anchors[b] the row's last committed token,
    budgets[b] the most nodes. Returns (block, record) per row (an empty chain, no record, where no
    node pays)."""
    floor = math.log(price) if price > 0 else -math.inf
    rows = [TreeRow(None, 0, n, floor) for n in budgets]
    expand = [[-1] for _ in rows]  # nodes whose children the next depth adds (-1: the root)
    for d in range(base.shape[1]):
        who = [(b, j) for b, js in enumerate(expand) for j in js]
        if not who:
            break
        sel = torch.tensor([b for b, _ in who])
        prev = torch.tensor([anchors[b] if j < 0 else rows[b].nodes[j].token for b, j in who])
        h = hidden[sel, d]  # [n, H]
        logits = base[sel, d]  # [n, V]
        if drafter.markov is not None:
            logits = logits + drafter.markov.step(None, prev, h)[1]
        logits = logits.float()
        vals, idx = torch.topk(logits, min(width, logits.shape[-1]), dim=-1)  # [n, w]: log q = logits - lse
        top = vals[:, :1]
        vals = (vals - top - (logits - top).exp_().sum(-1, keepdim=True).log_()).tolist()
        idx = idx.tolist()
        conf = [None] * len(who)
        if confidence:
            conf = torch.sigmoid(drafter.confidence_logit(h, prev) / drafter.confidence_temperature(d)).tolist()
        for m, (b, j) in enumerate(who):
            rows[b].add_top(j, vals[m], idx[m], calibration, conf[m])
        for b, row in enumerate(rows):
            best = set(row.best())
            expand[b] = [j for j in row.frontier if j in best]
            row.frontier = []
    return [row.block() for row in rows]


@dataclass
class _BlockRow(SampledRow):
    """A sampled row over a block of `gamma` positions: q after a node is a rank-r product away, so
    any node whose depth leaves a position after it may be expanded."""

    gamma: int = 0

    def depth(self, node: int) -> int:
        d = 0
        while self.parents[node] >= 0:
            node, d = self.parents[node], d + 1
        return d

    def feed_room(self) -> int:
        return self.budget

    def feedable(self, node: int) -> bool:
        return self.depth(node) + 1 < self.gamma


def markov_sampled_trees(drafter, hidden: torch.Tensor, base: torch.Tensor, anchors: list[int], seqs: list,
                         budgets: list[int], width: int, eos_ids: list[int],
                         calibration: NodeCalibration) -> list[tuple[DraftBlock, TreeRecord]]:
    """Sampled rows' trees (module docstring): hidden, base and anchors as `markov_trees` takes them,
    seqs the rows' histories (their params, generators, outputs). Returns (block with q per slot,
    drafting "distinct", its record) per row."""
    rows = [_BlockRow(s, 0, n, gamma=base.shape[1]) for s, n in zip(seqs, budgets)]
    who = [(b, -1) for b in range(len(rows))]
    for (b, _), q in zip(who, _block_q(drafter, hidden, base, anchors, rows, who, eos_ids)):
        rows[b].add_slot(-1, q)
    active = list(range(len(rows)))
    while active:
        plans = {b: rows[b].plan(width, calibration) for b in active}
        active = [b for b in active if plans[b]]
        who = [(b, v) for b in active for v in plans[b]]
        if not who:
            break
        for b, v in who:
            rows[b].fed[v] = 0  # (its q is known)
        for (b, v), q in zip(who, _block_q(drafter, hidden, base, anchors, rows, who, eos_ids)):
            rows[b].add_slot(v, q)
    return [sampled_block(row) for row in rows]


def _block_q(drafter, hidden, base, anchors, rows: list[_BlockRow], who: list[tuple[int, int]],
             eos_ids: list[int]) -> list[torch.Tensor]:
    """q [V] after each (row b, node v) (-1: the root): the processed softmax(U_d + B(token, .)) at
    the node's next position d, with its path in the history."""
    sel = torch.tensor([b for b, _ in who])
    pos = torch.tensor([0 if v < 0 else rows[b].depth(v) + 1 for b, v in who])
    prev = torch.tensor([anchors[b] if v < 0 else rows[b].tokens[v] for b, v in who])
    logits = base[sel, pos]  # [n, V]
    if drafter.markov is not None:
        logits = logits + drafter.markov.step(None, prev, hidden[sel, pos])[1]
    seqs = [rows[b].seq for b, _ in who]
    hists = [s.output_ids + (rows[b].path(v) if v >= 0 else []) for s, (b, v) in zip(seqs, who)]
    logits = process_logits(logits.float(), [s.params for s in seqs], [s.prompt_ids for s in seqs], hists,
                            eos_ids=[eos_ids] * len(seqs))
    return list(torch.softmax(logits, dim=-1))
