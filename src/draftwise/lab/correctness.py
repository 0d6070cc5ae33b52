"""Is a speculative configuration lossless? Comparisons against plain decoding (`none`).

- Greedy: token ids of every request must equal plain decoding's; we count mismatching requests
  and report the first differing position.
- Sampled: the output distribution must equal plain sampling's. For a few short prompts we draw
  many seeded samples of the first `horizon` tokens under both configurations and compare the
  token frequencies at each position with a two-sample chi-square test of homogeneity (rare
  tokens pooled into one cell). Positions are combined with a Bonferroni correction; the observed
  total variation between the two empirical distributions is reported alongside.
- Structured output: every constrained request's tokens are fed to a fresh grammar matcher
  (`constraint_validity`): complete (the grammar ended), a valid prefix (stopped by max_tokens),
  or invalid.
"""
from __future__ import annotations

import math
import random
from collections import Counter
from statistics import NormalDist

import torch

from ..sampling import SamplingParams
from ..sampling.grammar import GrammarState

MIN_CELL = 10  # tokens seen fewer times (both runs together) are pooled into one cell


def first_difference(a: list[int], b: list[int]) -> int | None:
    """First index where the sequences differ (a length difference counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy_comparison(ids: list[str], ref: list[list[int]], got: list[list[int]]) -> dict:
    mismatches = []
    for rid, a, b in zip(ids, ref, got):
        j = first_difference(a, b)
        if j is not None:
            mismatches.append({"id": rid, "position": j})
    return {
        "compared": len(ids),
        "mismatching_requests": len(mismatches),
        "first_differing_position": min((m["position"] for m in mismatches), default=None),
        "mismatches": mismatches[:20],
    }


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof): the regularized upper incomplete gamma Q(dof/2, x/2)."""
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(x / 2.0, dtype=torch.float64)))


def chi_square_homogeneity(a: Counter, b: Counter, min_cell: int = MIN_CELL) -> tuple[float, int, float]:
    """Two-sample chi-square test that counts a and b come from one distribution: (stat, dof, p)."""
    na, nb = sum(a.values()), sum(b.values())
    if na == 0 or nb == 0:
        return 0.0, 0, 1.0
    cells, pool = [], [0, 0]
    for tok in set(a) | set(b):
        if a[tok] + b[tok] >= min_cell:
            cells.append((a[tok], b[tok]))
        else:
            pool[0] += a[tok]
            pool[1] += b[tok]
    if sum(pool):
        cells.append(tuple(pool))
    if len(cells) < 2:
        return 0.0, 0, 1.0
    n = na + nb
    stat = 0.0
    for ca, cb in cells:
        tot = ca + cb
        for obs, nrow in ((ca, na), (cb, nb)):
            exp = nrow * tot / n
            stat += (obs - exp) ** 2 / exp
    dof = len(cells) - 1
    return stat, dof, chi2_sf(stat, dof)


def total_variation(a: Counter, b: Counter) -> float:
    na, nb = sum(a.values()) or 1, sum(b.values()) or 1
    return 0.5 * sum(abs(a[t] / na - b[t] / nb) for t in set(a) | set(b))


def sample_counts(engine, prompts: list[list[int]], temperature: float, horizon: int, samples: int,
                  seed: int = 0, tag: str = "dist", on_done=None, tail: int = 0) -> list[list[Counter]]:
    """Token counts [prompt][position] over `samples` seeded samples of `horizon` tokens;
    `on_done()` after each sample finishes (a progress bar). `tail`: tokens generated past the
    horizon, not counted, so that a speculative engine can propose at every counted position (a
    round proposes at most the tokens left before max_tokens: with none past the horizon, its
    last positions would see few proposals, and with a horizon of 2 none at all)."""
    seqs = []
    for i, ids in enumerate(prompts):
        for s in range(samples):
            p = SamplingParams(temperature=temperature, max_tokens=horizon + tail, ignore_eos=True,
                               seed=seed + i * samples + s)
            seqs.append((i, engine.add_request(f"{tag}-{seed}-{i}-{s}", ids, p)))
    while engine.has_unfinished():
        finished = sum(o.finished for o in engine.step())
        for _ in range(finished if on_done else 0):
            on_done()
    counts = [[Counter() for _ in range(horizon)] for _ in prompts]
    for i, seq in seqs:
        for j, tok in enumerate(seq.output_ids[:horizon]):
            counts[i][j][tok] += 1
        engine.release(seq.request_id)
    return counts


