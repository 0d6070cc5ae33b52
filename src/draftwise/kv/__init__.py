"""Paged K/V cache bookkeeping: a block pool and per-sequence block tables, one set per model."""
from .block_pool import BlockPool, OutOfBlocks
from .kv_manager import KVManager
from .pool_tensor import pool_tensor

__all__ = ["BlockPool", "OutOfBlocks", "KVManager", "pool_tensor"]
