"""How steady the machine is: a fixed float32 matmul (512x2048 by 2048x2048) timed in windows of
0.5 s for a minute; prints each window's rate over the median's.

    .venv/bin/python benchmarks/machine_noise.py [--seconds 60] [--threads 2]

On the shared 2-vCPU machines here the rate drifts over seconds (0.88-1.09x the median within a
minute, alone on the machine, session 22): more than the 3% the lab's goals compare.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    a, b = torch.randn(512, 2048), torch.randn(2048, 2048)
    rates = []
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        t, n = time.perf_counter(), 0
        while time.perf_counter() - t < 0.5:
            a @ b
            n += 1
        rates.append(n / (time.perf_counter() - t))
    med = statistics.median(rates)
    print(" ".join(f"{r / med:.2f}" for r in rates))
    print(f"min {min(rates) / med:.2f}x, max {max(rates) / med:.2f}x the median over {len(rates)} windows")


if __name__ == "__main__":
    main()
