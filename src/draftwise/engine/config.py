"""Configuration of the engine and of speculation."""
from __future__ import annotations

from dataclasses import dataclass

from ..model.pair import draft_dtype_for  # noqa: F401 (moved to model/; the old import keeps working)
from ..policies import CostModel, policy_class


@dataclass
class SpecConfig:
    """`method`: a registered proposer name ("draft", "ngram", "suffix") or None for plain decoding.
    `policy`: a registered verification policy ("fixed", "adaptive", "goodput"); `profile`: the
    hardware profile JSON the goodput policy optimises against (None: the cached one for this
    model pair, measured on first use); `cost_model`: a `CostModel` given directly instead.
    `forced`: structured output's free proposals: the most tokens a constrained sequence may
    propose per round on top of its drafted ones where the grammar allows exactly one token
    (0: forced tokens only take drafted positions, saving draft forwards).
    `lookup`: "ngram" or "suffix" before a drafting method (proposers/lookup_first.py): rows whose
    lookup match is strong (its first proposal's estimate >= `lookup_min`) verify the lookup's
    proposals, up to `lookup_k` (0: k), the others the drafter's, up to k."""

    method: str | None = None
    k: int = 4
    ngram_max: int = 4
    ngram_min: int = 1
    suffix_depth: int = 24  # suffix decoding (proposers/suffix.py: what each parameter is for)
    suffix_spec_factor: float = 1.0
    suffix_min_prob: float = 0.1
    suffix_cache_tokens: int = 8192
    policy: str = "fixed"
    profile: str | None = None
    cost_model: CostModel | None = None
    forced: int = 16
    # draft model, dspark, eagle3: children per expanded node of a drafted tree of <= k nodes; suffix:
    # continuations kept per slot (0: chains)
    tree: int = 0
    lookup: str | None = None
    lookup_k: int = 0
    lookup_min: float = 0.75

    def __post_init__(self):
        if self.method in ("none", ""):
            self.method = None
        if self.method is not None and not 1 <= self.k <= 16:
            raise ValueError(f"k (proposals per round) must be in [1, 16], got {self.k}")
        if not 0 <= self.tree <= 16:
            raise ValueError(f"tree (children per expanded node) must be in [0, 16], got {self.tree}")
        if self.tree and not _drafts_trees(self.method):
            raise ValueError(f"tree needs --method draft, suffix, dspark or eagle3, got method "
                             f"{self.method or 'none'!r}")
        if self.lookup in ("none", ""):
            self.lookup = None
        if self.lookup is not None:
            from ..proposers.lookup_first import LOOKUPS

            if self.lookup not in LOOKUPS:
                raise ValueError(f"lookup must be one of {', '.join(LOOKUPS)}, got {self.lookup!r}")
            if self.method is None or self.method in LOOKUPS:
                raise ValueError(f"lookup {self.lookup} goes before a drafting method (draft, dspark, eagle3), "
                                 f"got method {self.method or 'none'!r}")
        if self.lookup_k and self.lookup is None:
            raise ValueError("lookup_k is the proposals per round of a lookup: give lookup (ngram or suffix) too")
        if not 0 <= self.lookup_k <= 64:
            raise ValueError(f"lookup_k (the lookup's proposals per round; 0: k) must be in [0, 64], "
                             f"got {self.lookup_k}")
        if not 0.0 <= self.lookup_min <= 1.0:
            raise ValueError(f"lookup_min (a lookup's first-proposal estimate that takes the row) must be in [0, 1], "
                             f"got {self.lookup_min}")
        if not 0 <= self.forced <= 64:
            raise ValueError(f"forced (free grammar proposals per round) must be in [0, 64], got {self.forced}")
        policy_class(self.policy)  # validates the name

    @property
    def max_draft(self) -> int:
        """The most proposals one sequence verifies per step: k (a lookup's lookup_k where larger), or 0
        without a method."""
        if not self.method:
            return 0
        return max(self.k, self.lookup_k) if self.lookup else self.k

    @property
    def max_forced(self) -> int:
        """The most grammar-forced proposals a constrained sequence verifies on top of max_draft."""
        return self.forced if self.method else 0


@dataclass
class EngineConfig:
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: from kv_cache_memory or the default budget (kv_sizing)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_max_tokens: int = 131072  # cap of the default pool size
    enable_prefix_caching: bool = True  # share full blocks of committed tokens between requests
    kv_cache_memory: int | str | None = None  # bytes or "2GiB" for the K/V pools; None: default budget
    recurrent_rollback: str = "snapshot"  # hybrid targets: snapshot | replay (model/recurrent_state.py)
    # plain decoding (no speculative method) of a lone greedy sequence with nothing waiting: up to
    # this many tokens a step in one kernel call (ModelRunner.greedy_steps; 1: one token a step)
    multi_step: int = 8

    def __post_init__(self):
        if self.kv_cache_memory is not None:
            from .kv_sizing import parse_memory

            parse_memory(self.kv_cache_memory)  # a bad size fails here, before any model loads
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.recurrent_rollback not in ("snapshot", "replay"):
            raise ValueError(f"recurrent_rollback must be snapshot or replay, got {self.recurrent_rollback!r}")
        if not 1 <= self.multi_step <= 64:
            raise ValueError(f"multi_step must be in [1, 64], got {self.multi_step}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


def _drafts_trees(method: str | None) -> bool:
    """Whether the proposer registered as `method` drafts trees (its class's `drafts_trees`)."""
    if method is None:
        return False
    from ..proposers import proposer_class

    try:
        return bool(getattr(proposer_class(method), "drafts_trees", False))
    except ValueError:
        return False
