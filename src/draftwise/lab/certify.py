"""Certify any server pair: is a speculative server's output the same as a plain one's?

    draftwise check --url http://spec:8000 --reference-url http://plain:8001

Both servers get the same prompts through `/v1/completions` (streamed, `logprobs: 0` so each
chunk names its tokens). Two tests, as `draftwise check` runs them in-process:

- greedy equality: temperature 0, the same max_tokens, EOS ignored; every request's tokens
  (their strings, as the servers report them) must be equal;
- distribution: `samples` seeded sampled requests per prompt on each server (independent seeds),
  the first `horizon` tokens counted per position; chi-square per (prompt, position),
  Bonferroni-combined, must not reject at `alpha`.

This works for any OpenAI-compatible server that honours `ignore_eos`, `seed` and `logprobs`
on completions (draftwise, vLLM), e.g. to check that vLLM's speculation is lossless on a model.
"""
from __future__ import annotations

from collections import Counter

from . import correctness
from .arrivals import LoadLevel
from .backends import HTTPBackend, sampling_params
from .check import CheckResult
from .workload import Request


def _run(backend: HTTPBackend, reqs: list[Request], seeds: list[int], concurrency: int, on_done=None) -> list:
    params = [sampling_params(r, s) for r, s in zip(reqs, seeds)]
    out = backend.run(reqs, [[]] * len(reqs), params, LoadLevel("concurrency", concurrency),
                      on_done=on_done).records
    bad = [r for r in out if r.error]
    if bad:
        raise ValueError(f"{backend.url}: {len(bad)} of {len(out)} requests failed, e.g. {bad[0].error}")
    return out


def planned_server_requests(prompts: int, samples: int, dist_prompts: int = 3) -> int:
    """Requests certify_servers sends to the two servers together (a progress bar's total)."""
    return 2 * prompts + 2 * min(dist_prompts, prompts) * samples


def certify_servers(url: str, reference_url: str, prompts: list[str], *, max_tokens: int = 32, samples: int = 200,
                    horizon: int = 4, temperature: float = 1.0, alpha: float = 0.01, seed: int = 0,
                    dist_prompts: int = 3, concurrency: int = 8, model: str | None = None,
                    reference_model: str | None = None, on_start=None, on_done=None) -> list[CheckResult]:
    """Both tests; `on_start(name)` before each, `on_done()` after each finished request (a
    progress bar: planned_server_requests gives the total)."""
    if on_start:
        on_start("greedy equality")
    test, ref = HTTPBackend(url, model), HTTPBackend(reference_url, reference_model)
    greedy = [Request(f"greedy-{i}", p, max_tokens, 0.0) for i, p in enumerate(prompts)]
    a = _run(ref, greedy, [0] * len(greedy), concurrency, on_done)
    b = _run(test, greedy, [0] * len(greedy), concurrency, on_done)
    cmp = correctness.greedy_comparison([r.id for r in greedy], [r.token_texts for r in a], [r.token_texts for r in b])
    counted = all(r.token_texts for r in a + b)
    results = [CheckResult("greedy equality (servers)", counted and cmp["mismatching_requests"] == 0,
                           {"prompts": len(greedy), "tokens": sum(len(r.token_texts) for r in b),
                            "mismatches": cmp["mismatching_requests"], "first_mismatch": cmp["first_differing_position"]},
                           "" if counted else "a server returned no tokens in logprobs: cannot compare",
                           kind="greedy")]
    if on_start:
        on_start("distribution")
    chosen = prompts[:dist_prompts]
    sampled = [Request(f"dist-{i}-{s}", p, horizon, temperature) for i, p in enumerate(chosen) for s in range(samples)]
    seeds = list(range(seed, seed + len(sampled)))
    counts = []
    for backend, offset in ((ref, 0), (test, 1_000_000)):
        recs = _run(backend, sampled, [s + offset for s in seeds], concurrency, on_done)
        per = [[Counter() for _ in range(horizon)] for _ in chosen]
        for j, r in enumerate(recs):
            for pos, tok in enumerate(r.token_texts[:horizon]):
                per[j // samples][pos][tok] += 1
        counts.append(per)
    d = correctness.compare_distributions(counts[0], counts[1])
    ok = d["p_value"] >= alpha and d["informative_tests"] > 0
    results.append(CheckResult(f"distribution (servers, T={temperature:g})", ok,
                               {"prompts": len(chosen), "samples": samples, "horizon": horizon, "tests": d["tests"],
                                "informative_tests": d["informative_tests"], "p_value": round(d["p_value"], 4),
                                "alpha": alpha, "tv": round(d["mean_tv"], 4),
                                "tv_resampled": round(correctness.resampled_tv(counts[0], counts[1], seed=seed), 4)},
                               "" if d["informative_tests"] else "no test had two cells after pooling: raise --samples",
                               kind="distribution"))
    return results
