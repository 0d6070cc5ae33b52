"""Figures of one (config, level) run, computed from per-request timestamps.

Definitions (times in seconds, reported in ms where named so):
- TTFT: first delivery - arrival (arrival = when the request was sent / was due in an open loop).
- ITL, time between committed tokens: the gaps between successive deliveries of one request.
  A speculative round that commits several tokens delivers them together: one gap, not several.
- TPOT: (E2E - TTFT) / (output tokens - 1), per request (requests with one token have none).
- E2E: last delivery - arrival.
- output tok/s and req/s: totals over the run's wall time (first arrival to last completion).
- goodput: completed requests/s that meet every given SLO (ttft, tpot, itl, e2e in ms; the ITL
  SLO applies to a request's p99 gap).
Percentiles use linear interpolation between order statistics (numpy's default).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..engine.stats import median_ratio
from .reliability import conditional_acceptance, reliability

SLO_KEYS = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestRecord:
    """One request as the client saw it. `deliveries`: (time, tokens) per streamed chunk."""

    id: str
    arrival: float
    deliveries: list[tuple[float, int]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)  # a server's tokens as strings (logprobs.tokens)
    text: str = ""
    prompt_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    committed_per_round: list[int] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.deliveries)

    @property
    def ttft(self) -> float | None:
        return self.deliveries[0][0] - self.arrival if self.deliveries else None

    @property
    def e2e(self) -> float | None:
        return self.deliveries[-1][0] - self.arrival if self.deliveries else None

    @property
    def itls(self) -> list[float]:
        t = [d[0] for d in self.deliveries]
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        if n < 2:
            return None
        return (self.e2e - self.ttft) / (n - 1)


def parse_slo(spec: str | None) -> dict[str, float]:
    """"ttft=500,tpot=50" -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    out = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        key, sep, val = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo entries must be KEY=MS with KEY in {', '.join(SLO_KEYS)}, got {part!r}")
        ms = float(val)
        if not ms > 0:
            raise ValueError(f"--slo {key} must be > 0 ms, got {val}")
        out[key] = ms
    return out


