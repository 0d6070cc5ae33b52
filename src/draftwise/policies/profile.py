"""The hardware profile: measured forward times of one model pair on one machine, and its cost model.

`measure_profile` times the target's forward through draftwise's own `ModelRunner` over a grid

    B = 1, 2, 4, ... max_num_seqs  (decoding sequences)
    T = 1 .. k+1                   (tokens fed per sequence: the last committed token + proposals)
    C = a few context lengths      (the position of the first new token)

plus the drafter's single-token step per (B, C), within a time budget: one untimed run per point,
then a few rounds over all points, each point's time the median of its rounds; points whose
estimated cost would overrun the budget are skipped, the most informative kept first (`_points`).
`fit_cost_model` fits `CostModel` (cost.py) to the grid by least squares on relative error,
clamping negative coefficients to 0.

A `HardwareProfile` is a versioned JSON file (FORMAT): machine, torch, device, threads, dtypes,
model fingerprints (`model_fingerprint`: cheap, content-based), settings, the grid, what was
skipped, the fitted cost model and its error on the grid. `load_or_measure` is what the engine
calls: an explicit file, else a cache file keyed by the pair and the run settings
(`profile_cache_path`, under `$DRAFTWISE_CACHE/profiles`, default `~/.cache/draftwise`), else a
measurement, written to the cache.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..model import cpu_kernels
from ..model.loader import LoadedModel
from ..model.quantize import quantization_of
from ..model.runner import ModelRunner
from .cost import CostModel, GridCost
from .fit import fit_cost_model, fit_errors, predict_target  # noqa: F401 (re-exported)

FORMAT = "draftwise.profile/1"
DEFAULT_CONTEXTS = (64, 256)
DEFAULT_BUDGET_SECONDS = 30.0
FINGERPRINT_BYTES = 1 << 20  # hashed at each end of each weight file
CACHE_GRID = (64, 4)  # (max_num_seqs, k) measured at least for the cache: a bench that runs
                     # c=1, then 2, 4, ... finds the one profile covering each level

Progress = Callable[[int, int, str], None]  # (points done, points planned, what runs now)


@dataclass
class GridPoint:
    """One measured target forward: B sequences, T new tokens each, at context C."""

    num_seqs: int
    tokens_per_seq: int
    context: int
    seconds: float  # median of `repeats` timed runs
    repeats: int = 1


@dataclass
class DraftPoint:
    """One measured drafter step: B sequences, one new token each, at context C."""

    num_seqs: int
    context: int
    seconds: float
    repeats: int = 1


@dataclass
class HardwareProfile:
    machine: dict  # platform, cpu, cpu_count
    torch: str
    device: str
    threads: int
    dtype: str
    draft_dtype: str | None
    models: dict  # {"target": {"path", "fingerprint"}, "draft": {...} | None}
    settings: dict  # max_num_seqs, k, contexts, budget_seconds, repeats
    grid: list[GridPoint]
    draft_grid: list[DraftPoint]
    cost: CostModel
    fit: dict = field(default_factory=dict)  # relative errors of the fit on the grid
    skipped: list[dict] = field(default_factory=list)  # points left out to stay in the budget
    measured_seconds: float = 0.0
    created: str = ""

    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "created": self.created, "measured_seconds": self.measured_seconds,
            "machine": self.machine, "torch": self.torch, "device": self.device, "threads": self.threads,
            "dtype": self.dtype, "draft_dtype": self.draft_dtype, "models": self.models, "settings": self.settings,
            "cost_model": self.cost.to_dict(), "fit": self.fit,
            "grid": [asdict(p) for p in self.grid], "draft_grid": [asdict(p) for p in self.draft_grid],
            "skipped": self.skipped,
        }

    @staticmethod
    def from_dict(d: dict) -> "HardwareProfile":
        return HardwareProfile(
            machine=dict(d["machine"]), torch=str(d["torch"]), device=str(d["device"]), threads=int(d["threads"]),
            dtype=str(d["dtype"]), draft_dtype=d["draft_dtype"], models=dict(d["models"]),
            settings=dict(d["settings"]), grid=[GridPoint(**p) for p in d["grid"]],
            draft_grid=[DraftPoint(**p) for p in d["draft_grid"]], cost=CostModel.from_dict(d["cost_model"]),
            fit=dict(d.get("fit", {})), skipped=list(d.get("skipped", [])),
            measured_seconds=float(d.get("measured_seconds", 0.0)), created=str(d.get("created", "")),
        )

    def grid_cost(self) -> CostModel:
        """The cost model the goodput policy uses: the measured grid (GridCost), or the fit alone
        when the profile has no grid."""
        if not self.grid:
            return self.cost
        return GridCost(self.cost, [(p.num_seqs, p.tokens_per_seq, p.context, p.seconds) for p in self.grid])

    def save(self, path: str | Path) -> Path:
        """Write the JSON (atomically: a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return path

    @staticmethod
    def load(path: str | Path) -> "HardwareProfile":
        path = Path(path)
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"{path}: hardware profile not found") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a readable hardware profile ({e})") from None
        found = d.get("format") if isinstance(d, dict) else None
        if found != FORMAT:
            raise ValueError(f"{path}: hardware profile format {found!r}, this draftwise reads {FORMAT!r}; "
                             "measure it again with `draftwise profile`")
        try:
            return HardwareProfile.from_dict(d)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: malformed hardware profile ({type(e).__name__}: {e})") from None


