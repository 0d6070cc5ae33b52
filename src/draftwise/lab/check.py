"""The exactness suite behind `draftwise check`: is a (target, drafter, method, k) lossless?

- greedy: speculative greedy output equals plain greedy output token for token; a mismatch is
  tolerated only at a near-tie of the target (top-2 logit gap < 1e-5), and counted;
- distribution: at temperature T, seeded repeated samples of the first `horizon` tokens under
  speculation vs plain sampling: chi-square per position (Bonferroni-combined p-value), and the
  observed total variation next to plain-vs-plain (the sampling-noise floor);
- rollback: after rounds with rejections, the logits read through the cache (target, and the
  drafter's own cache) equal a fresh full recompute of the committed prefix;
- stops: max_tokens, stop_token_ids and stop strings that land inside accepted blocks cut the
  output exactly where plain decoding stops.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engine import EngineConfig, LLMEngine, SpecConfig
from ..model.quantize import quantization_of
from ..proposers import proposer_class
from ..proposers.cross_vocab import CrossVocabProposer
from ..sampling import SamplingParams
from . import correctness


@dataclass
class CheckResult:
    name: str
    passed: bool
    figures: dict = field(default_factory=dict)
    detail: str = ""
    kind: str = ""  # greedy | distribution | rollback | stops: what check_explain says about it


@dataclass
class CheckSetup:
    target: object  # LoadedModel
    draft: object | None
    spec: SpecConfig
    prompts: list[list[int]]  # token ids, already fitted to the context
    temperature: float = 1.0
    max_tokens: int = 32
    samples: int = 400
    horizon: int = 4
    dist_prompts: int = 3
    dist_prompt_tokens: int = 32
    alpha: float = 0.01
    seed: int = 0
    recurrent_rollback: str = "snapshot"  # hybrid targets (EngineConfig.recurrent_rollback)
    prefix_caching: bool = True  # EngineConfig.enable_prefix_caching (check --no-prefix-caching)
    kv_cache_memory: str | None = None  # EngineConfig.kv_cache_memory (check --kv-cache-memory)


def make_engine(s: CheckSetup, spec: SpecConfig | None = None) -> LLMEngine:
    spec = spec if spec is not None else s.spec
    draft = s.draft if spec.method and proposer_class(spec.method).needs_draft_model else None
    return LLMEngine(s.target, draft, spec, _engine_config(s, 64))


def _engine_config(s: CheckSetup, max_seqs: int) -> EngineConfig:
    p = next(s.target.model.parameters())
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(p.dtype, "float32")
    return EngineConfig(dtype=dtype, device=str(p.device), max_num_seqs=max_seqs, kv_cache_max_tokens=max_seqs * 1024,
                        recurrent_rollback=s.recurrent_rollback, enable_prefix_caching=s.prefix_caching,
                        kv_cache_memory=s.kv_cache_memory)


def generate(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], tag: str,
             on_done=None) -> list:
    """Run the requests to the end; `on_done()` after each one finishes (a progress bar)."""
    seqs = [engine.add_request(f"{tag}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    while engine.has_unfinished():
        finished = sum(o.finished for o in engine.step())
        for _ in range(finished if on_done else 0):
            on_done()
    for q in seqs:
        engine.release(q.request_id)
    return seqs


def check_greedy(s: CheckSetup, plain: LLMEngine, spec: LLMEngine, on_done=None) -> CheckResult:
    sp = SamplingParams(temperature=0, max_tokens=s.max_tokens, ignore_eos=True)
    base = generate(plain, s.prompts, [sp] * len(s.prompts), "greedy-plain", on_done)
    got = generate(spec, s.prompts, [sp] * len(s.prompts), "greedy-spec", on_done)
    mismatches, ties = [], 0
    for p, b, g in zip(s.prompts, base, got):
        j = correctness.first_difference(b.output_ids, g.output_ids)
        if j is None:
            continue
        if j < len(b.output_ids) and correctness.near_tie(s.target.model, p + b.output_ids, len(p) + j):
            ties += 1
        else:
            mismatches.append(j)
    rounds = sum(q.stats.rounds for q in got)
    figs = {"prompts": len(s.prompts), "tokens": sum(len(q.output_ids) for q in got), "mismatches": len(mismatches),
            "near_tie_divergences": ties, "first_mismatch": min(mismatches, default=None),
            "mean_accepted_length": round(sum(q.stats.committed_in_rounds for q in got) / rounds, 3) if rounds else None}
    return CheckResult("greedy equality", not mismatches, figs, kind="greedy")


def check_distribution(s: CheckSetup, plain: LLMEngine, spec: LLMEngine, on_done=None) -> CheckResult:
    ids = [p[-s.dist_prompt_tokens:] for p in s.prompts[: s.dist_prompts]]
    args = (ids, s.temperature, s.horizon, s.samples)
    tail = s.spec.k if s.spec.method else 0  # proposals at every counted position (`sample_counts`)
    ref = correctness.sample_counts(plain, *args, seed=s.seed + 1_000_000, tag="dist-plain-a", on_done=on_done)
    floor = correctness.sample_counts(plain, *args, seed=s.seed + 2_000_000, tag="dist-plain-b", on_done=on_done)
    proposed = spec.stats.proposed_tokens
    got = correctness.sample_counts(spec, *args, seed=s.seed + 3_000_000, tag="dist-spec", on_done=on_done,
                                    tail=tail)
    cmp = correctness.compare_distributions(ref, got)
    noise = correctness.compare_distributions(ref, floor)
    figs = {"temperature": s.temperature, "prompts": len(ids), "horizon": s.horizon, "samples": s.samples,
            "tests": cmp["tests"], "informative_tests": cmp["informative_tests"], "p_value": round(cmp["p_value"], 4),
            "alpha": s.alpha, "tv_spec_vs_plain": round(cmp["mean_tv"], 4),
            "tv_plain_vs_plain": round(noise["mean_tv"], 4), "proposed": spec.stats.proposed_tokens - proposed}
    ok = cmp["p_value"] >= s.alpha and cmp["informative_tests"] > 0
    detail = "" if cmp["informative_tests"] else "no test had two cells after pooling: raise --samples"
    return CheckResult(f"distribution (T={s.temperature:g})", ok, figs, detail, kind="distribution")


def _cached_next_logits(runner, seq_id: int, ids: list[int], computed: int) -> torch.Tensor:
    runner.kv.reserve(seq_id, len(ids))
    return runner.run([seq_id], [ids[computed:]], [computed], [1])[0]


FRESH_SEQ = -7  # the sequence id of a reference forward in the runner's own pool


def _fresh_next_logits(runner, model, ids: list[int]) -> torch.Tensor:
    """The logits after `ids` from a forward over all of them with nothing cached. Float weights:
    the full causal forward without a cache. Quantized weights: the runner's own prefill in fresh
    blocks, so that both sides take the same products (int8 activations are quantized per row the
    same way; a full forward without the kernels dequantizes the weights and keeps float
    activations, which differs by the quantization itself, not by the cache)."""
    if quantization_of(model) is None or not runner.kv.can_reserve(FRESH_SEQ, len(ids)):
        return correctness.full_logits(model, ids)
    runner.kv.reserve(FRESH_SEQ, len(ids))
    try:
        return runner.run([FRESH_SEQ], [ids], [0], [1])[0].float()
    finally:
        runner.kv.free(FRESH_SEQ)


def check_rollback(s: CheckSetup, spec: LLMEngine, on_done=None) -> CheckResult:
    n = min(3, len(s.prompts))
    temps = [0.0, s.temperature or 1.0, 0.0][:n]
    params = [SamplingParams(temperature=t, seed=s.seed + i, max_tokens=s.max_tokens * 4, ignore_eos=True)
              for i, t in enumerate(temps)]
    seqs = [spec.add_request(f"rollback-{i}", s.prompts[i][-64:], params[i]) for i in range(n)]
    for _ in range(8):
        spec.step()
    drafter = getattr(spec.proposer, "runner", None)
    features = bool(spec.feature_layers)  # a drafter on the target's features: its cache of context K/V
    def tolerance(model):  # bfloat16: the cached and the full forward round differently
        return 1e-4 if next(model.parameters()).dtype == torch.float32 else 5e-2

    tol_p = tolerance(s.target.model)
    tol_q = tolerance(drafter.model) if drafter is not None else max(tol_p, tolerance(spec.proposer.drafter)) if features else None
    worst_p, worst_q, rejections, checked = 0.0, 0.0, 0, 0
    for seq in seqs:
        if seq.is_finished or seq.is_prefilling:
            continue
        checked += 1
        rejections += seq.stats.proposed_tokens - seq.stats.accepted_tokens
        ids = seq.all_ids
        with torch.inference_mode():
            fresh_p = _fresh_next_logits(spec.runner, s.target.model, ids)
            got_p = _cached_next_logits(spec.runner, seq.seq_id, ids, seq.num_computed).float()
            worst_p = max(worst_p, float((got_p - fresh_p).abs().max() / max(1.0, float(fresh_p.abs().max()))))
            if drafter is not None:
                ids_q, computed_q = ids, seq.draft_computed
                if isinstance(spec.proposer, CrossVocabProposer):  # the drafter's own tokens and positions
                    ids_q, computed_q = spec.proposer.draft_view(seq)
                fresh_q = _fresh_next_logits(drafter, drafter.model, ids_q)
                got_q = _cached_next_logits(drafter, seq.seq_id, ids_q, computed_q).float()
                worst_q = max(worst_q, float((got_q - fresh_q).abs().max() / max(1.0, float(fresh_q.abs().max()))))
            elif features:
                worst_q = max(worst_q, spec.proposer.cache_error(seq, s.target.model))
    for seq in seqs:
        spec.abort(seq.request_id)
        if on_done:
            on_done()
    figs = {"sequences": checked, "rejected_proposals": rejections, "max_rel_err_target": f"{worst_p:.2e}",
            "max_rel_err_drafter": f"{worst_q:.2e}" if tol_q is not None else None,
            "tolerance_target": tol_p, "tolerance_drafter": tol_q}
    ok = checked > 0 and worst_p <= tol_p and (tol_q is None or worst_q <= tol_q)
    detail = "" if rejections else "no proposal was rejected, so no rollback was exercised"
    return CheckResult("KV rollback", ok, figs, detail, kind="rollback")


STOPS_MAX_TOKENS = 40  # the stops check's longest output (prompts must leave room for it)


def check_stops(s: CheckSetup, plain: LLMEngine, spec: LLMEngine, on_done=None) -> CheckResult:
    """Stops with the user's config, and with the target drafting for itself (every proposal
    accepted), so that stops surely land inside multi-token blocks."""
    prompt = s.prompts[0]
    longest = STOPS_MAX_TOKENS
    base_seq = generate(plain, [prompt], [SamplingParams(temperature=0, max_tokens=longest, ignore_eos=True)],
                        "stop-base", on_done)[0]
    base = base_seq.output_ids
    cases: list[tuple[str, SamplingParams, list[int], str]] = []
    for n in (1, 3, 7, 13):
        cases.append((f"max_tokens={n}", SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), base[:n], "length"))
    for j in (5, 11, 23):
        first = base.index(base[j])
        cases.append((f"stop_token_ids@{j}", SamplingParams(temperature=0, max_tokens=longest, ignore_eos=True,
                                                            stop_token_ids=[base[j]]), base[: first + 1], "stop"))
    text_cases = []
    if spec.tokenizer is not None:
        text = base_seq.text
        for start, length in ((5, 3), (12, 5), (20, 2)):
            stop = text[start: start + length]
            if stop.strip():
                text_cases.append((stop, text[: text.find(stop)]))
    params = [c[1] for c in cases] + [SamplingParams(temperature=0, max_tokens=longest, ignore_eos=True, stop=[st])
                                      for st, _ in text_cases]
    self_draft = LLMEngine(s.target, s.target, SpecConfig(method="draft", k=max(s.spec.k, 4)),
                           _engine_config(s, 16))
    engines = [("config", spec), ("self-draft", self_draft)]
    failures, inside = [], {}
    for label, eng in engines:
        got = generate(eng, [prompt] * len(params), params, f"stops-{label}", on_done)
        inside[label] = sum(1 + sum(q.stats.committed_per_round) > len(q.output_ids) for q in got)
        for (name, _, want, reason), q in zip(cases, got):
            if q.output_ids != want or q.finish_reason != reason:
                failures.append(f"{label}:{name}")
        for (stop, want_text), q in zip(text_cases, got[len(cases):]):
            if q.text != want_text or q.finish_reason != "stop" or q.output_ids != base[: len(q.output_ids)]:
                failures.append(f"{label}:stop={stop!r}")
    figs = {"cases": len(engines) * len(params), "cut_inside_a_block": f"{inside['config']} (config) + "
            f"{inside['self-draft']} (target as its own drafter)", "failures": failures or None}
    return CheckResult("stops inside accepted blocks", not failures, figs, kind="stops")


STOP_CASES = 10  # at most: 4 max_tokens, 3 stop_token_ids and 3 stop strings (check_stops)


def planned_requests(s: CheckSetup) -> dict[str, int]:
    """Requests each check runs (the stops check's at most), for a progress bar's total."""
    return {"greedy equality": 2 * len(s.prompts),
            "distribution": 3 * min(s.dist_prompts, len(s.prompts)) * s.samples,
            "KV rollback": min(3, len(s.prompts)),
            "stops": 1 + 2 * STOP_CASES}


def run_checks(s: CheckSetup, on_start=None, on_done=None) -> list[CheckResult]:
    """Every check in turn: `on_start(name)` before each, `on_done()` after each finished request."""
    plain = make_engine(s, SpecConfig())
    spec = make_engine(s)
    steps = [("greedy equality", lambda: check_greedy(s, plain, spec, on_done)),
             ("distribution", lambda: check_distribution(s, plain, spec, on_done)),
             ("KV rollback", lambda: check_rollback(s, spec, on_done)),
             ("stops", lambda: check_stops(s, plain, spec, on_done))]
    results = []
    for name, fn in steps:
        if on_start:
            on_start(name)
        results.append(fn())
    return results
