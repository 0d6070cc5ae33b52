"""Give freed heap memory back to the operating system, now and then, in a long-running server.

Why: glibc's malloc keeps freed memory in its arenas. A serving process allocates activations and
logits whose sizes change every step (batch size x tokens), and glibc raises its mmap threshold
after the first large frees, so those buffers come from the heap, where freed holes stay resident.
On the embedded pair (products of 1..600 rows) `malloc_trim(0)` takes RSS from 1.9 GB to 0.7 GB;
without it a long-running server's RSS keeps climbing by such holes. `malloc_trim` walks the free lists and
returns whole free pages (also inside the heap, glibc >= 2.8); it takes a few milliseconds, so the
engine thread calls `maybe_trim` after each step and it trims at most once per `interval_s`, and
once more when the engine goes idle after work.

glibc also gives every thread that allocates its own arena (up to 8 per core), each keeping its
own high-water mark: the server's threads (engine, tokenizer pool, asyncio's executor, OpenMP
workers) come one after another, and each new arena can add 32 MB to RSS.
`draftwise serve` therefore caps the arenas (`limit_arenas(2)`, as MALLOC_ARENA_MAX=2 would) first
thing, before any thread allocates: glibc reads the limit once, when it first has to decide
whether a thread gets an arena of its own, so the call must come before the engine thread
(which loads the models) runs. With both, a server's RSS stays flat under a steady load
(`benchmarks/soak.py`).
Not glibc (musl, macOS) or trimming disabled: a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import time


M_ARENA_MAX = -8  # mallopt parameter (malloc.h)


def _libc_function(name: str):
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return getattr(libc, name)
    except (OSError, AttributeError):
        return None


def _malloc_trim():
    fn = _libc_function("malloc_trim")
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def limit_arenas(n: int) -> bool:
    """At most `n` malloc arenas from now on (threads share them); True when glibc took it."""
    fn = _libc_function("mallopt")
    if fn is None:
        return False
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn(M_ARENA_MAX, n) == 1


class HeapTrimmer:
    def __init__(self, interval_s: float = 10.0, clock=time.monotonic):
        self.interval_s = interval_s
        self._trim = _malloc_trim() if interval_s > 0 else None
        self._clock = clock
        self._last = clock()
        self.trims = 0
        self._dirty = False  # steps ran since the last trim

    @property
    def enabled(self) -> bool:
        return self._trim is not None

    def maybe_trim(self, idle: bool = False) -> bool:
        """After a step: trim if `interval_s` has passed since the last trim. `idle`: the engine is
        about to wait for work; trim if any step ran since the last trim. True when it trimmed."""
        if self._trim is None:
            return False
        if idle:
            if not self._dirty:
                return False
        else:
            self._dirty = True
            if self._clock() - self._last < self.interval_s:
                return False
        self._trim(0)
        self._last = self._clock()
        self._dirty = False
        self.trims += 1
        return True
