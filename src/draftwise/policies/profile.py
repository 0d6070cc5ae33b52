"""The hardware profile a run uses: found in the cache, or measured now (`load_or_measure`).

The record and its identity are in hardware.py (`HardwareProfile`, `machine_info`,
`model_fingerprint`), the measurement in measure.py (`measure_profile`), the fit in fit.py;
they are importable from here too. `load_or_measure` is what the engine calls: an explicit file,
else a cache file keyed by the pair and the run settings (`profile_cache_path`, under
`$DRAFTWISE_CACHE/profiles`, default `~/.cache/draftwise`), else a measurement, written to the
cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Callable

import torch

from ..model import cpu_kernels
from ..model.loader import LoadedModel
from ..model.quantize import quantization_of
from .fit import fit_cost_model, fit_errors, predict_target  # noqa: F401 (re-exported)
from .hardware import (FINGERPRINT_BYTES, FORMAT, DraftPoint, GridPoint, HardwareProfile,  # noqa: F401 (re-exported)
                       dtype_name, machine_info, model_fingerprint)
from .measure import (TIMING, DEFAULT_BUDGET_SECONDS, DEFAULT_CONTEXTS, Progress, batch_sizes,  # noqa: F401
                      measure_profile)

CACHE_GRID = (64, 4)  # (max_num_seqs, k) measured at least for the cache: a bench that runs
                     # c=1, then 2, 4, ... finds the one profile covering each level


def cache_dir() -> Path:
    return Path(os.environ.get("DRAFTWISE_CACHE") or Path.home() / ".cache" / "draftwise") / "profiles"


def profile_cache_path(target_path: str | Path, draft_path: str | Path | None, dtype: str, draft_dtype: str | None,
                       device: str, threads: int, quantization: str | None = None) -> Path:
    """The cache file of a pair and run settings: keyed by the models' fingerprints (not their
    paths: a copy reuses the profile), dtypes, weight quantization, device, threads, the CPU
    model, how runs are timed (`measure.TIMING`) and, on CPU, the fused kernels' source (new
    kernels time differently: measured again) and whether products run on AMX tiles."""
    key = {
        "target": model_fingerprint(target_path),
        "draft": model_fingerprint(draft_path) if draft_path is not None else None,
        "dtype": str(dtype), "draft_dtype": str(draft_dtype) if draft_path is not None else None,
        "device": str(device), "threads": int(threads), "cpu": machine_info()["cpu"], "timing": TIMING,
    }
    if str(device) == "cpu":
        key["kernels"] = hashlib.sha256(cpu_kernels.source_bytes()).hexdigest()[:16]
        if cpu_kernels.amx_rows():  # (absent without tiles: the caches written before stay valid)
            key["amx_rows"] = cpu_kernels.amx_rows()
    if quantization is not None:  # (absent for float weights: the caches written before stay valid)
        key["quantization"] = quantization
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"{Path(target_path).name}-{digest}.json"


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
        "dtype": dtype_name(t_param.dtype),
        "draft_dtype": None if draft is None else dtype_name(next(draft.model.parameters()).dtype),
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
