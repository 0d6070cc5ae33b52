"""Greedy rows' trees from a draft model: expand the most probable, keep the best N (EAGLE-2's dynamic tree).

A row that may verify N proposals drafts a tree of at most N nodes instead of a chain of N:

- the drafter's catch-up step gives q at the root (after the last committed token); its `width`
  most probable tokens become the root's children;
- a node's score is the log of its gain, the estimated probability that its whole path is
  accepted: the product along the path of `NodeCalibration.rate(q(token))` (tree_budget.py;
  before any verification, the product of q as in EAGLE-2); only nodes whose gain pays the step's
  price (`TreeBudget.price`) count;
- each further step feeds, in one forward with tree attention (model/tree_attention.py), the
  nodes of the newest depth whose score ranks among the best N counting nodes so far, at most
  `width` of them, and adds each one's `width` most probable children; a node outside the best N
  cannot bring a child into them (a child's score is at most its parent's), so drafting stops
  when no frontier node ranks, or after N - 1 fed nodes (the drafter K/V the scheduler reserves,
  as for a chain of N);
- the tree is the best N counting nodes by score (ancestors first on ties, so the set holds every
  ancestor of its nodes), in creation order: parents before children, siblings by decreasing q.

For greedy rows (`draft_trees`) the candidates are the top tokens of q, a deterministic
function of the history: point masses for verification (`drafting="point"`, sampling/tree.py),
verified by following the target's argmax. A node's confidence is max_x q(x) at its parent's slot.
Where the drafter's greedy steps run fused (raw logits, the kernels), greedy rows take
`spine_trees` instead: the chain's one kernel call also returns each slot's runner-up, and the
tree is the best nodes among the spine and one runner-up leaf per slot (what a tree of a few
nodes holds when siblings rarely carry children of their own), for a chain's drafting time.

Sampled rows draft theirs in draft_tree_sampled.py (grown, never pruned).

The drafter's cache after a round holds the catch-up and the fed nodes (node fed f-th at key
root + 1 + f); `keep_path` moves the accepted path's fed nodes onto consecutive keys, so the
drafter's cache follows the committed path as a chain's does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..model.runner import ModelRunner
from ..model.tree_attention import TreeSpec
from ..sampling import process_logits
from .base import DraftBlock
from .tree_budget import NodeCalibration


@dataclass
class _Node:
    parent: int  # index into the row's nodes; -1: the root
    token: int
    score: float  # log of the gain: the product of the calibrated acceptances along the path
    depth: int
    conf: float  # max_x q(x) at the parent's slot
    q: float  # q(token) at the parent's slot
    first: bool  # the most probable token there
    fed: int = -1  # order in which the drafter fed it (its key is root + 1 + fed); -1: a leaf


@dataclass
class TreeRecord:
    """What the drafter keeps of a drafted tree until verification: each node's fed order (-1: not
    fed) for `keep_path`, and for a greedy tree its parents and q(token) (NodeCalibration.observe)."""

    fed: list[int]
    parents: tuple[int, ...] = ()
    qs: list[float] | None = None  # None: not calibrated from
    firsts: list[bool] | None = None
    # a sampled tree (siblings tried in turn: NodeCalibration.observe_draws; qs then the slots' max q)
    draws: bool = False


@dataclass
class TreeRow:
    seq: object  # the History
    base: int  # key of the last committed token (the root)
    budget: int  # nodes to keep at most (num_draft)
    floor: float = -math.inf  # log of the price: nodes scoring below it do not count
    nodes: list[_Node] = field(default_factory=list)
    zone: list[int] = field(default_factory=lambda: [-1])  # TreeSpec parents of keys base.. (fed nodes)
    frontier: list[int] = field(default_factory=list)  # nodes added by the last step

    def path(self, i: int) -> list[int]:
        out = []
        while i >= 0:
            out.append(self.nodes[i].token)
            i = self.nodes[i].parent
        return out[::-1]

    def best(self) -> list[int]:
        """The best `budget` nodes that pay the price, best first (ties: shallower, then older:
        ancestors before descendants)."""
        ranked = sorted(range(len(self.nodes)), key=lambda i: (-self.nodes[i].score, self.nodes[i].depth, i))
        return [i for i in ranked if self.nodes[i].score >= self.floor][: self.budget]

    def add_children(self, parent: int, logq: torch.Tensor, width: int, calibration: NodeCalibration) -> None:
        vals, idx = torch.topk(logq, min(width, logq.shape[0]))
        self.add_top(parent, vals.tolist(), idx.tolist(), calibration)

    def add_top(self, parent: int, vals: list[float], idx: list[int], calibration: NodeCalibration,
                conf: float | None = None) -> None:
        """The children of `parent` (-1: the root): the tokens `idx` of log q `vals` at its slot, most
        probable first; their confidence `conf` (default: max q there)."""
        conf = math.exp(vals[0]) if conf is None else conf
        score = self.nodes[parent].score if parent >= 0 else 0.0
        depth = self.nodes[parent].depth + 1 if parent >= 0 else 0
        for r, (v, t) in enumerate(zip(vals, idx)):
            if v > -float("inf"):  # never a token q cannot produce
                q = math.exp(v)
                self.frontier.append(len(self.nodes))
                gain = score + math.log(calibration.rate(q, r == 0))
                self.nodes.append(_Node(parent, t, gain, depth, conf, q, r == 0))

    def block(self) -> tuple[DraftBlock, TreeRecord | None]:
        """The best nodes as a tree block and its record; none pays: an empty chain, no record."""
        keep = sorted(self.best())
        if not keep:
            return DraftBlock([], None, []), None
        new = {old: j for j, old in enumerate(keep)}
        nodes = [self.nodes[i] for i in keep]
        parents = tuple(-1 if n.parent < 0 else new[n.parent] for n in nodes)
        blk = DraftBlock([n.token for n in nodes], None, [n.conf for n in nodes], parents=parents, drafting="point")
        return blk, TreeRecord([n.fed for n in nodes], parents, [n.q for n in nodes], [n.first for n in nodes])


def draft_trees(runner: ModelRunner, seqs: list, num_draft: list[int], width: int, eos_ids: list[int],
                feeds: list[list[int]], starts: list[int], raw: bool, calibration: NodeCalibration,
                price: float = 0.0) -> list[tuple[DraftBlock, TreeRecord | None]]:
    """One tree per sequence (see the module docstring) of at most num_draft[i] nodes whose gains
    are at least `price`: feeds[i] at starts[i] is its catch-up, ending with the last committed
    token. Returns (block, record) per sequence."""
    floor = math.log(price) if price > 0 else -math.inf
    rows = [TreeRow(s, st + len(f) - 1, n, floor) for s, st, f, n in zip(seqs, starts, feeds, num_draft)]
    logq = _log_q(runner, rows, [[] for _ in rows], feeds, starts, [None] * len(rows), raw, eos_ids)
    for row, lq in zip(rows, logq):
        row.add_children(-1, lq[0], width, calibration)
    while True:
        expand = [_to_expand(row, width, calibration) for row in rows]
        active = [i for i, e in enumerate(expand) if e]
        if not active:
            break
        specs, fds, sts, nodes = [], [], [], []
        for i in active:
            row = rows[i]
            st = row.base + len(row.zone)
            for j in expand[i]:
                node = row.nodes[j]
                node.fed = len(row.zone) - 1
                row.zone.append(0 if node.parent < 0 else 1 + row.nodes[node.parent].fed)
            specs.append(TreeSpec(row.base, tuple(row.zone)))
            fds.append([row.nodes[j].token for j in expand[i]])
            sts.append(st)
            nodes.append(expand[i])
            row.frontier = []
        sub = [rows[i] for i in active]
        logq = _log_q(runner, sub, nodes, fds, sts, specs, raw, eos_ids)
        for row, js, lq in zip(sub, nodes, logq):
            for j, l in zip(js, lq):
                row.add_children(j, l, width, calibration)
    return [row.block() for row in rows]


def _to_expand(row: TreeRow, width: int, calibration: NodeCalibration) -> list[int]:
    """The frontier nodes to feed next: among the best `budget` nodes, at most `width`, within the
    drafter K/V left (budget - 1 fed nodes in all), and only those whose child may rank: a fed node
    spends K/V a deeper node needs, so a node is fed when its first child, projected at the rate of
    its own slot's confidence (calibrated), ranks among the best `budget` of the nodes there are and
    every frontier node's chain of such projected descendants."""
    left = row.budget - 1 - (len(row.zone) - 1)
    if left <= 0 or not row.frontier:
        return []
    best = set(row.best())
    step = {j: math.log(calibration.rate(row.nodes[j].conf, True)) for j in row.frontier}
    projected = [n.score for n in row.nodes]
    for j in row.frontier:
        projected += [row.nodes[j].score + m * step[j] for m in range(1, row.budget)]
    projected = sorted((v for v in projected if v >= row.floor), reverse=True)
    cut = projected[row.budget - 1] if len(projected) >= row.budget else -math.inf
    ranked = sorted((j for j in row.frontier if j in best and row.nodes[j].score + step[j] >= cut),
                    key=lambda j: (-row.nodes[j].score, j))
    return ranked[: min(width, left)]


