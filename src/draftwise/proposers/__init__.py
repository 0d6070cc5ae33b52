"""Proposers (drafters): one protocol, a registry by method name, one file per method.

The built-in methods register themselves when imported here (the registry in base.py never
imports them, so there is no import circle)."""
from .base import DraftBlock, History, Proposer, available_methods, proposer_class, register_proposer
from . import cross_vocab, draft_model, dspark, eagle3, ngram, suffix  # noqa: F401  (registration)
from .cross_vocab import drafting_class, proposer_for

__all__ = ["DraftBlock", "History", "Proposer", "available_methods", "drafting_class", "proposer_class",
           "proposer_for", "register_proposer"]
