"""What `draftwise check` prints for each result: a headline with the figures that decided it, then
what the check measures, its threshold and why it passed or failed.

A bare `tv=0.41` beside PASS reads as a large error; it is not one. The distribution test's
verdict is a chi-square p-value against alpha; the total variation next to it is descriptive, and
two samples of a few hundred tokens from one wide next-token distribution differ by a lot of TV
through noise alone. Each explanation therefore puts a figure beside the one it must be read
against (TV beside the TV of two plain runs, an error beside its tolerance).
"""
from __future__ import annotations

from .check import CheckResult
from .correctness import MIN_CELL, detectable_shift


def explain(r: CheckResult) -> tuple[str, list[str]]:
    """(headline, explanation lines) for one result."""
    f = r.figures
    if r.kind == "greedy":
        return _greedy(r, f)
    if r.kind == "distribution":
        return _distribution(r, f)
    if r.kind == "rollback":
        return _rollback(r, f)
    if r.kind == "stops":
        return _stops(r, f)
    return ", ".join(f"{k}={v}" for k, v in f.items() if v is not None), []


def _greedy(r: CheckResult, f: dict) -> tuple[str, list[str]]:
    ties = f.get("near_tie_divergences")
    head = f"{f['mismatches']} of {f['prompts']} requests differ ({f['tokens']} speculative tokens compared)"
    if f.get("mean_accepted_length") is not None:
        head += f"; mean accepted length {f['mean_accepted_length']}"
    lines = ["what: every prompt decoded greedily (temperature 0, EOS ignored) with speculation and without; "
             "the output tokens must be equal, token for token."]
    if ties is not None:
        lines.append("threshold: PASS when no request differs. A divergence where the target's two best logits "
                     "are within 1e-5 (a near-tie, which rounding alone may break either way) is counted apart "
                     f"and does not fail: {ties} here.")
    else:
        lines.append("threshold: PASS when no request differs (tokens compared as the servers name them in "
                     "logprobs).")
    if r.passed:
        lines.append("why PASS: every request's tokens were equal.")
    else:
        where = f", the first at output position {f['first_mismatch']}" if f.get("first_mismatch") is not None else ""
        lines.append(f"why FAIL: {f['mismatches']} requests differ{where}: speculation changed greedy output."
                     + (f" ({r.detail})" if r.detail else ""))
    return head, lines


def _distribution(r: CheckResult, f: dict) -> tuple[str, list[str]]:
    n, tests, alpha, p = f["samples"], f["tests"], f["alpha"], f["p_value"]
    noise = f.get("tv_plain_vs_plain", f.get("tv_resampled"))
    tv = f.get("tv_spec_vs_plain", f.get("tv"))
    informative = f.get("informative_tests", tests)
    if informative:
        head = (f"p={p:g} {'>=' if p >= alpha else '<'} alpha={alpha:g} over {tests} chi-square tests"
                + (f" ({informative} informative)" if informative < tests else "")
                + f"; TV {tv:.3f} (sampling noise alone: {noise:.3f})")
    else:
        head = f"none of the {tests} chi-square tests had two cells after pooling; TV {tv:.3f}"
    noise_how = ("two plain runs with different seeds" if "tv_plain_vs_plain" in f
                 else "the two servers' samples pooled and dealt at random into two sets of the same sizes")
    lines = [
        f"what: for {f['prompts']} prompts, {n} samples of the first {f['horizon']} tokens each, with speculation "
        f"and without (other seeds). At each (prompt, position) a chi-square test of homogeneity asks whether the "
        f"two token counts can come from one distribution (tokens seen fewer than {MIN_CELL} times in both "
        f"together share one cell). p is the smallest of the {tests} p-values times {tests} (Bonferroni), at most 1.",
        f"threshold: PASS when p >= alpha = {alpha:g}; a lossless sampler fails by chance in at most {alpha:.0%} "
        f"of runs. With {n} samples the test catches, 4 times in 5, about "
        f"{detectable_shift(n, tests, alpha):.2f} of probability moved from one token to another at one position; "
        "smaller biases can pass (more --samples see finer ones).",
        *([f"proposals verified while sampling with speculation: {f['proposed']} (each sample runs past the "
           f"first {f['horizon']} tokens, so that rounds propose at every counted position)."]
          if "proposed" in f else []),
        f"TV {tv:.3f}: the mean over the {tests} positions of the total variation between the two empirical "
        "token distributions (half the sum of the frequency differences). It is reported, not tested: from a "
        f"wide next-token distribution two samples of {n} differ a lot by chance alone ({noise_how}: "
        f"{noise:.3f}), so read it against that figure, not against 0.",
    ]
    if r.passed:
        lines.append(f"why PASS: the counts are consistent with one distribution (p={p:g} >= {alpha:g}).")
    elif f.get("informative_tests") == 0:
        lines.append(f"why FAIL: {r.detail}")
    else:
        lines.append(f"why FAIL: at some position the counts differ more than sampling noise explains "
                     f"(p={p:g} < {alpha:g}): speculation changed the output distribution.")
    return head, lines


def _rollback(r: CheckResult, f: dict) -> tuple[str, list[str]]:
    drafter = f.get("max_rel_err_drafter")
    head = (f"largest logit error {f['max_rel_err_target']} (tolerance {f['tolerance_target']:g})"
            + (f", drafter {drafter} (tolerance {f['tolerance_drafter']:g})" if drafter is not None else "")
            + f"; {f['rejected_proposals']} proposals rejected")
    lines = [f"what: {f['sequences']} requests decoded speculatively for 8 steps; every rejected proposal is a "
             "rollback of the K/V cache. Then the next-token logits read through the cache are compared with a "
             "fresh forward over the committed tokens" + (", for the target and the drafter's own cache." if
                                                           drafter is not None else ", for the target."),
             "threshold: PASS when the largest difference, relative to the largest logit, is within the tolerance: "
             "1e-4 in float32, 5e-2 in bfloat16 (the cached and the full forward round differently); quantized "
             "weights are compared with a fresh prefill through the same kernels (same products)."]
    if r.passed:
        lines.append("why PASS: the cache after rollbacks holds what a fresh computation gives."
                     + (f" ({r.detail})" if r.detail else ""))
    else:
        lines.append("why FAIL: " + (r.detail or "a cached logit differs from the fresh one beyond the tolerance: "
                                     "a rollback left stale or wrong K/V behind."))
    return head, lines


def _stops(r: CheckResult, f: dict) -> tuple[str, list[str]]:
    failures = f.get("failures") or []
    head = f"{f['cases'] - len(failures)} of {f['cases']} cases stop where plain decoding stops"
    lines = ["what: max_tokens, stop_token_ids and stop strings placed where plain greedy output reaches them, run "
             "with your config and with the target drafting for itself (every proposal accepted, so a stop lands "
             f"inside a multi-token block: {f['cut_inside_a_block']} did).",
             "threshold: PASS when every case's output and finish reason equal plain decoding's."]
    lines.append("why PASS: every output was cut exactly where plain decoding stops." if r.passed
                 else f"why FAIL: these cases were cut elsewhere: {', '.join(failures)}.")
    return head, lines
