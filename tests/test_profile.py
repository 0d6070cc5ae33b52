"""The hardware profile (policies/profile.py, hardware.py, measure.py): the fit, the budget, the
JSON, the cache, the CLI.

The fit and the budget logic run on synthetic times on a simulated clock (exact); the measurement
runs for real on the tiny models with a small grid, where only what does not depend on the
machine's speed is asserted (how fast a forward runs belongs in benchmarks).
"""
import json
import math
import types

import numpy as np
import pytest

from draftwise.cli.main import main
from draftwise.model import load_model
from draftwise.policies import measure as measure_mod
from draftwise.policies import profile as prof_mod
from draftwise.policies.cost import CostModel
from draftwise.policies.profile import (
    FORMAT, DraftPoint, GridPoint, HardwareProfile, fit_cost_model, load_or_measure, measure_profile,
    model_fingerprint, profile_cache_path,
)

TRUE_TARGET = (2e-3, 1e-4, 5e-4, 1e-7)  # t0, t_seq, t_tok, t_ctx
TRUE_DRAFT = (3e-4, 5e-5, 2e-8)


def synthetic(b: int, t: int, c: int, target=TRUE_TARGET) -> float:
    return CostModel(target, TRUE_DRAFT).target_seconds(b, b * t, c)


def synthetic_grid(target=TRUE_TARGET):
    grid = [GridPoint(b, t, c, synthetic(b, t, c, target)) for b in (1, 2, 4, 8) for t in (1, 2, 3, 5) for c in (64, 256)]
    draft = [DraftPoint(b, c, CostModel(target, TRUE_DRAFT).draft_seconds(b, c)) for b in (1, 2, 4, 8) for c in (64, 256)]
    return grid, draft


@pytest.fixture(scope="module")
def pair(target_dir, draft_dir):
    return load_model(target_dir), load_model(draft_dir, dtype="bfloat16", load_tokenizer=False)


@pytest.fixture(scope="module")
def small_profile(pair):
    target, draft = pair
    return measure_profile(target, draft, max_num_seqs=4, k=3, contexts=(16, 64), budget_seconds=5, repeats=3)


def test_fit_recovers_known_coefficients():
    grid, draft = synthetic_grid()
    cost = fit_cost_model(grid, draft)
    np.testing.assert_allclose(cost.target, TRUE_TARGET, rtol=1e-6)
    np.testing.assert_allclose(cost.draft, TRUE_DRAFT, rtol=1e-6)
    assert fit_cost_model(grid, []).draft == (0.0, 0.0, 0.0)  # no drafter measured


def test_fit_clamps_negative_coefficients():
    # a per-sequence term of -0.2 ms: unconstrained least squares reproduces it, the fit must not
    grid, _ = synthetic_grid(target=(1e-3, -2e-4, 1e-3, 0.0))
    x = np.array([[1, p.num_seqs, p.num_seqs * p.tokens_per_seq, p.num_seqs * p.context] for p in grid], float)
    free = np.linalg.lstsq(x, np.array([p.seconds for p in grid]), rcond=None)[0]
    assert free[1] < 0  # the premise
    cost = fit_cost_model(grid, [])
    assert min(cost.target) >= 0 and cost.target[1] == 0
    assert cost.target[2] > 0  # the refit without t_seq still charges per token
    # every prediction stays in the right range (the clamped term is absorbed by the others)
    for p in grid:
        assert 0.5 < cost.target_seconds(p.num_seqs, p.num_seqs * p.tokens_per_seq, p.context) / p.seconds < 1.5


