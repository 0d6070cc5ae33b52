"""The `Proposer` protocol, the `DraftBlock` it returns, the `History` it reads, and the registry.

A proposer looks only at a sequence's committed history (prompt + accepted output) and proposes
up to `num_draft` tokens for it. `probs` is q, the drafter's processed distribution at each
proposed position (`[num_draft, vocab]`), or None for drafters without one (a point mass, e.g.
n-gram lookup). A drafter that branches returns a tree instead (`parents`, as
sampling/tree.py's `DraftTree`: node i proposes token_ids[i] after node parents[i], -1 = after the
committed context); then `probs` is q per slot (`[num_draft + 1, vocab]`: slot 0 the root, slot
i + 1 after node i) or None, and `drafting` says how siblings were drawn. A new method is a new file that registers itself with `register_proposer`; the
package's `__init__` imports the built-in ones, and the engine never branches on the method name.

Proposers sit below the engine: they read sequences through the `History` protocol (which the
engine's `Sequence` satisfies) and never import engine/.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

from ..kv import KVManager
from ..registry import Registry
from ..sampling import SamplingParams


@dataclass
class DraftBlock:
    token_ids: list[int]  # [num_draft] proposed tokens
    probs: torch.Tensor | None  # [num_draft, vocab] q at each proposed position, or None (point mass)
    # [num_draft] how far to trust proposal j: max_x q_j(x) (a function of q_j only), or for a drafter
    # whose proposals are a function of the history (n-gram lookup), a function of the history and
    # x_1..x_{j-1} (e.g. the match length); None: unknown
    confidence: list[float] | None = None
    forced_done: bool = False  # the proposer found that the grammar forces no token after the block
    # a tree: [num_draft] parent node of each proposal (-1: the committed context; parents[i] < i),
    # siblings in the order verification tries them; None: a chain (proposal j after j - 1)
    parents: tuple[int, ...] | None = None
    drafting: str = "point"  # a tree's siblings: "iid", "distinct" or "point" (sampling/tree.py)
    # a chain taken along a tree's accepted path (`along`): the tree node of each token
    nodes: tuple[int, ...] | None = None

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def truncated(self, n: int) -> "DraftBlock":
        """The first n proposals (what a verification policy admits); of a tree, its first n nodes
        (a tree again: parents come first)."""
        if n >= len(self.token_ids):
            return self
        conf = None if self.confidence is None else self.confidence[:n]
        if self.parents is not None:
            return DraftBlock(self.token_ids[:n], None if self.probs is None else self.probs[: n + 1], conf,
                              parents=self.parents[:n], drafting=self.drafting)
        return DraftBlock(self.token_ids[:n], None if self.probs is None else self.probs[:n], conf)

    def along(self, path: list[int]) -> "DraftBlock":
        """A tree's accepted path (node indices, root first) as a chain: what the drafter and the
        policy learn from after verification (`nodes` says which tree nodes they were)."""
        conf = None if self.confidence is None else [self.confidence[i] for i in path]
        return DraftBlock([self.token_ids[i] for i in path], None, conf, nodes=tuple(path))

    def main_chain(self) -> "DraftBlock":
        """A tree's first-child path from the root, as a chain (`nodes`: its tree nodes): where a
        tree cannot be verified (a constrained row) and what a per-position policy calibrates on.
        Exact as a chain: a first sibling is a draw from q at its slot (or a point mass)."""
        path, slot = [], -1
        while True:
            child = next((i for i in range(slot + 1, len(self.token_ids)) if self.parents[i] == slot), None)
            if child is None:
                break
            path.append(child)
            slot = child
        probs = None if self.probs is None else self.probs[[0] + [i + 1 for i in path[:-1]]] if path else None
        conf = None if self.confidence is None else [self.confidence[i] for i in path]
        return DraftBlock([self.token_ids[i] for i in path], probs, conf, nodes=tuple(path))

    def extended(self, forced: list[int], vocab: int) -> "DraftBlock":
        """The block followed by grammar-forced proposals: q a point mass, confidence 1 (a chain's
        only: constrained rows draft chains)."""
        if not forced:
            return self
        if self.parents is not None:
            raise ValueError("grammar-forced proposals extend chains only")
        probs = self.probs
        if probs is not None:
            probs = torch.cat([probs, torch.nn.functional.one_hot(torch.tensor(forced), vocab).to(probs.dtype)])
        conf = None if self.confidence is None else self.confidence + [1.0] * len(forced)
        return DraftBlock(self.token_ids + forced, probs, conf)


class History(Protocol):
    """What a proposer may read of a sequence (the engine's `Sequence` satisfies it)."""

    seq_id: int
    prompt_ids: list[int]
    output_ids: list[int]  # committed output
    params: SamplingParams
    generator: torch.Generator | None  # the request's seeded generator, if any
    draft_computed: int  # positions of the drafter's own cache that are valid (owned by the proposer)
    grammar: object | None  # a structured-output request's GrammarState (propose under its mask), or None

    @property
    def all_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...


class Proposer(Protocol):
    """Constructed with keyword context: target, draft (LoadedModel or None), num_blocks,
    block_size, eos_ids, and the SpecConfig fields; each method takes what it needs."""

    name: str
    needs_draft_model: bool  # the engine must be given a draft model directory
    kv_pool_factor: int  # a draft model's pool: blocks per block of the target's (the K/V budget counts them)
    kv: KVManager | None  # the drafter's own paged cache, if it has one
    # the target layers whose outputs the drafter reads (() : none). When set, the target's forwards
    # return them and the engine hands each sequence's committed rows to `commit_features`
    feature_layers: tuple[int, ...]

    def propose(self, seqs: list[History], num_draft: list[int], num_forced: list[int] | None = None) -> list[DraftBlock]:
        """Up to num_draft[i] tokens for seqs[i]. May write scratch K/V; must not change `seqs`.
        A constrained sequence may add up to num_forced[i] grammar-forced tokens on top (the
        engine appends the forced tail after the block itself; a proposer may ignore this)."""

    def postprocess(self, seq: History, block: DraftBlock, num_accepted: int, num_tokens_before: int) -> None:
        """After verification: roll the drafter's own state back to the committed path."""

    def commit_features(self, seq: History, start: int, features: torch.Tensor) -> None:
        """Only for a proposer with `feature_layers`: the target's features of seq's committed
        positions start .. start + n - 1 (`features [n, len(feature_layers) * hidden]`), in order:
        a prefill chunk's rows, a verification's [last committed, accepted proposals]. (Such a
        proposer may also have `stage_features(features)`: the step's fed rows of every sequence,
        seq_id -> (first position, rows), handed right after the forward, before the commits.)"""

    def finish(self, seq: History) -> None:
        """The sequence ended (finished, aborted or failed): drop what the drafter keeps for it (a
        drafter that learns across requests may keep its committed output)."""


class StepCost(Protocol):
    """A step's predicted seconds (policies/cost.py's `OnlineCost` satisfies it)."""

    def tokens_seconds(self, num_seqs: int, context: float) -> Callable[[int], float]:
        """Seconds of a decode step of num_seqs rows at this mean context, as a function of the tokens fed."""


@runtime_checkable
class StepCosted(Protocol):
    """A proposer that sizes its drafts by what a verified row costs: the engine hands it the step
    cost model, and after verification what each drafted block had verified and accepted (of a
    tree: its first num_verified nodes, `path` the accepted nodes)."""

    def set_step_cost(self, cost: StepCost) -> None: ...

    def observe_verified(self, seq: History, block: DraftBlock, num_verified: int, num_accepted: int,
                         path: list[int] | None = None) -> None: ...


@runtime_checkable
class TargetSlotted(Protocol):
    """A drafter on the target's features whose cache of committed positions is a function of the
    committed tokens up to each position only (DSpark's context K/V): it keeps its rows at the
    target's own slots (`use_target_slots`, the target's `KVManager`) instead of a pool of its own,
    so a prefix-cache hit of the target brings the drafter's rows of that prefix with it. `kv` is
    then None (the scheduler reserves target slots only)."""

    def use_target_slots(self, kv: KVManager) -> None: ...


METHODS = Registry("speculative method", " or none")
register_proposer = METHODS.register
available_methods = METHODS.names
proposer_class = METHODS.get
