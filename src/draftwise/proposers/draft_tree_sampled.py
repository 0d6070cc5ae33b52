"""Sampled rows' trees from a draft model: the most valuable draw first, one drafter forward per depth.

A sampled row cannot prune by probability (a sibling kept for its own q is no longer a draw from
q, and recursive rejection sampling over siblings would lose exactness), so its tree is grown,
never cut: every node is a draw, kept once drawn, and what is decided is only where the next draw
happens. At a *fed* slot (the root, after the catch-up, or a node the drafter has fed) q is known;
its next draw is a draw from q without replacement of the slot's earlier draws (`drafting=
"distinct"`, sampling/tree.py), and its estimated gain, the probability that the drawn node is
reached and accepted, is

    reach(slot) * P(every earlier draw there rejected) * rate(draw)

with reach the gain of the slot's node (1 at the root) and the rates of a slot's first and later
draws from its confidence max_x q(x) (`NodeCalibration.rate`, learned from verified sampled
trees by `observe_draws`). A node not yet fed offers a first draw at its own slot, projected at its
parent slot's first-draw rate (its own q is not known yet). Each step takes candidates best
first: draws at fed slots while they lead, and when the best is an unfed node, the unfed nodes
that rank among the best `budget - drawn` candidates (at most `width`) are fed together in one
forward with tree attention (model/tree_attention.py), the drafter's K/V bounded by a chain's
(budget - 1 fed nodes). Drafting ends at `budget` nodes or when no candidate is left.

Exact: each choice (draw here, feed that node, stop) depends on confidences and on tokens drawn
before it, never on the token a draw will give, so each slot's children are draws without
replacement from the q verification is given, tried in the order drawn (node order), whatever
subtree the earlier siblings grew (tests/test_tree_exact.py enumerates such adaptive trees).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.runner import ModelRunner
from ..model.tree_attention import TreeSpec
from ..sampling import process_logits
from ..sampling.rejection import categorical_from_uniform
from .base import DraftBlock
from .draft_tree import TreeRecord
from .tree_budget import NodeCalibration


@dataclass
class _Slot:
    """A fed position: the root (node -1) or a fed node."""

    q: torch.Tensor  # [V] q there (processed), what verification is given
    left: torch.Tensor  # [V] float64: q with the slot's draws removed (unnormalised)
    conf: float  # max_x q(x)
    reach: float  # the estimated gain of its node (1 at the root)
    survive: float = 1.0  # estimated P(every draw so far rejected)
    draws: int = 0
    mass: float = 1.0  # q's mass not drawn yet


@dataclass
class _Row:
    seq: object  # the History
    base: int  # key of the last committed token (the root)
    budget: int  # nodes at most
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    gains: list[float] = field(default_factory=list)  # estimated P(node reached and accepted)
    confs: list[float] = field(default_factory=list)  # max q at the node's parent slot
    fed: list[int] = field(default_factory=list)  # order the drafter fed each node (-1: not fed)
    zone: list[int] = field(default_factory=lambda: [-1])  # TreeSpec parents of keys base.. (fed nodes)
    slots: dict[int, _Slot] = field(default_factory=dict)  # node (-1: the root) -> its fed slot

    def path(self, i: int) -> list[int]:
        out = []
        while i >= 0:
            out.append(self.tokens[i])
            i = self.parents[i]
        return out[::-1]

    def add_slot(self, node: int, q: torch.Tensor) -> None:
        self.slots[node] = _Slot(q, q.to(torch.float64).clone(), float(q.max()),
                                 1.0 if node < 0 else self.gains[node])

    def draw(self, node: int, calibration: NodeCalibration) -> None:
        """One more draw at `node`'s slot, one uniform from the row's generator (inverse CDF)."""
        s = self.slots[node]
        u = torch.rand(1, dtype=torch.float64, generator=self.seq.generator)
        x = int(categorical_from_uniform(s.left[None, :], u)[0])
        s.mass -= float(s.left[x])
        s.left[x] = 0.0
        rate = calibration.rate(s.conf, s.draws == 0)
        self.tokens.append(x)
        self.parents.append(node)
        self.gains.append(s.reach * s.survive * rate)
        self.confs.append(s.conf)
        self.fed.append(-1)
        s.survive *= 1.0 - rate
        s.draws += 1

    def plan(self, width: int, calibration: NodeCalibration) -> list[int]:
        """Draw while a fed slot's draw leads; return the nodes to feed next (none: done)."""
        while len(self.tokens) < self.budget:
            cands = [(s.reach * s.survive * calibration.rate(s.conf, s.draws == 0), 0, node)
                     for node, s in self.slots.items() if s.mass > 1e-9]
            if len(self.zone) < self.budget:  # drafter K/V left for another fed node
                cands += [(g * calibration.rate(self.confs[v], True), 1, v)
                          for v, g in enumerate(self.gains) if self.fed[v] < 0]
            if not cands:
                return []
            cands.sort(key=lambda c: (-c[0], c[1], c[2]))
            if cands[0][1] == 0:
                self.draw(cands[0][2], calibration)
                continue
            ranked = cands[: self.budget - len(self.tokens)]
            return [v for _, kind, v in ranked if kind == 1][: min(width, self.budget - len(self.zone))]
        return []


