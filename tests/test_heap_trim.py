"""server/heap.py: the engine thread gives freed heap memory back at most once per interval and
once when it goes idle after work."""

import pytest

from draftwise.server.heap import HeapTrimmer


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_interval_and_idle():
    clock = Clock()
    h = HeapTrimmer(10.0, clock=clock)
    if not h.enabled:
        pytest.skip("no malloc_trim in this C library")
    assert not h.maybe_trim(idle=True)  # nothing ran yet
    assert not h.maybe_trim()  # a step, too soon
    clock.t = 10.5
    assert h.maybe_trim()  # a step after the interval
    assert not h.maybe_trim(idle=True)  # nothing since
    clock.t = 11
    assert not h.maybe_trim()
    assert h.maybe_trim(idle=True)  # a step ran since the last trim
    assert not h.maybe_trim(idle=True)
    assert h.trims == 2


def test_disabled():
    h = HeapTrimmer(0)
    assert not h.enabled and not h.maybe_trim() and not h.maybe_trim(idle=True)


def test_limit_arenas_is_accepted():
    from draftwise.server.heap import _malloc_trim, limit_arenas

    if _malloc_trim() is None:
        pytest.skip("not glibc")
    assert limit_arenas(8)  # glibc's own default on this machine's scale: harmless in the test process
