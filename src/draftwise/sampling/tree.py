"""Exact verification of a tree of proposals: recursive rejection sampling over siblings.

A chain proposes one continuation; a tree proposes several at a position (a draft model's
alternatives where it is unsure, n-gram or suffix lookup with several earlier matches). One row's
tree, p = target and q = draft as everywhere:

- node i (0 .. n-1) proposes `tokens[i]` after its parent `parents[i]` (-1: after the committed
  context); parents come before their children (parents[i] < i), siblings in the order they are
  tried. A verification block holds n + 1 target rows: slot 0 is the root (the position after
  the committed context), slot i + 1 the position after node i. `p[s]` is the target's processed
  distribution at slot s; `q[s]` the draft's there (the distribution the children of slot s were
  drawn from), or None for candidates chosen deterministically (a point mass each).
- At a slot, siblings are tried in order against a running target r (first p[s]): sibling x with
  proposal distribution q_k is accepted with probability min(1, r(x) / q_k(x)); on a rejection
  r becomes max(r - q_k, 0), normalised, and the next sibling is tried. The first accepted sibling
  becomes the slot to continue from; when all are rejected (or there are none) the committed
  token is drawn from r: recovered after a rejection, bonus where the slot had no children.
- q_k depends on how the siblings were drafted (`Drafting`): "iid" (each drawn independently
  from q[s]): q_k = q[s]; "distinct" (drawn from q[s] without replacement): q_k = q[s] with
  the earlier siblings' tokens removed, renormalised; "point" (deterministic candidates, q None):
  q_k = the point mass on x, so x is accepted with probability r(x) and a rejection removes x
  from r. Each committed token is distributed as the target would sample it: a rejected test
  leaves r(x) - min(r(x), q_k(x)) of every token, which is the residual the next stage must
  produce, whatever sibling was drawn (SpecInfer, Miao et al. 2024; Recursive Speculative
  Decoding, Jeon et al. 2024, for drafting without replacement).
- Greedy rows follow the child whose token is argmax p[s] (the first such sibling), and commit
  argmax p[s] where none is: the longest path matching the target's argmax.

`sibling_test` is the one formula of the algorithm; the exact tests compute branch
probabilities with it. Randomness is separated from logic as in rejection.py: per row, one
float64 uniform for the final draw, then one per node in node order (a node never reached
leaves its uniform unused), so the output is a function of the uniforms.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from .rejection import accept_probability, categorical_from_uniform, residual_mass

Drafting = Literal["iid", "distinct", "point"]


@dataclass(frozen=True)
class DraftTree:
    """One row's proposals; see the module docstring."""

    parents: tuple[int, ...]  # [n] parent node of each node, -1 = the root slot; parents[i] < i
    tokens: tuple[int, ...]  # [n] the token each node proposes
    drafting: Drafting = "point"

    def __post_init__(self):
        if len(self.parents) != len(self.tokens):
            raise ValueError(f"a tree needs one parent per token: {len(self.parents)} parents, {len(self.tokens)} tokens")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i}: parent {parent} must be -1 (the root) or an earlier node")
        if self.drafting not in ("iid", "distinct", "point"):
            raise ValueError(f"drafting must be 'iid', 'distinct' or 'point', got {self.drafting!r}")

    @property
    def size(self) -> int:
        return len(self.tokens)

    def children(self, slot: int) -> list[int]:
        """Nodes whose parent is at `slot` (0: the root, i + 1: node i), in the order tried."""
        return [i for i, parent in enumerate(self.parents) if parent + 1 == slot]

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root down to `node`, inclusive."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def sibling_test(r: torch.Tensor, q_k: torch.Tensor, x: int) -> tuple[float, torch.Tensor]:
    """One sibling's test: ([V] running target r, [V] its proposal distribution q_k, its token x)
    -> (the probability x is accepted, the running target after a rejection). Both r and q_k sum
    to 1; the residual falls back to r where max(r - q_k, 0) has no mass (r = q_k: x is then
    accepted for certain, so the fallback is never drawn from)."""
    accept = float(accept_probability(r[x], q_k[x]))
    residual = residual_mass(r, q_k)
    return accept, residual / residual.sum()


def sibling_proposals(tree: DraftTree, q_slot: torch.Tensor | None, siblings: Sequence[int],
                      vocab: int) -> list[torch.Tensor]:
    """q_k for each sibling in `siblings` (nodes of one slot, in order): see `Drafting`."""
    out = []
    if tree.drafting == "point" or q_slot is None:
        for node in siblings:
            point = torch.zeros(vocab, dtype=torch.float64)
            point[tree.tokens[node]] = 1.0
            out.append(point)
        return out
    q = q_slot.to(torch.float64)
    for node in siblings:
        out.append(q)
        if tree.drafting == "distinct":
            q = q.clone()
            q[tree.tokens[node]] = 0.0
            total = float(q.sum())
            q = q / total if total > 0 else q
    return out


def tree_sample_from_uniforms(
    tree: DraftTree,
    target_probs: torch.Tensor,  # [n+1, V] p at each slot
    draft_probs: torch.Tensor | None,  # [n+1, V] q at each slot (rows of leaves unused); None with "point"
    u_accept: Sequence[float],  # [n] float64 in [0, 1): node i accepted iff u_accept[i] < its test's probability
    u_recover: float,  # the final draw's inverse-CDF uniform
    greedy: bool = False,
) -> tuple[list[int], int]:
    """The accepted path (node indices, root first) and the recovered or bonus token after it:
    the committed tokens are [tree.tokens[i] for i in path] + [token]."""
    n, vocab = tree.size, target_probs.shape[-1]
    if target_probs.shape[0] != n + 1:
        raise ValueError(f"target_probs must be [n+1, V] = [{n + 1}, V], got {list(target_probs.shape)}")
    if tree.drafting != "point" and (draft_probs is None or draft_probs.shape != target_probs.shape):
        raise ValueError(f"drafting {tree.drafting!r} needs draft_probs of shape {list(target_probs.shape)}")
    path: list[int] = []
    slot = 0
    while True:
        siblings = tree.children(slot)
        if greedy:
            best = int(target_probs[slot].argmax())
            match = next((c for c in siblings if tree.tokens[c] == best), None)
            if match is None:
                return path, best
            path.append(match)
            slot = match + 1
            continue
        r = target_probs[slot].to(torch.float64)
        r = r / r.sum()
        q_slot = draft_probs[slot] if draft_probs is not None else None
        accepted = None
        for node, q_k in zip(siblings, sibling_proposals(tree, q_slot, siblings, vocab)):
            accept, residual = sibling_test(r, q_k, tree.tokens[node])
            if float(u_accept[node]) < accept:
                accepted = node
                break
            r = residual
        if accepted is None:
            token = categorical_from_uniform(r[None, :], torch.tensor([u_recover], dtype=torch.float64))
            return path, int(token[0])
        path.append(accepted)
        slot = accepted + 1


def tree_rejection_sample(
    tree: DraftTree,
    target_probs: torch.Tensor,  # [n+1, V]
    draft_probs: torch.Tensor | None,  # [n+1, V] or None
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> tuple[list[int], int]:
    """`tree_sample_from_uniforms` with its uniforms drawn from `generator` (greedy draws none)."""
    if greedy:
        return tree_sample_from_uniforms(tree, target_probs, draft_probs, [1.0] * tree.size, 1.0, greedy=True)
    u = torch.rand(tree.size + 1, dtype=torch.float64, generator=generator)
    return tree_sample_from_uniforms(tree, target_probs, draft_probs, u[1:].tolist(), float(u[0]))