def _log_q(runner: ModelRunner, rows: list[TreeRow], nodes: list[list[int]], feeds, starts, specs, raw: bool,
           eos_ids: list[int]) -> list[torch.Tensor]:
    """One draft forward; per row, log q at each fed node's slot ([len(nodes[i]) or 1, V]): the
    processed distribution with the node's path in the history, as a chain's q has its proposals."""
    counts = [max(1, len(n)) for n in nodes]
    logits = runner.run([r.seq.seq_id for r in rows], feeds, starts, counts,
                        trees=None if all(s is None for s in specs) else specs)  # [sum(counts), V]
    logits = logits if logits.dtype == torch.float32 else logits.float()
    if not raw:
        params, prompts, hists = [], [], []
        for r, ns, c in zip(rows, nodes, counts):
            for j in (ns or [-1]):
                params.append(r.seq.params)
                prompts.append(r.seq.prompt_ids)
                hists.append(r.seq.output_ids + (r.path(j) if j >= 0 else []))
        logits = process_logits(logits, params, prompts, hists, eos_ids=[eos_ids] * len(params))
    logq = torch.log_softmax(logits, dim=-1)
    out, off = [], 0
    for c in counts:
        out.append(logq[off : off + c])
        off += c
    return out


def spine_trees(runner: ModelRunner, seqs: list, spine: list[int], budget: list[int], feeds: list[list[int]],
                starts: list[int], calibration: NodeCalibration,
                price: float = 0.0) -> list[tuple[DraftBlock, TreeRecord | None]] | None:
    """Greedy rows' trees from one fused call of the drafter's greedy steps (`greedy_steps_rows`
    with runners-up): sequence i's spine of spine[i] argmax tokens, and at each spine slot its
    runner-up as a sibling leaf; the tree is the best budget[i] of these nodes by gain that pay
    `price` (a node's parent always ranks above it: rates are below 1). The drafter runs a chain's
    forwards, in one kernel call. None where the fused steps cannot run (then `draft_trees`)."""
    got = runner.greedy_steps_rows([s.seq_id for s in seqs], feeds, starts, spine, confidence=True,
                                   runners_up=True)
    if got is None:
        return None
    return [spine_block(toks, conf, tok2, p2, n, calibration, price)
            for toks, conf, (tok2, p2), n in zip(got[0], got[1], got[2], budget)]