def distribution(values: list[float], scale: float = 1.0) -> dict:
    """mean, p50, p90, p99 (times `scale`), or Nones when there are no values."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=float) * scale
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def meets_slo(r: RequestRecord, slo: dict[str, float]) -> bool:
    if r.error or not r.deliveries:
        return False
    checks = {
        "ttft": r.ttft,
        "tpot": r.tpot if r.tpot is not None else 0.0,
        "e2e": r.e2e,
        "itl": float(np.percentile(r.itls, 99)) if r.itls else 0.0,
    }
    return all(checks[k] * 1000.0 <= ms for k, ms in slo.items())


def summarize(records: list[RequestRecord], wall: float, slo: dict[str, float] | None = None,
              dollars_per_hour: float | None = None) -> dict:
    """The latency/throughput figures of one run."""
    slo = slo or {}
    done = [r for r in records if not r.error and r.deliveries]
    out_tokens = sum(r.output_tokens for r in done)
    wall = max(wall, 1e-9)
    tok_s = out_tokens / wall
    good = [r for r in done if meets_slo(r, slo)]
    cost = None
    if dollars_per_hour is not None and tok_s > 0:
        cost = dollars_per_hour / 3600.0 / tok_s * 1e6
    return {
        "num_requests": len(records),
        "completed": len(done),
        "errors": len(records) - len(done),
        "error_examples": sorted({r.error or "no tokens" for r in records if r not in done})[:3],
        "wall_seconds": wall,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens_per_s": tok_s,
        "requests_per_s": len(done) / wall,
        "goodput_requests_per_s": len(good) / wall,
        "slo_attainment": len(good) / len(records) if records else None,
        "ttft_ms": distribution([r.ttft for r in done], 1000.0),
        "itl_ms": distribution([g for r in done for g in r.itls], 1000.0),
        "tpot_ms": distribution([r.tpot for r in done if r.tpot is not None], 1000.0),
        "e2e_ms": distribution([r.e2e for r in done], 1000.0),
        "tokens_per_delivery": out_tokens / max(1, sum(len(r.deliveries) for r in done)),
        "cost_per_million_output_tokens": cost,
    }


def speculation_figures(stats: dict, output_tokens: int) -> dict:
    """Acceptance and the time split per committed token from an `EngineStats` delta."""
    rounds = stats.get("rounds", 0)
    committed = stats.get("committed_tokens", 0)
    hist = {int(k): v for k, v in stats.get("committed_per_round", {}).items()}
    per_pos = stats.get("accepted_per_position", [])
    n = max(output_tokens, 1)
    draft_s, verify_s, other_s = (stats.get(k, 0.0) for k in ("propose_seconds", "verify_seconds", "other_seconds"))
    proposed = stats.get("draft_tokens", 0)
    verified = stats.get("verified_tokens", proposed)  # servers without a policy verify what they propose
    vhist = {int(k): v for k, v in stats.get("verified_per_round", {}).items()}
    decode_steps = stats.get("decode_steps", 0)
    measured, predicted = stats.get("measured_seconds", 0.0), stats.get("predicted_seconds", 0.0)
    steps, grammar_s = stats.get("steps", 0), stats.get("grammar_seconds", 0.0)
    reached, passed = stats.get("reached_per_position", []), stats.get("passed_per_position", [])
    conf = {k: stats.get(f"confidence_{k}", {}) for k in ("reached", "passed", "sum")}
    return {
        "rounds": rounds,
        "proposed_tokens": proposed,
        "verified_tokens": verified,
        "accepted_tokens": stats.get("accepted_tokens", 0),
        "mean_accepted_length": committed / rounds if rounds else None,
        "acceptance_rate": stats["accepted_tokens"] / verified if verified else None,
        # the verification policy: lengths verified per round, share of rounds and steps that speculated
        "verified_per_round": dict(sorted(vhist.items())),
        "rounds_speculating": (rounds - vhist.get(0, 0)) / rounds if rounds and vhist else None,
        "steps_speculating": stats.get("speculative_steps", 0) / decode_steps if decode_steps else None,
        "prefix_cache_hit_rate": (stats.get("prefix_cache_hit_tokens", 0) / stats["prefix_cache_queried_tokens"]
                                  if stats.get("prefix_cache_queried_tokens") else None),
        "draft_prefix_cache_hit_rate": (stats.get("draft_prefix_cache_hit_tokens", 0)
                                        / stats["draft_prefix_cache_queried_tokens"]
                                        if stats.get("draft_prefix_cache_queried_tokens") else None),
        # the cost model's predicted step time against the clock (goodput policy): median and total ratio
        "step_time_measured_over_predicted": {
            "median": median_ratio(stats.get("step_time_ratio", {})),
            "median_profile_only": median_ratio(stats.get("step_time_ratio_profile", {})),
            "total": measured / predicted if predicted else None,
        },
        # fraction of rounds whose j-th proposal was accepted
        "acceptance_by_position": [a / rounds for a in per_pos] if rounds else [],
        # chain rounds: P(j-th accepted | it was verified and every one before it accepted)
        "conditional_acceptance_by_position": conditional_acceptance(reached, passed),
        # the drafter's per-position confidence against that acceptance (None: it gave none)
        "confidence_reliability": reliability(conf["reached"], conf["passed"], conf["sum"]),
        "position_counts": {"reached": list(reached), "passed": list(passed), "confidence": conf},
        # engine time per step (prefill steps included) and the grammar work in it (structured output)
        "step_ms": 1000.0 * (draft_s + verify_s + other_s) / steps if steps else None,
        "grammar_ms_per_step": 1000.0 * grammar_s / steps if steps and grammar_s else None,
        "committed_per_round": dict(sorted(hist.items())),
        "ms_per_token": {
            "drafting": 1000.0 * draft_s / n,
            "verification": 1000.0 * verify_s / n,
            "scheduling_state": 1000.0 * other_s / n,
            "total": 1000.0 * (draft_s + verify_s + other_s) / n,
            "grammar": 1000.0 * stats.get("grammar_seconds", 0.0) / n,  # part of drafting + verification
            "rollback": 1000.0 * stats.get("rollback_seconds", 0.0) / n,  # hybrid targets; part of scheduling_state
        },
    }


def stats_delta(before: dict, after: dict) -> dict:
    """after - before for the numeric, list and dict fields of an EngineStats snapshot."""
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, (int, float)):
            out[k] = v - (b or 0)
        elif isinstance(v, list):  # a list that grew (per-position counts past k) is padded with 0
            b = list(b or []) + [0] * max(0, len(v) - len(b or []))
            out[k] = [x - y for x, y in zip(v, b)]
        elif isinstance(v, dict):
            b = b or {}
            out[k] = {kk: vv - b.get(kk, 0) for kk, vv in v.items() if vv - b.get(kk, 0)}
    return out