def draft_sampled_trees(runner: ModelRunner, seqs: list, num_draft: list[int], width: int, eos_ids: list[int],
                        feeds: list[list[int]], starts: list[int],
                        calibration: NodeCalibration) -> list[tuple[DraftBlock, TreeRecord]]:
    """Per sequence (see the module docstring) a tree of at most num_draft[i] nodes: feeds[i] at
    starts[i] is its catch-up, ending with the last committed token. Returns (block with q per
    slot, its record: the fed order of each node) per sequence."""
    rows = [_Row(s, st + len(f) - 1, n) for s, st, f, n in zip(seqs, starts, feeds, num_draft)]
    q = _q(runner, rows, [[-1] for _ in rows], feeds, starts, [None] * len(rows), eos_ids)
    for row, qs in zip(rows, q):
        row.add_slot(-1, qs[0])
    active = list(range(len(rows)))
    while active:
        plans = {i: rows[i].plan(width, calibration) for i in active}
        active = [i for i in active if plans[i]]
        if not active:
            break
        specs, fds, sts = [], [], []
        for i in active:
            row = rows[i]
            sts.append(row.base + len(row.zone))
            for v in plans[i]:
                row.fed[v] = len(row.zone) - 1
                p = row.parents[v]
                row.zone.append(0 if p < 0 else 1 + row.fed[p])
            specs.append(TreeSpec(row.base, tuple(row.zone)))
            fds.append([row.tokens[v] for v in plans[i]])
        sub = [rows[i] for i in active]
        q = _q(runner, sub, [plans[i] for i in active], fds, sts, specs, eos_ids)
        for row, i, qs in zip(sub, active, q):
            for v, qv in zip(plans[i], qs):
                row.add_slot(v, qv)
    return [_block(row) for row in rows]


def _q(runner: ModelRunner, rows: list[_Row], nodes: list[list[int]], feeds, starts, specs,
       eos_ids: list[int]) -> list[torch.Tensor]:
    """One draft forward; per row, q at each fed node's slot ([len(nodes[i]), V]; node -1: the
    root), processed with the node's path in the history, as a chain's q has its proposals."""
    counts = [len(n) for n in nodes]
    logits = runner.run([r.seq.seq_id for r in rows], feeds, starts, counts,
                        trees=None if all(s is None for s in specs) else specs)  # [sum(counts), V]
    logits = logits if logits.dtype == torch.float32 else logits.float()
    params, prompts, hists = [], [], []
    for r, ns in zip(rows, nodes):
        for v in ns:
            params.append(r.seq.params)
            prompts.append(r.seq.prompt_ids)
            hists.append(r.seq.output_ids + r.path(v))
    q = torch.softmax(process_logits(logits, params, prompts, hists, eos_ids=[eos_ids] * len(params)), dim=-1)
    return list(torch.split(q, counts))


def _block(row: _Row) -> tuple[DraftBlock, TreeRecord]:
    n = len(row.tokens)
    probs = torch.zeros(n + 1, row.slots[-1].q.shape[-1])  # [n + 1, V]: a leaf's row is never read
    for node, s in row.slots.items():
        probs[node + 1] = s.q
    blk = DraftBlock(list(row.tokens), probs, list(row.confs), parents=tuple(row.parents), drafting="distinct")
    return blk, TreeRecord(list(row.fed), tuple(row.parents), list(row.confs), draws=True)
