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

Where the block runs in one kernel call (the vanilla head), the same trees grow inside it
(kernels/dspark_tree.c); `tree_block` turns what it returns into a block. Sampled rows draft
chains: trees grown draw by draw over the block committed no more tokens per round than a chain
of as many nodes on the embedded pair, at several times its drafting time.

Heads whose bias carries a state over the block (rnn) or that move h_k (mlp) draft chains.
"""
from __future__ import annotations

import math

import torch

from .base import DraftBlock
from .draft_tree import TreeRecord, TreeRow
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

