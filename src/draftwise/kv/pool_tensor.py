"""The tensor that holds a model's K/V pool, allocated after freed heap memory goes back to the
operating system.

Why: loading a model frees hundreds of MB of temporaries (the file's bytes as read, blocks
re-quantised for a cheaper draft, a pruned head) that glibc keeps resident in its arenas, above
all in the arena of the thread that loaded it (a server loads on its engine thread). The pool,
resident from the start (engine/kv_sizing.py), then stacked on top of them: the Qwen2.5-Coder
pair with the int4 draft peaked at 4.0 GiB while building its engine on a thread, 2.9 GiB with
`malloc_trim` first. Not glibc (musl, macOS): allocated as it is.
"""
from __future__ import annotations

import ctypes

import torch


def release_free_heap() -> None:
    """glibc's `malloc_trim(0)`: every arena's free pages back to the system (a few ms)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)


def pool_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed `[layers, 2, slots, kv_heads, head_dim]` pool; on CPU after `release_free_heap`."""
    if torch.device(device).type == "cpu":
        release_free_heap()
    return torch.zeros(shape, dtype=dtype, device=device)
