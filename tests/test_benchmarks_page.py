"""BENCHMARKS.md is generated from benchmarks/results/*.json: the page matches the files, and the
summary of a lab run keeps what the page shows."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _page():
    spec = importlib.util.spec_from_file_location("benchmarks_page", ROOT / "benchmarks" / "page.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmarks_md_matches_the_result_files():
    page = _page()
    expected = page.render(page.load_results())
    assert (ROOT / "BENCHMARKS.md").read_text() == expected, \
        "BENCHMARKS.md is stale: run .venv/bin/python benchmarks/page.py"


def test_every_result_names_its_command_and_machine():
    for res in _page().load_results():
        assert res["command"].strip() and res["machine"].strip(), res["_file"]
        assert res.get("tables") or res.get("lab"), res["_file"]


def _run(config, level, tok_s, per_round=1.0, mismatches=0):
    return {"config": config, "level_label": level, "output_tokens_per_s": tok_s,
            "speculation": {"mean_accepted_length": per_round},
            "correctness": {"compared": 4, "mismatching_requests": mismatches}}


def test_a_lab_summary_renders_speedups_and_the_policy_against_the_better_arm(tmp_path):
    page = _page()
    results = {"command": ["draftwise", "bench", "--out", "x"], "environment": {"cpu": "CPU"},
               "workloads": [{"name": "w", "runs": [
                   _run("none", "c=1", 100.0), _run("none", "c=8", 400.0),
                   _run("draft:k=4", "c=1", 200.0, 3.0), _run("draft:k=4", "c=8", 300.0, 3.0, mismatches=1),
                   _run("draft:k=4:policy=goodput", "c=1", 190.0, 2.9), _run("draft:k=4:policy=goodput", "c=8", 380.0),
               ]}]}
    src = tmp_path / "results.json"
    src.write_text(json.dumps(results))
    page.RESULTS = tmp_path / "results"
    page.RESULTS.mkdir()
    dest = page.import_lab(src, "t", "policy", "title", ["a note"], 1)
    res = json.loads(dest.read_text())
    assert "--out" not in res["command"]
    text = page.render(page.load_results(page.RESULTS))
    assert "| draft:k=4 | **2.00x** (3.00) | 0.75x (3.00) |" in text
    # goodput over max(none, fixed): 190/200 at c=1, 380/400 at c=8
    assert "| draft:k=4:policy=goodput / max(none, draft:k=4) | 0.95 | 0.95 | 0.950 |" in text
    assert "16 requests, 1 differing" in text


def test_an_ab_at_one_level_renders_its_ratios_in_one_table(tmp_path):
    """"ratios_only": no speedup tables; at one level a column per workload, with the geomean."""
    page = _page()
    runs = lambda w, none, fixed, pol, copy: [  # noqa: E731
        _run("none", "c=8", none), _run("draft:k=4", "c=8", fixed, 3.0), _run("draft:k=4:copy=2", "c=8", copy, 3.0),
        _run("draft:k=4:policy=goodput", "c=8", pol, 2.0)]
    results = {"command": ["draftwise", "bench"], "environment": {"cpu": "CPU"}, "workloads": [
        {"name": "a", "runs": runs("a", 100.0, 200.0, 180.0, 202.0)},
        {"name": "b", "runs": runs("b", 400.0, 200.0, 360.0, 198.0)}]}
    src = tmp_path / "results.json"
    src.write_text(json.dumps(results))
    page.RESULTS = tmp_path / "results"
    page.RESULTS.mkdir()
    dest = page.import_lab(src, "t", "policy", "title", [], 1)
    res = json.loads(dest.read_text())
    res["ratios_only"] = True
    text = "\n".join(page.render_result(res))
    assert "speedup vs none" not in text
    assert "| ratio at c=8 | a | b | geomean |" in text
    assert "| draft:k=4:policy=goodput / max(none, draft:k=4) | 0.90 | 0.90 | 0.900 |" in text
    assert "| draft:k=4:copy=2 / draft:k=4 (A/A control) | 1.01 | 0.99 | 1.000 |" in text


def test_a_result_in_an_unknown_section_is_refused(tmp_path):
    page = _page()
    (tmp_path / "x.json").write_text(json.dumps({"section": "nowhere", "title": "t", "command": "c",
                                                  "machine": "m", "tables": []}))
    with pytest.raises(ValueError, match="section must be one of"):
        page.load_results(tmp_path)
