"""Proposers (drafters): one protocol, a registry by method name, one file per method."""
from .base import DraftBlock, Proposer, available_methods, create_proposer, proposer_class, register_proposer

__all__ = ["DraftBlock", "Proposer", "available_methods", "create_proposer", "proposer_class", "register_proposer"]
