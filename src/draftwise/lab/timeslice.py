"""Time-sliced runs: several in-process engines' runs advanced together in one thread, a few
milliseconds each in turn, each timed on a clock of its own that runs only during its slices.

    draftwise bench --time-slice 50 ...

Why: a shared VM's speed drifts on the scale of seconds (a fixed matmul loop on a 2-vCPU cloud
machine keeps its rate correlated over about a second, not over five). Two runs of the same work
back to back, a few seconds each (the lab's rounds), then differ by ~10%, while the same two
alternated every 0.1 s differ by ~1%: the drift hits both alike. So configs whose runs are sliced
together meet the same machine, and their ratio is measured with far less noise than rounds run
one after the other.

- `SliceClock`: a run's clock. It stands still while other runs hold the CPU (`pause`/`resume`),
  so every timestamp of a run (arrivals, deliveries, its wall time) is in its own engine time:
  as if it had run alone. An open-loop run that waits for its next arrival jumps its clock there
  (`wait_until`) instead of sleeping: idle time is free and costs the other runs nothing.
- `WallClock`: the real clock (`time.perf_counter`, `time.sleep`): a run alone.
- `run_sliced`: drives the runs' step generators (`EngineBackend.steps`) round robin, each for
  `slice_s` seconds at a time (at least one step), until all have finished; returns their results.

What slicing changes: the engines share the CPU's caches between slices (a slice of 50 ms is tens
of decode steps; the first step of a slice may find the other engine's data in cache), and the
process's memory high-water mark is the round's, not one config's.
"""
from __future__ import annotations

import random
import time
from typing import Generator, Sequence


class WallClock:
    """Real time: the run has the machine to itself."""

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    @staticmethod
    def wait_until(t: float) -> None:
        time.sleep(max(0.0, t - time.perf_counter()))


class SliceClock:
    """A run's own time: advances with the wall clock while the run holds its slice, stands still
    while paused; `wait_until` jumps forward without waiting. Starts paused at 0."""

    def __init__(self):
        self._frozen: float | None = 0.0
        self._offset = 0.0

    def now(self) -> float:
        return self._frozen if self._frozen is not None else time.perf_counter() - self._offset

    def pause(self) -> None:
        if self._frozen is None:
            self._frozen = self.now()

    def resume(self) -> None:
        if self._frozen is not None:
            self._offset = time.perf_counter() - self._frozen
            self._frozen = None

    def wait_until(self, t: float) -> None:
        gap = t - self.now()
        if gap <= 0:
            return
        if self._frozen is not None:
            self._frozen += gap
        else:
            self._offset -= gap


def drain(gen: Generator):
    """Run a step generator to its end; its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


def run_sliced(runs: Sequence[tuple[Generator, SliceClock]], slice_s: float) -> list:
    """Advance every (generator, its clock) in turn for `slice_s` wall seconds (at least one step
    each turn) until all have returned; their return values in order. Each pass takes the live runs
    in an order of its own (a seeded shuffle), so that over the passes each run starts its slices
    after every other run alike. In a fixed order a run always starts where the same other run left
    the caches, and a config listed right after one with the same drafter (an A/A copy) found that
    drafter's weights warm: with the embedded DSpark drafter both copies after the first ran 4%
    faster than it (one run, code-easy); alternating the direction of the passes still gave the
    last-listed run two slices in a row at every turn."""
    if not slice_s > 0:
        raise ValueError(f"time slice must be > 0 s, got {slice_s}")
    results: list = [None] * len(runs)
    live = list(range(len(runs)))
    order = random.Random(0)  # each pass's order (seeded: the same runs slice the same way)
    while live:
        for i in order.sample(live, len(live)):
            gen, clock = runs[i]
            clock.resume()
            end = time.perf_counter() + slice_s
            try:
                while True:
                    next(gen)
                    if time.perf_counter() >= end:
                        break
            except StopIteration as done:
                results[i] = done.value
                live.remove(i)
            finally:
                clock.pause()
    return results
