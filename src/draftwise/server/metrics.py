"""`/metrics`: Prometheus collectors over the engine's counters, in their own registry.

Names are prefixed `draftwise:` (as vLLM's are `vllm:`). Everything is read at scrape time from
the `Snapshot` the engine thread publishes after each step, plus two counts of outcomes:

- `draftwise:requests_total{outcome}`: HTTP requests, each counted once (`Outcomes`): `rejected`
  (answered 4xx/429 before reaching the engine), `error` (answered 500, or a stream that ended
  with an error), `abort` (the client left, or shutdown cut it), else `length` if any choice
  hit max_tokens, else `stop`;
- `draftwise:request_choices_total{outcome}`: engine requests (one per choice: prompts x n) by
  how they finished: stop, length, abort, error.

Two histograms are observed as choices finish: time to first token and end-to-end latency, both
measured inside the engine (from `add_request`).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .async_engine import AsyncEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Outcomes:
    """HTTP requests by outcome, each counted once (event-loop side)."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def record(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1


def request_outcome(finish_reasons: list[str | None]) -> str:
    """One outcome for a request from its choices' finish reasons: error > abort > length > stop."""
    for outcome in ("error", "abort", "length"):
        if outcome in finish_reasons:
            return outcome
    return "stop" if all(r == "stop" for r in finish_reasons) else "unknown"


class EngineCollector:
    def __init__(self, engine: AsyncEngine, model_name: str, outcomes: Outcomes):
        self.engine = engine
        self.model_name = model_name
        self.outcomes = outcomes

    def collect(self):
        eng = self.engine
        snap = eng.snapshot
        st = snap.stats
        m = ["model_name"]
        v = [self.model_name]

        c = CounterMetricFamily("draftwise:requests", "HTTP requests by outcome, each counted once.",
                                labels=m + ["outcome"])
        for outcome, n in sorted(self.outcomes.counts.items()):
            c.add_metric(v + [outcome], n)
        yield c

        c = CounterMetricFamily("draftwise:request_choices", "Engine requests (one per choice) by how they finished.",
                                labels=m + ["outcome"])
        for outcome, n in sorted(eng.outcomes.items()):
            c.add_metric(v + [outcome], n)
        yield c

        for name, doc, val in (
            ("num_requests_waiting", "Requests queued in the server or the engine, not running yet.",
             eng.num_queued),
            ("num_requests_running", "Sequences in the engine's running set.", snap.running),
        ):
            g = GaugeMetricFamily(f"draftwise:{name}", doc, labels=m)
            g.add_metric(v, val)
            yield g

        for state in ("used", "free"):
            g = GaugeMetricFamily(f"draftwise:kv_blocks_{state}", f"KV cache blocks {state}.", labels=m + ["model"])
            for which, pool in snap.kv.items():
                if pool is not None:
                    g.add_metric(v + [which], pool[state])
            yield g

        for key, name, doc in (
            ("preemptions", "num_preemptions", "Sequences preempted (recomputed) for lack of KV blocks."),
            ("prompt_tokens", "prompt_tokens", "Prompt tokens received."),
            ("generation_tokens", "generation_tokens", "Tokens generated (committed)."),
            ("rounds", "spec_decode_num_rounds", "Verification rounds of decoding sequences."),
            ("draft_tokens", "spec_decode_num_draft_tokens", "Tokens proposed by the drafter."),
            ("prefix_cache_queried_tokens", "prefix_cache_queries",
             "Prompt tokens looked up in the prefix cache (vLLM: prefix_cache_queries)."),
            ("prefix_cache_hit_tokens", "prefix_cache_hits", "Prompt tokens found in the prefix cache (no prefill)."),
            ("draft_prefix_cache_queried_tokens", "draft_prefix_cache_queries",
             "Committed tokens looked up in the drafter's prefix cache when a sequence first drafts."),
            ("draft_prefix_cache_hit_tokens", "draft_prefix_cache_hits",
             "Committed tokens found in the drafter's prefix cache (not fed to the drafter)."),
            ("verified_tokens", "spec_decode_num_verified_tokens",
             "Proposed tokens sent to the target (the verification policy admits a prefix of each draft)."),
            ("accepted_tokens", "spec_decode_num_accepted_tokens", "Proposed tokens accepted by the target."),
            ("lookup_rounds", "spec_decode_num_lookup_rounds",
             "Rounds whose proposals came from the lookup before the drafter (--lookup)."),
            ("lookup_accepted_tokens", "spec_decode_num_lookup_accepted_tokens",
             "Accepted tokens of those rounds."),
            ("steps", "engine_steps", "Engine steps."),
        ):
            c = CounterMetricFamily(f"draftwise:{name}", doc, labels=m)
            c.add_metric(v, st.get(key, 0))
            yield c

        yield from self._speculation(st, m, v)

    @staticmethod
    def _speculation(st: dict, m: list[str], v: list[str]):
        """Acceptance by position, tokens committed per round, step time by phase."""
        c = CounterMetricFamily("draftwise:spec_decode_num_accepted_tokens_per_pos",
                                "Accepted proposals by position in the proposal (0 = first).",
                                labels=m + ["position"])
        for pos, n in enumerate(st.get("accepted_per_position", [])):
            c.add_metric(v + [str(pos)], n)
        yield c

        # tokens committed per round: 1 .. k+1 (accepted + the recovered or bonus token)
        hist = st.get("committed_per_round", {})
        top = max([len(st.get("accepted_per_position", [])) + 1] + list(hist))
        buckets, acc = [], 0
        for b in range(1, top + 1):
            acc += hist.get(b, 0)
            buckets.append((str(b), acc))
        buckets.append(("+Inf", acc))
        h = HistogramMetricFamily("draftwise:spec_decode_committed_per_round",
                                  "Tokens committed per verification round.", labels=m)
        h.add_metric(v, buckets, sum_value=st.get("committed_tokens", 0))
        yield h

        c = CounterMetricFamily("draftwise:step_seconds", "Engine step time by phase.", labels=m + ["phase"])
        for phase in ("propose", "verify", "other"):
            c.add_metric(v + [phase], st.get(f"{phase}_seconds", 0.0))
        yield c


LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def make_registry(engine: AsyncEngine, model_name: str, outcomes: Outcomes) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(engine, model_name, outcomes))
    ttft = Histogram("draftwise:time_to_first_token_seconds", "Time to first token (in the engine).",
                     ["model_name"], buckets=LATENCY_BUCKETS, registry=reg).labels(model_name)
    e2e = Histogram("draftwise:e2e_request_latency_seconds", "Request latency (in the engine), finished requests.",
                    ["model_name"], buckets=LATENCY_BUCKETS, registry=reg).labels(model_name)

    def observe(out):
        if out.error is None and out.finish_reason != "abort":
            if out.ttft is not None:
                ttft.observe(out.ttft)
            if out.e2e is not None:
                e2e.observe(out.e2e)

    engine.on_finish.append(observe)
    return reg


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
