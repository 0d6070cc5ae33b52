"""Proposers (drafters): one protocol, a registry by method name, one file per method.

The built-in methods register themselves when imported here (the registry in base.py never
imports them, so there is no import circle)."""
from .base import DraftBlock, History, Proposer, available_methods, proposer_class, register_proposer
from . import draft_model, ngram, suffix  # noqa: F401  (registration)

__all__ = ["DraftBlock", "History", "Proposer", "available_methods", "proposer_class", "register_proposer"]
