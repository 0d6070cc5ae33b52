"""The `Proposer` protocol, the `DraftBlock` it returns, and the registry of methods by name.

A proposer looks only at committed history (prompt + accepted output) and proposes up to `k`
tokens per sequence. `probs` is q, the drafter's processed distribution at each proposed position
(`[k, vocab]`), or None for drafters without one (a point mass, e.g. n-gram lookup). A new method
is a new file that registers itself here; the engine never branches on the method name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from ..engine.sequence import Sequence
from ..kv import KVManager


@dataclass
class DraftBlock:
    token_ids: list[int]  # [k_b] proposed tokens
    probs: torch.Tensor | None  # [k_b, vocab] q at each proposed position, or None (point mass)


class Proposer(Protocol):
    """Constructed with keyword context: target, draft (LoadedModel or None), num_blocks,
    block_size, eos_ids, and the SpecConfig fields; each method takes what it needs."""

    name: str
    needs_draft_model: bool  # the engine must be given a draft model directory
    kv: KVManager | None  # the drafter's own paged cache, if it has one
    max_model_len: int | None  # the drafter's context limit, if any

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[DraftBlock]:
        """Up to ks[i] tokens for seqs[i]. May write scratch K/V; must not change `seqs`."""

    def postprocess(self, seq: Sequence, block: DraftBlock, num_accepted: int, num_tokens_before: int) -> None:
        """After verification: roll the drafter's own state back to the committed path."""


_REGISTRY: dict[str, Callable[..., Proposer]] = {}


def register_proposer(name: str):
    def deco(cls):
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return deco


def available_methods() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def proposer_class(method: str):
    _load_builtins()
    if method not in _REGISTRY:
        raise ValueError(f"speculative method must be one of {', '.join(sorted(_REGISTRY))} or none, got {method!r}")
    return _REGISTRY[method]


def create_proposer(method: str, **kwargs) -> Proposer:
    return proposer_class(method)(**kwargs)


def _load_builtins() -> None:
    from . import draft_model, ngram  # noqa: F401  (registration side effect)