# ---- identity: machine, models, cache path ------------------------------------------------------

def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    # the vector extension torch dispatches to: the same CPU name covers AVX2-only and AVX-512 parts
    # (this project's machines are both "AMD EPYC"), whose step times differ several-fold in bfloat16
    try:
        cpu = f"{cpu} [{torch.backends.cpu.get_cpu_capability()}]"
    except (AttributeError, RuntimeError):
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count()}


def model_fingerprint(path: str | Path) -> str:
    """sha256 of config.json and, per weight file, its name, size and first and last MiB.

    Content-based (a copied directory keeps its fingerprint) and cheap (at most 2 MiB read per
    file); a retrained model changes its tensors, hence the bytes hashed."""
    path = Path(path)
    h = hashlib.sha256()
    cfg = path / "config.json"
    h.update(cfg.read_bytes() if cfg.is_file() else b"")
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(FINGERPRINT_BYTES))
            if size > FINGERPRINT_BYTES:
                fh.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))
                h.update(fh.read())
    return h.hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get("DRAFTWISE_CACHE") or Path.home() / ".cache" / "draftwise") / "profiles"


def profile_cache_path(target_path: str | Path, draft_path: str | Path | None, dtype: str, draft_dtype: str | None,
                       device: str, threads: int, quantization: str | None = None) -> Path:
    """The cache file of a pair and run settings: keyed by the models' fingerprints (not their
    paths: a copy reuses the profile), dtypes, weight quantization, device, threads, the CPU
    model and, on CPU, the fused kernels' source (new kernels time differently: measured again)."""
    key = {
        "target": model_fingerprint(target_path),
        "draft": model_fingerprint(draft_path) if draft_path is not None else None,
        "dtype": str(dtype), "draft_dtype": str(draft_dtype) if draft_path is not None else None,
        "device": str(device), "threads": int(threads), "cpu": machine_info()["cpu"],
    }
    if str(device) == "cpu":
        key["kernels"] = hashlib.sha256(cpu_kernels.SOURCE.read_bytes()).hexdigest()[:16]
    if quantization is not None:  # (absent for float weights: the caches written before stay valid)
        key["quantization"] = quantization
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"{Path(target_path).name}-{digest}.json"


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _model_entry(m: LoadedModel | None) -> dict | None:
    if m is None:
        return None
    return {"path": str(m.path), "fingerprint": model_fingerprint(m.path), "quantization": quantization_of(m.model)}


# ---- measurement --------------------------------------------------------------------------------

def batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... and max_num_seqs itself."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max_num_seqs]


