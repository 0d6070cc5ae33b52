"""`bench --url`: a workload replayed against an OpenAI-compatible server, level by level.

With `--reference-url` (a plain server of the same model) both servers run every level, one after
the other; the reference then plays the part `none` plays in-process: the server's speedup and
goodput ratio at a level are against the reference's run at that level (`vs_none`, the field the
report's tables read), and its greedy tokens are compared with the reference's.
"""
from __future__ import annotations

import time

from rich.console import Console

from . import correctness
from .arrivals import LoadLevel
from .backends import HTTPBackend, sampling_params
from .metrics import speculation_figures, summarize
from .progress import make_progress
from .workload import Workload


def run_http(plan, wl: Workload, console: Console) -> dict:
    """One workload on `plan.url` (and `plan.reference_url`); `plan` is a runner.BenchPlan."""
    servers = [("server", HTTPBackend(plan.url, plan.served_model))]
    if plan.reference_url:
        servers.append(("reference", HTTPBackend(plan.reference_url)))
    reqs = wl.requests
    params = [sampling_params(r, plan.seed + i, plan.tokens_for(r), not plan.stop_at_eos) for i, r in enumerate(reqs)]
    runs, outputs = [], {}
    with make_progress(console, plan.progress) as progress:
        task = progress.add_task(wl.name, total=len(plan.levels) * len(reqs) * len(servers))
        n_w = min(plan.warmup_requests, len(reqs))
        progress.update(task, description=f"{wl.name} warm-up")
        for _, backend in servers:
            backend.run(reqs[:n_w], [[]] * n_w, [sampling_params(r, 0, 8) for r in reqs[:n_w]],
                        LoadLevel("concurrency", max(1, n_w)))
        for level in plan.levels:
            for role, backend in servers:
                progress.update(task, description=f"{wl.name} {role} {level.label}")
                t0 = time.perf_counter()
                out = backend.run(reqs, [[]] * len(reqs), params, level, seed=plan.seed,
                                  on_done=lambda: progress.advance(task))
                summary = summarize(out.records, out.wall or time.perf_counter() - t0, plan.slo, plan.dollars_per_hour)
                spec = speculation_figures(out.engine_stats, summary["output_tokens"]) if out.engine_stats else None
                runs.append({"config": f"{role}:{backend.model}", "method": role, "k": 0, "level": level.to_dict(),
                             "level_label": level.label, **summary, "speculation": spec, "memory": None,
                             "correctness": None})
                outputs[(role, level.label)] = out.records
    if plan.reference_url:
        compare_to_reference(runs, outputs, reqs)
    return {"name": wl.name, "num_requests": len(reqs), "sampled": wl.sampled, "truncated_prompts": 0,
            "runs": runs, "distribution": {}, "distribution_settings": None, "backend": plan.url,
            "reference": plan.reference_url}


def compare_to_reference(runs: list[dict], outputs: dict, reqs) -> None:
    """The server's runs against the reference's at the same level: speedup (output tok/s), goodput
    ratio, and greedy token equality (tokens as the servers name them in logprobs)."""
    base = {r["level_label"]: r for r in runs if r["method"] == "reference"}
    greedy = [i for i, r in enumerate(reqs) if r.temperature == 0]
    for run in runs:
        ref = base.get(run["level_label"])
        if run["method"] != "server" or ref is None:
            continue
        run["vs_none"] = {
            "speedup": run["output_tokens_per_s"] / ref["output_tokens_per_s"] if ref["output_tokens_per_s"] else None,
            "goodput_ratio": (run["goodput_requests_per_s"] / ref["goodput_requests_per_s"]
                              if ref["goodput_requests_per_s"] else None),
        }
        if greedy:
            mine, theirs = outputs[("server", run["level_label"])], outputs[("reference", run["level_label"])]
            run["correctness"] = correctness.greedy_comparison(
                [reqs[i].id for i in greedy], [theirs[i].token_texts for i in greedy],
                [mine[i].token_texts for i in greedy])