def test_budget_skips_points_and_fit_is_exact_on_a_simulated_clock(pair, monkeypatch):
    """_time_run and the clock replaced by the synthetic cost: the planning and the fit, exactly."""
    clock = [0.0]

    def fake_run(runner, b, t, c):
        s = synthetic(b, t, c) if runner.loaded is pair[0] else CostModel(TRUE_TARGET, TRUE_DRAFT).draft_seconds(b, c)
        clock[0] += s
        return s

    monkeypatch.setattr(measure_mod, "_time_run", fake_run)
    monkeypatch.setattr(measure_mod, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    full = measure_profile(*pair, max_num_seqs=8, k=4, contexts=(32, 128), budget_seconds=100, repeats=3)
    assert not full.skipped and len(full.grid) == 4 * 5 * 2 and len(full.draft_grid) == 4 * 2
    np.testing.assert_allclose(full.cost.target, TRUE_TARGET, rtol=1e-6)
    np.testing.assert_allclose(full.cost.draft, TRUE_DRAFT, rtol=1e-6)
    assert full.fit["median_rel_error"] < 1e-9

    clock[0] = 0.0
    budget = 0.35 * full.measured_seconds
    cut = measure_profile(*pair, max_num_seqs=8, k=4, contexts=(32, 128), budget_seconds=budget, repeats=3)
    assert cut.skipped and cut.measured_seconds <= budget * 1.05
    assert len(cut.grid) + sum(s["model"] == "target" for s in cut.skipped) == 4 * 5 * 2
    measured = {(p.num_seqs, p.tokens_per_seq, p.context) for p in cut.grid}
    assert {(b, t, 32) for b in (1, 2, 4, 8) for t in (1, 5)} <= measured  # the first tier was kept
    assert all(s["tokens_per_seq"] not in (1, 5) or s["context"] != 32 for s in cut.skipped)
    assert {(p.num_seqs, p.context) for p in cut.draft_grid} >= {(b, 32) for b in (1, 2, 4, 8)}  # the drafter's too


def test_the_fit_leaves_out_what_the_points_cannot_tell_apart():
    """One drafter point (a slow target used up the budget) says nothing of a per-row or
    per-context cost: its time is the fixed cost, not spread over columns in proportion to their
    size (a minimum-norm fit had put nearly all of it on the context, so the drafter's step looked
    5x dearer at a 5x longer context). Points at one context: no per-context cost."""
    one = [types.SimpleNamespace(num_seqs=1, context=64, seconds=0.02)]
    grid, _ = synthetic_grid(target=(1e-3, 0.0, 1e-3, 0.0))
    cost = fit_cost_model(grid, one)
    assert cost.draft == pytest.approx((0.02, 0.0, 0.0))
    assert cost.draft_seconds(1, 320) == pytest.approx(0.02)
    rows = [types.SimpleNamespace(num_seqs=b, context=64, seconds=0.01 + 0.002 * b) for b in (1, 2, 4)]
    assert fit_cost_model(grid, rows).draft == pytest.approx((0.01, 0.002, 0.0))


def test_measured_profile_is_sane_and_round_trips(small_profile, tmp_path):
    p = small_profile
    assert p.threads >= 1 and p.device == "cpu" and p.dtype == "float32" and p.draft_dtype == "bfloat16"
    assert p.models["target"]["fingerprint"] == model_fingerprint(p.models["target"]["path"])
    assert all(s > 0 for s in (g.seconds for g in p.grid)) and p.draft_grid
    assert min(p.cost.target) >= 0 and min(p.cost.draft) >= 0
    assert math.isfinite(p.fit["median_rel_error"])  # the fit's error on the grid is recorded
    path = p.save(tmp_path / "sub" / "p.json")
    back = HardwareProfile.load(path)
    assert back.to_dict() == p.to_dict()
    assert json.loads(path.read_text())["format"] == FORMAT


def test_load_errors_name_the_path(tmp_path, small_profile):
    with pytest.raises(ValueError, match="p0.json.*not found"):
        HardwareProfile.load(tmp_path / "p0.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json.*not a readable"):
        HardwareProfile.load(bad)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**small_profile.to_dict(), "format": "draftwise.profile/0"}))
    with pytest.raises(ValueError, match="old.json.*format 'draftwise.profile/0'.*draftwise profile"):
        HardwareProfile.load(old)
    broken = tmp_path / "broken.json"
    d = small_profile.to_dict()
    del d["grid"]
    broken.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="broken.json.*malformed"):
        HardwareProfile.load(broken)


def test_load_or_measure_uses_the_cache_and_remeasures_on_a_changed_model(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prof_mod, "CACHE_GRID", (2, 2))  # the least grid measured for the cache (small: fast)
    target, draft = pair
    logs = []
    kw = dict(max_num_seqs=1, k=1, budget_seconds=3, log=logs.append)
    first = load_or_measure(target, draft, **kw)
    assert (first.settings["max_num_seqs"], first.settings["k"]) == (2, 2)  # CACHE_GRID, not the smaller ask
    cache = profile_cache_path(target.path, draft.path, "float32", "bfloat16", "cpu", first.threads)
    assert cache.is_file() and cache.parent == tmp_path / "cache" / "profiles"
    assert len(logs) == 1 and "measuring a hardware profile" in logs[0] and str(cache) in logs[0]

    logs.clear()
    again = load_or_measure(target, draft, **kw)
    assert logs == [] and again.to_dict() == first.to_dict()  # from the cache
    assert load_or_measure(target, draft, **{**kw, "k": 2, "max_num_seqs": 2}).created == first.created  # covered
    assert logs == []

    d = json.loads(cache.read_text())
    d["models"]["target"]["fingerprint"] = "0" * 64  # as if the model had been retrained in place
    cache.write_text(json.dumps(d))
    remeasured = load_or_measure(target, draft, **kw)
    assert any("fingerprint changed" in line for line in logs) and any("measuring" in line for line in logs)
    assert remeasured.models["target"]["fingerprint"] == model_fingerprint(target.path)
    assert HardwareProfile.load(cache).models["target"]["fingerprint"] == model_fingerprint(target.path)

    logs.clear()  # an explicit file is used as it is: one measured with a drafter serves a run
    explicit = load_or_measure(target, None, path=cache, **kw)  # without one (n-gram, plain) silently,
    assert explicit.to_dict() == remeasured.to_dict() and logs == []
    d = json.loads(cache.read_text())  # one from another machine with a warning
    d["machine"]["cpu"] = "another CPU model"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(d))
    assert load_or_measure(target, draft, path=other, **kw).machine["cpu"] == "another CPU model"
    assert len(logs) == 1 and "warning" in logs[0] and "another CPU" in logs[0]

    # settings that disagree with the loaded models would key a cache file never found again
    with pytest.raises(ValueError, match="dtype='bfloat16'.*'float32'"):
        load_or_measure(target, draft, dtype="bfloat16", **kw)
    with pytest.raises(ValueError, match="threads=99"):
        load_or_measure(target, draft, threads=99, **kw)
    load_or_measure(target, draft, dtype="float32", draft_dtype="bfloat16", device="cpu", threads=first.threads, **kw)