def spine_block(toks: list[int], conf: list[float], tok2: list[int], p2: list[float], budget: int,
                 calibration: NodeCalibration, price: float) -> tuple[DraftBlock, TreeRecord | None]:
    """(slot, first?) candidates ranked by gain: the spine node at slot j (gain G_j, the product of
    the first-kind rates up to j) and the runner-up there (G_{j-1} times its other-kind rate)."""
    cands = []  # (log gain, slot, 0: spine / 1: runner-up)
    g = 0.0
    for j, (c, q2) in enumerate(zip(conf, p2)):
        if not (c == c and q2 == q2):  # a NaN row: nothing from here on
            break
        if q2 > 0:
            cands.append((g + math.log(calibration.rate(q2, False)), j, 1))
        g += math.log(calibration.rate(c, True))
        cands.append((g, j, 0))
    floor = math.log(price) if price > 0 else -math.inf
    keep = sorted((j, kind) for v, j, kind in sorted(cands, key=lambda t: (-t[0], t[1], t[2]))[:budget] if v >= floor)
    if not keep:
        return DraftBlock([], None, []), None
    index, parents, tokens, confs, qs, firsts, fed = {}, [], [], [], [], [], []
    for j, kind in keep:  # slot order, the spine node before its sibling: parents come first
        index[(j, kind)] = len(tokens)
        parents.append(index[(j - 1, 0)] if j > 0 else -1)
        tokens.append(toks[j] if kind == 0 else tok2[j])
        confs.append(conf[j])
        qs.append(conf[j] if kind == 0 else p2[j])
        firsts.append(kind == 0)
        fed.append(j if kind == 0 and j < len(toks) - 1 else -1)  # the spine's last node is not fed
    blk = DraftBlock(tokens, None, confs, parents=tuple(parents), drafting="point")
    return blk, TreeRecord(fed, tuple(parents), qs, firsts)


def keep_path(runner: ModelRunner, seq_id: int, num_tokens_before: int, fed: list[int], path: tuple[int, ...]) -> int:
    """After verification: the accepted path's nodes the drafter fed (a leading run: a fed node's
    parent was fed first) moved onto keys num_tokens_before.., in order. Returns how many."""
    m = 0
    while m < len(path) and fed[path[m]] >= 0:
        m += 1
    runner.move_kv(seq_id, [num_tokens_before + fed[path[j]] for j in range(m)],
                   [num_tokens_before + j for j in range(m)])
    return m