def _points(bs: list[int], k: int, contexts: list[int], with_draft: bool) -> list[tuple]:
    """(model, B, T, C) in measuring order: the most informative first, so that a budget cut
    still leaves every B at the ends of the T range, first at the shortest context."""
    ts = list(range(1, k + 2))
    ends = [1, k + 1]
    pts: list[tuple] = []
    for c in contexts:  # every B at both ends of T, context by context
        pts += [("target", b, t, c) for b in bs for t in ends]
        if with_draft:
            pts += [("draft", b, 1, c) for b in bs]
    for c in contexts:  # the inner T values
        pts += [("target", b, t, c) for b in bs for t in ts if t not in ends]
    return pts


def _time_run(runner: ModelRunner, b: int, t: int, c: int) -> float:
    seq_ids = list(range(b))
    args = (seq_ids, [[1] * t] * b, [c] * b, [t] * b)  # verification needs logits at every fed position
    if runner.state is not None:  # a hybrid model: recurrent states said to be at context c, blocks provisional
        for s in seq_ids:
            runner.state.place(s, c)
    start = time.perf_counter()
    runner.run(*args, provisional=[t > 1] * b)  # logits on the CPU: a GPU forward is finished when it returns
    return time.perf_counter() - start


def _time_draft_step(runner: ModelRunner, b: int, c: int, k: int) -> float:
    """One drafter step of B sequences at context c: for B = 1, a k-step greedy round in one call
    (`ModelRunner.greedy_steps`, what the drafter runs for a lone greedy row) over k; else (or where
    the model cannot) one forward of one token per sequence."""
    if b == 1:
        start = time.perf_counter()
        if runner.greedy_steps(0, [1], c, k) is not None:
            return (time.perf_counter() - start) / k
    return _time_run(runner, b, 1, c)