def test_cache_key_follows_settings(target_dir, draft_dir):
    a = profile_cache_path(target_dir, draft_dir, "float32", "bfloat16", "cpu", 2)
    assert a == profile_cache_path(target_dir, draft_dir, "float32", "bfloat16", "cpu", 2)
    assert a != profile_cache_path(target_dir, draft_dir, "float32", "bfloat16", "cpu", 1)
    assert a != profile_cache_path(target_dir, None, "float32", None, "cpu", 2)
    assert a != profile_cache_path(target_dir, draft_dir, "bfloat16", "bfloat16", "cpu", 2)
    assert a != profile_cache_path(target_dir, draft_dir, "float32", "bfloat16", "cpu", 2, "int8")


def test_cache_key_follows_the_amx_tiles(target_dir, draft_dir, monkeypatch):
    """Products on AMX tiles time differently: their own cache file; without tiles the key is the
    one written before they existed."""
    from draftwise.model import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "amx_rows", lambda: 0)
    off = profile_cache_path(target_dir, draft_dir, "float32", "bfloat16", "cpu", 2)
    monkeypatch.setattr(cpu_kernels, "amx_rows", lambda: 2)
    on = profile_cache_path(target_dir, draft_dir, "float32", "bfloat16", "cpu", 2)
    assert on != off
    monkeypatch.setattr(cpu_kernels, "amx_rows", lambda: 4)
    assert profile_cache_path(target_dir, draft_dir, "float32", "bfloat16", "cpu", 2) not in (on, off)


def test_a_float_profile_does_not_serve_int8_weights(pair, target_dir, tmp_path, monkeypatch):
    """int8 weights time differently: their own cache file, and a float profile given explicitly
    is used with a warning naming the difference."""
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prof_mod, "CACHE_GRID", (2, 2))
    target, draft = pair
    q8 = load_model(target_dir, quantization="int8")
    kw = dict(max_num_seqs=1, k=1, budget_seconds=3)
    float_prof = load_or_measure(target, draft, log=lambda m: None, **kw)
    assert float_prof.models["target"]["quantization"] is None
    logs = []
    q8_prof = load_or_measure(q8, draft, log=logs.append, **kw)
    assert any("measuring" in line for line in logs) and q8_prof.models["target"]["quantization"] == "int8"
    float_cache = profile_cache_path(target.path, draft.path, "float32", "bfloat16", "cpu", float_prof.threads)
    logs.clear()
    load_or_measure(q8, draft, path=float_cache, log=logs.append, **kw)
    assert any("target weights float != int8" in line for line in logs), logs


def test_cli_writes_profile_and_plot(target_dir, draft_dir, tmp_path, capsys):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    rc = main(["profile", "--model", str(target_dir), "--draft", str(draft_dir), "--max-num-seqs", "2", "--k", "2",
               "--contexts", "8,32", "--budget", "3", "--repeats", "2", "--out", str(out), "--plot", str(png)])
    assert rc == 0
    prof = HardwareProfile.load(out)
    assert {(g.num_seqs, g.tokens_per_seq) for g in prof.grid if g.context == 8} <= {(b, t) for b in (1, 2) for t in (1, 2, 3)}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "T=3" in text and "median relative error" in text and str(out) in text.replace("\n", "")


@pytest.mark.parametrize("argv, message", [
    (["--out", "/nonexistent-dir/p.json"], "--out: directory /nonexistent-dir does not exist"),
    (["--plot", "/nonexistent-dir/p.png"], "--plot: directory /nonexistent-dir does not exist"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--k", "0"], "--k must be in [1, 16]"),
    (["--budget", "-1"], "--budget must be > 0"),
    (["--contexts", "64,abc"], "--contexts: expected comma-separated integers"),
    (["--repeats", "0"], "--repeats must be >= 1"),
])
def test_cli_user_errors(argv, message, capsys):
    assert main(["profile", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
