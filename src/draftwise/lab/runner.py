"""`bench` orchestration: every workload x config x load level, the same requests each time.

The target and each config's drafter are loaded once (bench_models.py); each config gets its own engine,
warmed up on a few short requests before anything is measured. Levels are the outer loop and
configs the inner one, so slow drift in background load spreads over all configs. Each
(config, level) run yields
latency/throughput figures (`metrics`), speculation counters (an `EngineStats` delta), peak
memory, and correctness against `none` at the same level (`correctness`). `none` is always run:
it is the reference for speedups and for exactness.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Console

from ..engine import EngineConfig, LLMEngine, SpecConfig
from ..model.chat_template import ChatTemplate
from . import correctness, memory, steal
from .arrivals import LoadLevel
from .backends import EngineBackend, sampling_params
from .bench_models import BenchModels, load_bench_models
from .capacity import find_capacities
from .http_bench import run_http
from .metrics import speculation_figures, summarize
from .progress import make_progress
from .timeslice import SliceClock, run_sliced
from .workload import Workload

QUICK = dict(configs="none,draft:k=4,ngram:k=4", concurrency="1,4", num_requests=8, max_tokens=32,
             dist_prompts=2, dist_samples=100, dist_horizon=3)


@dataclass(frozen=True)
class BenchConfig:
    """One `--configs` entry: "none", "draft:k=4", "ngram:k=3", "draft:k=4:policy=goodput",
    "draft:k=4:forced=0" (structured output's free forced proposals per round; default 16),
    "draft:k=4:tree=2" (a drafted tree of at most k nodes, 2 children per expanded node; suffix too),
    "draft:k=4:rollback=replay" (a hybrid target's recurrent rollback; default snapshot),
    "draft:k=4:copy=2" (the same config again in an engine of its own: an A/A control, whose
    figures against the original's show how far the machine's noise alone moves a cell),
    "dspark:k=4:draft=DIR" (this config's drafter, instead of --draft: lab/bench_models.py),
    "eagle3:k=4:lookup=ngram" (n-gram lookup or suffix decoding first, the drafter where the match is
    weak: proposers/lookup_first.py; :lookup_k=N its own proposals per round, :lookup_min=P)."""

    label: str
    method: str | None
    k: int = 4
    policy: str = "fixed"
    profile: str | None = None  # the hardware profile for the goodput policy (bench --profile)
    forced: int = SpecConfig.forced
    rollback: str = "snapshot"  # hybrid targets: EngineConfig.recurrent_rollback
    copy: int = 1  # > 1: an A/A control, the same config again in an engine of its own
    tree: int = 0  # SpecConfig.tree: children per expanded node of a drafted tree (0: chains)
    draft: str | None = None  # this config's drafter directory (None: --draft, or the embedded one)
    lookup: str | None = None  # SpecConfig.lookup, lookup_k, lookup_min
    lookup_k: int = 0
    lookup_min: float = SpecConfig.lookup_min

    @property
    def spec(self) -> SpecConfig:
        return SpecConfig(method=self.method, k=self.k, policy=self.policy, profile=self.profile, forced=self.forced,
                          tree=self.tree, lookup=self.lookup, lookup_k=self.lookup_k, lookup_min=self.lookup_min)


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_configs(text: str, profile: str | None = None) -> list[BenchConfig]:
    out = []
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            continue
        method, *opts = entry.split(":")
        k, policy, forced, rollback, copy, tree, draft = 4, "fixed", SpecConfig.forced, "snapshot", 1, 0, None
        lookup, lookup_k, lookup_min = None, 0, SpecConfig.lookup_min
        for o in opts:
            key, sep, val = o.partition("=")
            if key == "k" and sep and val.isdigit():
                k = int(val)
            elif key == "forced" and sep and val.isdigit():
                forced = int(val)
            elif key == "policy" and sep and val:
                policy = val
            elif key == "rollback" and val in ("snapshot", "replay"):
                rollback = val
            elif key == "copy" and sep and val.isdigit() and int(val) >= 1:
                copy = int(val)
            elif key == "tree" and sep and val.isdigit():
                tree = int(val)
            elif key == "draft" and sep and val:
                draft = val
            elif key == "lookup" and sep and val:
                lookup = val
            elif key == "lookup_k" and sep and val.isdigit():
                lookup_k = int(val)
            elif key == "lookup_min" and sep and _is_float(val):
                lookup_min = float(val)
            else:
                raise ValueError("--configs entries look like none, draft:k=4, ngram:k=2 or "
                                 f"draft:k=4:policy=goodput (or :forced=N, :tree=N, :rollback=replay, :copy=2, "
                                 f":draft=DIR, :lookup=ngram, :lookup_k=N, :lookup_min=P); "
                                 f"got {entry!r}")
        method = None if method in ("none", "") else method
        if method is not None and not _needs_draft(method) and draft is not None:  # (validates the name too)
            raise ValueError(f"--configs {entry!r}: :draft=DIR names a drafter, and {method} drafts without one")
        if method is None and draft is not None:
            raise ValueError(f"--configs {entry!r}: :draft=DIR names a drafter, and none drafts nothing")
        SpecConfig(method=method, k=k, policy=policy, forced=forced, tree=tree, lookup=lookup, lookup_k=lookup_k,
                   lookup_min=lookup_min)  # validates k, the policy, forced, tree, the lookup
        label = "none" if method is None else f"{method}:k={k}" + ("" if policy == "fixed" else f":policy={policy}")
        label += "" if method is None or forced == SpecConfig.forced else f":forced={forced}"
        label += "" if method is None or not tree else f":tree={tree}"
        label += "" if method is None or rollback == "snapshot" else f":rollback={rollback}"
        label += "" if lookup is None else f":lookup={lookup}"
        label += "" if lookup is None or not lookup_k else f":lookup_k={lookup_k}"
        label += "" if lookup is None or lookup_min == SpecConfig.lookup_min else f":lookup_min={lookup_min:g}"
        label += "" if draft is None else f":draft={draft}"
        label += "" if copy == 1 else f":copy={copy}"
        out.append(BenchConfig(label, method, k, policy if method else "fixed", profile, forced,
                               rollback if method else "snapshot", copy, tree if method else 0, draft, lookup,
                               lookup_k, lookup_min))
    labels = [c.label for c in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--configs lists a config twice: {text!r}")
    if "none" not in labels:  # the reference for speedups and exactness
        out.insert(0, BenchConfig("none", None))
    return sorted(out, key=lambda c: c.label != "none")


@dataclass
class BenchPlan:
    workloads: list[Workload]
    configs: list[BenchConfig]
    levels: list[LoadLevel]
    model: str | None = None
    draft: str | None = None
    url: str | None = None
    reference_url: str | None = None  # with url: a plain server to compare greedy outputs against
    served_model: str | None = None
    dtype: str = "float32"
    draft_dtype: str | None = None  # None: draft_dtype_for's default (bfloat16 on a CPU with native bfloat16)
    quantization: str | None = None  # "int8" or "int4": weight-only, both models (model/quantize.py)
    draft_quantization: str | None = None  # the draft's own, when it differs ("none": float weights)
    draft_vocab: int | None = None  # the draft's head over its N most frequent tokens (model/draft_vocab.py)
    device: str = "cpu"
    slo: dict = field(default_factory=dict)
    dollars_per_hour: float | None = None
    max_tokens: int | None = None  # cap per request (--quick)
    output_len: int | None = None  # every request generates exactly this many tokens (--output-len)
    stop_at_eos: bool = False  # a reply ends at the model's end of sequence (--stop-at-eos); else at max_tokens
    seed: int = 0
    warmup_requests: int = 2
    repeats: int = 1  # rounds of every config per level; figures from each config's median round
    dist_prompts: int = 3
    dist_samples: int = 200
    dist_horizon: int = 4
    dist_prompt_tokens: int = 32
    prefix_caching: bool = True  # the engines share cached prompt blocks (--no-prefix-caching: off)
    find_capacity: bool = False  # search the highest open-loop rate meeting `slo` per config
    capacity_start_rate: float = 1.0
    burstiness: float = 1.0
    time_slice: float | None = None  # seconds: a round's configs run together, sliced (timeslice.py); None: one after another
    progress: bool | None = None  # the bar on stderr: forced, off, or None (when stderr is a terminal)

    def tokens_for(self, req) -> int:
        """The request's output length in this run."""
        if self.output_len:
            return self.output_len
        return min(req.max_tokens, self.max_tokens or req.max_tokens)


def run_bench(plan: BenchPlan, console: Console | None = None) -> list[dict]:
    """Run everything; returns one entry per workload: {"name", "runs": [...], ...}."""
    console = console or Console(stderr=True)
    if plan.url:
        return [run_http(plan, w, console) for w in plan.workloads]
    models = load_bench_models(plan, [c for c in plan.configs if _uses_draft(c)])
    return [_run_workload(plan, w, models, console) for w in plan.workloads]


def _needs_draft(method: str) -> bool:
    from ..proposers import proposer_class

    return proposer_class(method).needs_draft_model


def _engine(plan: BenchPlan, cfg: BenchConfig, models: BenchModels, max_seqs: int, max_len_needed: int) -> LLMEngine:
    ecfg = EngineConfig(dtype=plan.dtype, device=plan.device, max_num_seqs=max_seqs,
                        kv_cache_max_tokens=max_seqs * (max_len_needed + 2 * cfg.k + 16),
                        enable_prefix_caching=plan.prefix_caching, recurrent_rollback=cfg.rollback)
    return LLMEngine(models.target, models.draft(cfg.label), cfg.spec, ecfg)


def _recurrent_memory(engine: LLMEngine) -> dict | None:
    """A hybrid target's recurrent state: one sequence's checkpoint and the largest provisional
    scratch one forward kept (snapshot: k+1 states per sequence; replay: k+1 rows of inputs)."""
    pool = engine.runner.state
    if pool is None:
        return None
    return {"rollback": pool.rollback, "state_kib_per_seq": pool.state_bytes() / 1024,
            "scratch_peak_kib": pool.peak_scratch_bytes / 1024}


def _uses_draft(cfg: BenchConfig) -> bool:
    return cfg.method is not None and _needs_draft(cfg.method)


@dataclass
class _Prompts:
    """A workload's requests made ready for the engines: their token ids (each prompt's tail kept
    so that prompt + max_tokens + lookahead fits the context) and sampling parameters."""

    reqs: list
    prompts: list[list[int]]
    params: list
    truncated: int  # prompts cut to fit the context
    need: int  # the longest prompt + output, in tokens
    chat: ChatTemplate


def _prepare(plan: BenchPlan, wl: Workload, models: BenchModels, console: Console) -> _Prompts:
    reqs, target = wl.requests, models.target
    max_len = models.max_len()
    max_k = max(c.k for c in plan.configs)
    mts = [plan.tokens_for(r) for r in reqs]
    params = [sampling_params(r, plan.seed + i, mt, not plan.stop_at_eos) for i, (r, mt) in enumerate(zip(reqs, mts))]
    chat = ChatTemplate(target.tokenizer_config)
    if chat.is_plain and any(r.messages for r in reqs):
        console.print(f"[yellow]{wl.name}: the model has no chat template; its chat requests are rendered with "
                      "the plain one (role: content lines), as `serve` does[/yellow]")
    # a rendered chat prompt is tokenized without added special tokens (the template writes them), as in serve
    full = [target.tokenizer.encode(r.render_prompt(chat), add_special_tokens=not r.messages).ids for r in reqs]
    prompts = [ids[-max(1, max_len - mt - max_k - 2):] for ids, mt in zip(full, mts)]
    return _Prompts(reqs, prompts, params, truncated=sum(len(a) != len(b) for a, b in zip(full, prompts)),
                    need=max(len(p) + mt for p, mt in zip(prompts, mts)), chat=chat)


def _run_workload(plan: BenchPlan, wl: Workload, models: BenchModels, console: Console) -> dict:
    """Every config at every level (then the capacity search and the distribution test, where
    asked for) on one workload, each config in an engine of its own."""
    w = _prepare(plan, wl, models, console)
    reqs = w.reqs
    max_seqs = max([int(lv.value) for lv in plan.levels if lv.kind == "concurrency"] + [32])
    dist_ids = [p[-plan.dist_prompt_tokens:] for p in w.prompts[: plan.dist_prompts]]
    temp = max((r.temperature for r in reqs), default=0.0)
    runs, outputs, dist, capacity = [], {}, {}, {}
    total = len(plan.configs) * len(plan.levels) * len(reqs) * plan.repeats
    with make_progress(console, plan.progress) as progress:
        task = progress.add_task(f"{wl.name}", total=total)
        backends = _warm_backends(plan, wl, w, models, max_seqs, progress, task)
        for level in plan.levels:
            for cfg, run, records in _run_level(plan, wl, w, backends, level, progress, task):
                runs.append(run)
                outputs[(cfg.label, level.label)] = records
        if plan.find_capacity:
            progress.update(task, description=f"{wl.name} capacity search (configs interleaved)")
            capacity = _capacity(plan, backends, reqs, w.prompts, w.params)
        if wl.sampled:
            dist = _distribution_tests(plan, wl, backends, dist_ids, temp, progress, task)
        del backends
    runs.sort(key=lambda r: [c.label for c in plan.configs].index(r["config"]))
    _compare_to_none(runs, outputs, reqs, w.prompts, models.target)
    return {"name": wl.name, "num_requests": len(reqs), "sampled": wl.sampled, "temperature": temp,
            "chat_template": None if not any(r.messages for r in reqs) else "plain" if w.chat.is_plain else "model",
            "truncated_prompts": w.truncated, "runs": runs, "distribution": dist, "capacity": capacity,
            "distribution_settings": {"prompts": len(dist_ids), "samples": plan.dist_samples,
                                      "horizon": plan.dist_horizon, "temperature": temp} if wl.sampled else None}


def _warm_backends(plan: BenchPlan, wl: Workload, w: _Prompts, models: BenchModels, max_seqs: int, progress,
                   task) -> dict[str, EngineBackend]:
    """One engine per config, each warmed up on a few short requests before anything is measured."""
    backends = {}
    n_w = min(plan.warmup_requests, len(w.reqs))
    for cfg in plan.configs:
        backends[cfg.label] = backend = EngineBackend(_engine(plan, cfg, models, max_seqs, w.need))
        progress.update(task, description=f"{wl.name} {cfg.label} warm-up")
        backend.run(w.reqs[:n_w], w.prompts[:n_w], [sampling_params(r, 0, 8) for r in w.reqs[:n_w]],
                    LoadLevel("concurrency", max(1, n_w)))
    return backends


def _run_level(plan: BenchPlan, wl: Workload, w: _Prompts, backends: dict, level: LoadLevel, progress,
               task) -> list[tuple[BenchConfig, dict, list]]:
    """Every config at one level: (config, its run entry, its records), from its median round.

    Configs are interleaved level by level, so that drifting background load biases no config (with
    --time-slice, a round's configs run together, sliced); with --repeats N the level runs N rounds
    of every config, the order rotated each round."""
    trials: dict[str, list[tuple[dict, object]]] = {cfg.label: [] for cfg in plan.configs}
    n_cfg = len(plan.configs)
    for rnd in range(plan.repeats):
        order = plan.configs[rnd % n_cfg:] + plan.configs[: rnd % n_cfg]
        progress.update(task, description=f"{wl.name} {level.label}"
                        + (f" (round {rnd + 1}/{plan.repeats})" if plan.repeats > 1 else ""))
        for cfg, out, stolen, mem in _round(plan, order, backends, w.reqs, w.prompts, w.params, level,
                                            lambda: progress.advance(task)):
            engine = backends[cfg.label].engine
            trials[cfg.label].append((_run_entry(plan, cfg, level, out, stolen, mem, engine, w.reqs), out.records))
    done = []
    for cfg in plan.configs:
        run, records = median_trial(trials[cfg.label])
        if plan.repeats > 1:
            run["rounds"] = {"output_tokens_per_s": [t["output_tokens_per_s"] for t, _ in trials[cfg.label]],
                             "steal_share": [t.get("steal_share") for t, _ in trials[cfg.label]],
                             "greedy_outputs_identical": all(
                                 [x.token_ids for x in recs] == [x.token_ids for x in records]
                                 for _, recs in trials[cfg.label])}
        done.append((cfg, run, records))
    return done


def _run_entry(plan: BenchPlan, cfg: BenchConfig, level: LoadLevel, out, stolen: float | None, mem: dict,
               engine: LLMEngine, reqs) -> dict:
    """One (config, level) round as results.json records it."""
    summary = summarize(out.records, out.wall, plan.slo, plan.dollars_per_hour)
    return {"config": cfg.label, "method": cfg.method or "none", "k": cfg.k if cfg.method else 0,
            "level": level.to_dict(), "level_label": level.label, **summary,
            "speculation": speculation_figures(out.engine_stats, summary["output_tokens"]),
            "memory": mem, "steal_share": stolen, "recurrent": _recurrent_memory(engine),
            "structured_output": correctness.constraint_validity(engine, reqs, out.records)}


def _distribution_tests(plan: BenchPlan, wl: Workload, backends: dict, dist_ids: list[list[int]], temp: float,
                        progress, task) -> dict:
    """The sampled-output test, once per config against `none` (the reference, sampled first)."""
    dist, ref_counts = {}, None
    for ci, cfg in enumerate(plan.configs):
        progress.update(task, description=f"{wl.name} {cfg.label} distribution test")
        # disjoint seeds per config: each comparison with `none` is an independent test
        seed = 10_000 if cfg.label == "none" else 10_000 * (ci + 2)
        counts = correctness.sample_counts(backends[cfg.label].engine, dist_ids, temp, plan.dist_horizon,
                                           plan.dist_samples, seed=seed, tail=cfg.k if cfg.method else 0)
        if cfg.label == "none":
            ref_counts = counts
        else:
            dist[cfg.label] = correctness.compare_distributions(ref_counts, counts)
    return dist


def _round(plan: BenchPlan, order: list[BenchConfig], backends: dict, reqs, prompts, params, level: LoadLevel,
           on_done) -> list[tuple[BenchConfig, object, float | None, dict]]:
    """One round of every config at one level: (config, its RunOutput, the steal share while it
    ran, the process's peak memory while it ran). One after another on the wall clock, or, with
    `plan.time_slice`, all together in slices, each on its own clock (steal and memory peak then
    the round's)."""
    if plan.time_slice:
        memory.reset_peak()
        before = steal.sample()
        clocks = [SliceClock() for _ in order]
        outs = run_sliced([(backends[c.label].steps(reqs, prompts, params, level, plan.seed, on_done, clock), clock)
                           for c, clock in zip(order, clocks)], plan.time_slice)
        stolen, mem = steal.share(before, steal.sample()), memory.peak_memory()
        return [(c, out, stolen, mem) for c, out in zip(order, outs)]
    done = []
    for cfg in order:
        memory.reset_peak()
        before = steal.sample()
        out = backends[cfg.label].run(reqs, prompts, params, level, seed=plan.seed, on_done=on_done)
        done.append((cfg, out, steal.share(before, steal.sample()), memory.peak_memory()))
    return done


def median_trial(trials: list[tuple[dict, object]]) -> tuple[dict, object]:
    """The round whose output tokens/s is the median (the upper middle one of an even count: on a
    shared machine noise only ever slows a round down)."""
    ranked = sorted(trials, key=lambda t: t[0]["output_tokens_per_s"])
    return ranked[len(ranked) // 2]


def _capacity(plan: BenchPlan, backends: dict, reqs, prompts, params) -> dict:
    """Per config, the highest Poisson request rate at which the SLO holds at p90: the configs'
    searches in lock-step, their runs interleaved (each probe `plan.repeats` runs of the same
    arrivals, the median run deciding); with `plan.time_slice` a step's runs go together, sliced."""
    def level(rate: float) -> LoadLevel:
        return LoadLevel("rate", rate, plan.burstiness)

    def measure(backend):
        def run(rate: float, rnd: int) -> dict:
            out = backend.run(reqs, prompts, params, level(rate), seed=plan.seed)
            return summarize(out.records, out.wall, plan.slo)
        return run

    def together(probes: list[tuple[str, float]], rnd: int) -> dict[str, dict]:
        clocks = [SliceClock() for _ in probes]
        outs = run_sliced([(backends[name].steps(reqs, prompts, params, level(rate), plan.seed, None, clock), clock)
                           for (name, rate), clock in zip(probes, clocks)], plan.time_slice)
        return {name: summarize(out.records, out.wall, plan.slo) for (name, _), out in zip(probes, outs)}

    return find_capacities({label: measure(b) for label, b in backends.items()}, plan.slo,
                           repeats=plan.repeats, start_rate=plan.capacity_start_rate,
                           together=together if plan.time_slice else None)


def _compare_to_none(runs: list[dict], outputs: dict, reqs, prompts=None, target=None) -> None:
    """Speedup, goodput ratio and greedy exactness of every run against `none` at its level.
    A mismatch at a near-tie of the target (top-2 logit gap < 1e-5) is counted apart."""
    base = {r["level_label"]: r for r in runs if r["config"] == "none"}
    greedy = [i for i, r in enumerate(reqs) if r.temperature == 0]
    for run in runs:
        ref = base.get(run["level_label"])
        if ref is None:
            continue
        run["vs_none"] = {
            "speedup": run["output_tokens_per_s"] / ref["output_tokens_per_s"] if ref["output_tokens_per_s"] else None,
            "goodput_ratio": (run["goodput_requests_per_s"] / ref["goodput_requests_per_s"]
                              if ref["goodput_requests_per_s"] else None),
        }
        mine = outputs.get((run["config"], run["level_label"]))
        theirs = outputs.get(("none", run["level_label"]))
        if mine is None or theirs is None or not greedy:
            run["correctness"] = None
            continue
        cmp = correctness.greedy_comparison(
            [reqs[i].id for i in greedy], [theirs[i].token_ids for i in greedy], [mine[i].token_ids for i in greedy])
        if target is not None:
            index = {reqs[i].id: i for i in greedy}
            for m in cmp["mismatches"]:
                i = index[m["id"]]
                ids = prompts[i] + theirs[i].token_ids
                m["near_tie"] = (m["position"] < len(theirs[i].token_ids)
                                 and correctness.near_tie(target.model, ids, len(prompts[i]) + m["position"]))
            cmp["near_ties"] = sum(bool(m.get("near_tie")) for m in cmp["mismatches"])
        run["correctness"] = cmp
