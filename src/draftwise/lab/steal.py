"""The hypervisor's share of the machine's CPU time during a run: Linux's `steal` in /proc/stat,
time a virtual CPU was ready to run but the host ran something else (a co-tenant). On a shared
cloud VM it is the visible part of why one run differs from the next: with an eighth of the CPU
time stolen, rounds of the same configs have spread by a factor of two. A report shows it beside
the figures; nothing is corrected by it (a stolen slice of one thread stalls the other at the
next barrier, so the loss is not the share itself)."""
from __future__ import annotations


def sample() -> tuple[int, int] | None:
    """(steal, total) clock ticks of all CPUs since boot, or None where /proc/stat has no steal."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal (guest is in user)
    return ticks[7], sum(ticks)


def share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the CPU time between two samples that was stolen (0..1), or None."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return max(0.0, after[0] - before[0]) / (after[1] - before[1])
