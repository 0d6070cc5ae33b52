"""How requests arrive: a closed loop (keep N in flight) or an open loop (timed arrivals).

Open-loop gaps are gamma distributed with shape = burstiness and mean = 1/rate, so the
coefficient of variation of the gaps is 1/sqrt(burstiness): burstiness 1 is a Poisson process,
below 1 burstier, above 1 more regular (the convention of vLLM's benchmark_serving).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LoadLevel:
    """One operating point: `kind` "concurrency" (closed loop, value = requests in flight) or
    "rate" (open loop, value = mean requests/s, with `burstiness`)."""

    kind: str
    value: float
    burstiness: float = 1.0

    @property
    def label(self) -> str:
        if self.kind == "concurrency":
            return f"c={int(self.value)}"
        return f"rate={self.value:g}" + (f",b={self.burstiness:g}" if self.burstiness != 1.0 else "")

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "value": self.value}
        if self.kind == "rate":
            d["burstiness"] = self.burstiness
        return d


def gamma_gaps(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """n inter-arrival gaps in seconds: Gamma(shape=burstiness, scale=1/(rate*burstiness))."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Offsets from the start of the run; the first request arrives at 0."""
    if n == 0:
        return []
    gaps = gamma_gaps(n - 1, rate, burstiness, seed)
    return [0.0] + np.cumsum(gaps).tolist()


def parse_levels(concurrency: str | None, rates: str | None, burstiness: float = 1.0) -> list[LoadLevel]:
    levels = []
    for tok in (concurrency or "").split(","):
        if tok.strip():
            c = int(tok)
            if c < 1:
                raise ValueError(f"--concurrency values must be >= 1, got {c}")
            levels.append(LoadLevel("concurrency", c))
    for tok in (rates or "").split(","):
        if tok.strip():
            r = float(tok)
            if not r > 0:
                raise ValueError(f"--request-rate values must be > 0, got {r}")
            levels.append(LoadLevel("rate", r, burstiness))
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    return levels