def measure_profile(
    target: LoadedModel,
    draft: LoadedModel | None,
    *,
    max_num_seqs: int = 64,
    k: int = 4,
    contexts: tuple[int, ...] | None = None,
    budget_seconds: float = DEFAULT_BUDGET_SECONDS,
    repeats: int = 5,
    progress: Progress | None = None,
) -> HardwareProfile:
    """Time the target's forward over the (B, T, C) grid and the drafter's step per (B, C); fit.

    The K/V cache holds zeros (timing does not depend on its values); each sequence's blocks are
    consecutive, as a lone sequence's are in the engine (batch 1 takes the consecutive-slot path).
    The budget covers everything after the models are loaded: the two ends of the grid are probed
    first, and the points whose estimated runs would overrun it are skipped (`skipped`).
    contexts: None = DEFAULT_CONTEXTS, each cut to the models' positions."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if not 1 <= k <= 63:
        raise ValueError(f"k must be in [1, 63], got {k}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not budget_seconds > 0:
        raise ValueError(f"budget_seconds must be > 0, got {budget_seconds}")
    max_len = target.config.max_position_embeddings
    if draft is not None:
        max_len = min(max_len, draft.config.max_position_embeddings)
    if contexts is None:  # the defaults, cut to what the models' positions allow
        contexts = [min(c, max(max_len - k - 1, 0)) for c in DEFAULT_CONTEXTS]
    contexts = sorted({int(c) for c in contexts})
    if not contexts or contexts[0] < 0 or contexts[-1] + k + 1 > max_len:
        raise ValueError(f"contexts must be in [0, {max_len - k - 1}] (the models' {max_len} positions, "
                         f"minus k+1), got {contexts}")
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    t_begin = time.perf_counter()
    deadline = t_begin + budget_seconds
    bs = batch_sizes(max_num_seqs)
    block_size = 16
    per_seq = -(-(contexts[-1] + k + 1) // block_size)
    runners = {"target": ModelRunner(target, per_seq * max_num_seqs, block_size)}
    if draft is not None:
        runners["draft"] = ModelRunner(draft, per_seq * max_num_seqs, block_size)
    for r in runners.values():
        for s in range(max_num_seqs):
            r.kv.reserve(s, contexts[-1] + k + 1)

    # cost estimate per forward, linear in the tokens fed, from the two ends of the grid (each run
    # twice: the first call of a shape pays one-time costs)
    t_small = min(_time_run(runners["target"], 1, 1, contexts[0]) for _ in range(2))
    n_big = max_num_seqs * (k + 1)
    t_big = min(_time_run(runners["target"], max_num_seqs, k + 1, contexts[-1]) for _ in range(2))

    def estimate(model: str, b: int, t: int) -> float:
        if model == "draft":
            t = 1  # a draft step costs at most a target step of the same shape
        return t_small + (t_big - t_small) * (b * t - 1) / max(n_big - 1, 1)

    # plan: points in priority order while their estimated runs (one untimed + repeats) fit
    points, skipped, planned = [], [], time.perf_counter()
    for model, b, t, c in _points(bs, k, contexts, draft is not None):
        cost = estimate(model, b, t) * (1 + repeats)
        if planned + cost > deadline:
            skipped.append({"model": model, "num_seqs": b, "tokens_per_seq": t, "context": c})
        else:
            points.append((model, b, t, c))
            planned += cost
    # one untimed run per point (a shape's first call pays one-time costs), then `repeats` rounds
    # over all points: a burst of load from other processes spoils one sample of many points, which
    # the median discards, rather than every sample of one point
    samples: dict[tuple, list[float]] = {pt: [] for pt in points}
    total, done = len(points) * (1 + repeats), 0
    for r in range(1 + repeats):
        for pt in points:
            if time.perf_counter() > deadline:
                break
            if progress is not None:
                progress(done, total, f"round {r}/{repeats}: {pt[0]} B={pt[1]} T={pt[2]} C={pt[3]}")
            sec = (_time_draft_step(runners["draft"], pt[1], pt[3], k) if pt[0] == "draft"
                   else _time_run(runners[pt[0]], *pt[1:]))
            if r:
                samples[pt].append(sec)
            done += 1
    if progress is not None:
        progress(total, total, "fitting")
    grid: list[GridPoint] = []
    draft_grid: list[DraftPoint] = []
    for (model, b, t, c), secs in samples.items():
        if not secs:
            skipped.append({"model": model, "num_seqs": b, "tokens_per_seq": t, "context": c})
        elif model == "target":
            grid.append(GridPoint(b, t, c, statistics.median(secs), len(secs)))
        else:
            draft_grid.append(DraftPoint(b, c, statistics.median(secs), len(secs)))
    if not grid:
        raise ValueError(f"a budget of {budget_seconds:g} s measured no point of the grid; raise it")
    grid.sort(key=lambda p: (p.context, p.num_seqs, p.tokens_per_seq))
    draft_grid.sort(key=lambda p: (p.context, p.num_seqs))
    cost = fit_cost_model(grid, draft_grid)
    threads = torch.get_num_threads()
    return HardwareProfile(
        machine={**machine_info(), "load_average": load_before},  # other work competes when high
        torch=torch.__version__, device=str(runners["target"].device), threads=threads,
        dtype=_dtype_name(runners["target"].dtype),
        draft_dtype=_dtype_name(runners["draft"].dtype) if draft is not None else None,
        models={"target": _model_entry(target), "draft": _model_entry(draft)},
        settings={"max_num_seqs": max_num_seqs, "k": k, "contexts": contexts, "budget_seconds": budget_seconds,
                  "repeats": repeats},
        grid=grid, draft_grid=draft_grid, cost=cost, fit=fit_errors(cost, grid, draft_grid), skipped=skipped,
        measured_seconds=round(time.perf_counter() - t_begin, 3),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


# ---- the engine's entry point -------------------------------------------------------------------

def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _mismatch(prof: HardwareProfile, want: dict, max_num_seqs: int, k: int) -> str | None:
    """Why a cached profile does not serve this run (None: it does)."""
    # a run without a drafter (n-gram, plain): a profile measured with one serves it too
    drafter = want["draft"] is not None
    for key in ("dtype", "draft_dtype", "device", "threads") if drafter else ("dtype", "device", "threads"):
        if getattr(prof, key) != want[key]:
            return f"{key} {getattr(prof, key)!r} != {want[key]!r}"
    for role in ("target", "draft") if drafter else ("target",):
        have = (prof.models.get(role) or {}).get("fingerprint")
        if have != want[role]:
            return f"{role} model fingerprint changed"
        quant = (prof.models.get(role) or {}).get("quantization")
        if want[role] is not None and quant != want[f"{role}_quantization"]:
            return f"{role} weights {quant or 'float'} != {want[f'{role}_quantization'] or 'float'}"
    if prof.machine.get("cpu") != want["cpu"]:
        return "another CPU"
    if prof.settings.get("max_num_seqs", 0) < max_num_seqs or prof.settings.get("k", 0) < k:
        return "a smaller grid (max_num_seqs or k)"
    return None


def load_or_measure(
    target: LoadedModel,
    draft: LoadedModel | None,
    *,
    dtype: str | None = None,
    draft_dtype: str | None = None,
    device: str | None = None,
    threads: int | None = None,
    max_num_seqs: int = 64,
    k: int = 4,
    path: str | Path | None = None,
    budget_seconds: float = DEFAULT_BUDGET_SECONDS,
    log: Callable[[str], None] = _stderr,
    progress: Progress | None = None,
) -> HardwareProfile:
    """The profile of this pair and these settings: from `path` when given (used even if it was
    measured for other settings: `log` says so); else from the cache file when it matches (model
    fingerprints, dtypes, device, threads, CPU, a grid at least as large); else measured now and
    written to the cache (a grid of at least CACHE_GRID, so that runs with a smaller max_num_seqs
    or k find it covered).

    dtype, draft_dtype, device and threads are read from the loaded models and from
    `torch.get_num_threads()` (what a measurement records); when given, they must agree with them
    (ValueError otherwise), so that a cache file once written is found again."""
    t_param = next(target.model.parameters())
    want = {
        "dtype": _dtype_name(t_param.dtype),
        "draft_dtype": None if draft is None else _dtype_name(next(draft.model.parameters()).dtype),
        "device": str(t_param.device),
        "threads": torch.get_num_threads(),
        "target": model_fingerprint(target.path),
        "draft": None if draft is None else model_fingerprint(draft.path),
        "target_quantization": quantization_of(target.model),
        "draft_quantization": None if draft is None else quantization_of(draft.model),
        "cpu": machine_info()["cpu"],
    }
    given = {"dtype": dtype, "draft_dtype": draft_dtype if draft is not None else None, "threads": threads}
    for key, value in given.items():
        if value is not None and str(value).removeprefix("torch.") != str(want[key]):
            raise ValueError(f"load_or_measure: {key}={value!r}, but the models and torch run with {want[key]!r}")
    if device is not None and torch.device(device).type != t_param.device.type:
        raise ValueError(f"load_or_measure: device={device!r}, but the target is on {want['device']!r}")
    if path is not None:
        prof = HardwareProfile.load(path)
        why = _mismatch(prof, want, max_num_seqs, k)
        if why:
            log(f"draftwise: warning: hardware profile {path} was measured for other settings ({why}); using it")
        return prof
    cache = profile_cache_path(target.path, None if draft is None else draft.path, want["dtype"],
                               want["draft_dtype"], want["device"], want["threads"],
                               want["target_quantization"] or want["draft_quantization"])
    if cache.is_file():
        try:
            prof = HardwareProfile.load(cache)
            why = _mismatch(prof, want, max_num_seqs, k)
        except ValueError as e:
            prof, why = None, str(e)
        if why is None:
            return prof
        if prof is not None:  # keep the larger grid of the two
            max_num_seqs = max(max_num_seqs, prof.settings.get("max_num_seqs", 0))
            k = max(k, prof.settings.get("k", 0))
        log(f"draftwise: cached hardware profile {cache} does not match ({why}); measuring again")
    max_num_seqs, k = max(max_num_seqs, CACHE_GRID[0]), max(k, CACHE_GRID[1])
    log(f"draftwise: measuring a hardware profile for this model pair (once, <= {budget_seconds:g} s) -> {cache}")
    prof = measure_profile(target, draft, max_num_seqs=max_num_seqs, k=k, budget_seconds=budget_seconds,
                           progress=progress)
    try:
        prof.save(cache)
    except OSError as e:
        log(f"draftwise: warning: cannot write the hardware profile cache {cache} ({e})")
    return prof