def compare_distributions(ref: list[list[Counter]], got: list[list[Counter]]) -> dict:
    """Chi-square per (prompt, position), Bonferroni-combined p-value, observed TV."""
    ps, tvs, dofs = [], [], []
    for ra, ga in zip(ref, got):
        for a, b in zip(ra, ga):
            _, dof, p = chi_square_homogeneity(a, b)
            ps.append(p)
            dofs.append(dof)
            tvs.append(total_variation(a, b))
    m = len(ps)
    return {
        "tests": m,
        "informative_tests": sum(d > 0 for d in dofs),  # tests with >= 2 cells after pooling
        "samples": sum(ref[0][0].values()) if ref and ref[0] else 0,
        "min_p": min(ps, default=1.0),
        "p_value": min(1.0, min(ps, default=1.0) * m),  # Bonferroni over positions and prompts
        "max_tv": max(tvs, default=0.0),
        "mean_tv": sum(tvs) / m if m else 0.0,
    }


def resampled_tv(ref: list[list[Counter]], got: list[list[Counter]], rounds: int = 20, seed: int = 0) -> float:
    """The mean TV that sampling noise alone gives at these sample sizes: per (prompt, position),
    both samples pooled and dealt at random into two sets of the same sizes (what one
    distribution would give), their TV averaged over `rounds` deals and over the positions."""
    rng = random.Random(seed)
    tvs = []
    for ra, ga in zip(ref, got):
        for a, b in zip(ra, ga):
            pool = list((a + b).elements())
            na = sum(a.values())
            total = 0.0
            for _ in range(rounds):
                rng.shuffle(pool)
                total += total_variation(Counter(pool[:na]), Counter(pool[na:]))
            tvs.append(total / rounds)
    return sum(tvs) / len(tvs) if tvs else 0.0


def detectable_shift(samples: int, tests: int, alpha: float, power: float = 0.8) -> float:
    """About how much probability must move from one token to another at one position before the
    Bonferroni-combined test rejects with probability `power`: the two-sample test of one
    proportion at level alpha / tests (normal approximation, worst case p = 1/2)."""
    z = NormalDist().inv_cdf
    return (z(1 - alpha / (2 * max(1, tests))) + z(power)) * math.sqrt(2 * 0.25 / max(1, samples))


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits after the last of `ids` from a fresh full causal forward (no cache), on the CPU."""
    dev = next(model.parameters()).device
    with torch.inference_mode():
        return model.logits(torch.tensor([ids], device=dev))[0, -1].float().cpu()  # [V]


def near_tie(model, ids: list[int], pos: int, gap: float = 1e-5) -> bool:
    """Is the target's top-2 logit gap below `gap` when predicting token `pos` of `ids`?"""
    logits = full_logits(model, ids[:pos])
    top2 = torch.topk(logits, 2).values
    return float(top2[0] - top2[1]) < gap



def constraint_validity(engine, reqs, records) -> dict | None:
    """Counts of constrained outputs that are complete, a valid prefix (max_tokens), or invalid;
    None when no request is constrained."""
    counts = {"complete": 0, "valid_prefix": 0, "invalid": 0}
    for req, rec in zip(reqs, records):
        if not req.structured_output:
            continue
        g = GrammarState.create(engine.tokenizer, engine.vocab_size, engine.eos_ids, req.structured_output)
        try:
            ended = any([g.accept(t) for t in rec.token_ids])
        except ValueError:
            counts["invalid"] += 1
            continue
        counts["complete" if ended else "valid_prefix" if rec.finish_reason == "length" else "invalid"] += 1
    return counts if sum(counts.values()) else None
