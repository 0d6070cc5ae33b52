"""How this machine's speed drifts, and what that does to A/A comparisons at different time scales.

    .venv/bin/python benchmarks/machine_noise.py [--seconds 60] [--block 0.1] [--threads 2]

Runs a fixed piece of work (a chain of 20 float32 1024x1024 matmuls on 8 rows, about the weight
reads of a small model's decode step) over and over for --seconds and records its rate in blocks
of --block seconds. Prints the log rate's sd and autocorrelation at several lags, then the sd of
the log ratio of two identical workloads measured (a) back to back in blocks of 0.1-5 s (what
the lab's rounds, one config after another, see) and (b) alternated block by block and summed over
windows of 1-10 s (what `draftwise bench --time-slice` sees). Nothing in the work changes: every
difference is the machine's.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch


def autocorrelation(v: list[float], lag: int) -> float:
    m = statistics.fmean(v)
    s = sum((a - m) ** 2 for a in v)
    return sum((v[i] - m) * (v[i + lag] - m) for i in range(len(v) - lag)) / s if s else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--block", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    weights = [torch.randn(1024, 1024) for _ in range(20)]
    x = torch.randn(8, 1024)

    def work() -> None:
        y = x
        for w in weights:
            y = y @ w

    rates = []
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < args.block:
            work()
            n += 1
        rates.append(n / (time.perf_counter() - t0))
    lr = [math.log(r) for r in rates]
    print(f"{len(rates)} blocks of {args.block:g} s: median {statistics.median(rates):.1f} work/s, "
          f"sd of log rate {statistics.pstdev(lr):.3f}")
    for lag_s in (0.1, 0.2, 0.5, 1, 2, 5, 10):
        lag = round(lag_s / args.block)
        if 1 <= lag < len(lr) // 2:
            print(f"  autocorrelation at {lag_s:g} s: {autocorrelation(lr, lag):+.2f}")
    print("A/A, back to back (block of A, then block of B): sd of log(B/A)")
    for span in (0.1, 0.5, 1, 3, 5):
        b = max(1, round(span / args.block))
        pairs = [statistics.fmean(lr[i:i + b]) - statistics.fmean(lr[i + b:i + 2 * b])
                 for i in range(0, len(lr) - 2 * b + 1, 2 * b)]
        if len(pairs) >= 3:
            print(f"  blocks of {span:g} s: {statistics.pstdev(pairs):.3f} ({len(pairs)} pairs)")
    print(f"A/A, alternated every {args.block:g} s, summed over a window: sd of log(B/A)")
    for window in (1, 5, 10):
        n = max(2, round(window / args.block))
        vals = [statistics.fmean(lr[s:s + n][0::2]) - statistics.fmean(lr[s:s + n][1::2])
                for s in range(0, len(lr) - n + 1, n)]
        if len(vals) >= 3:
            print(f"  windows of {window:g} s: {statistics.pstdev(vals):.3f} ({len(vals)} windows)")


if __name__ == "__main__":
    main()
