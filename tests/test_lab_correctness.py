"""Lab correctness helpers: first difference, chi-square against scipy, workloads."""
import json
import os
from collections import Counter

import pytest

from draftwise.lab import correctness
from draftwise.lab.workload import load_workload, shipped_workloads


def test_first_difference_and_greedy_comparison():
    assert correctness.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert correctness.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert correctness.first_difference([1, 2], [1, 2, 3]) == 2
    c = correctness.greedy_comparison(["a", "b", "c"], [[1, 2], [3, 4], [5]], [[1, 2], [3, 9], [6]])
    assert c["mismatching_requests"] == 2 and c["first_differing_position"] == 0


def test_chi_square_matches_scipy():
    from scipy.stats import chi2_contingency

    a = Counter({1: 50, 2: 30, 3: 20, 4: 3})
    b = Counter({1: 40, 2: 45, 3: 15, 4: 4})
    stat, dof, p = correctness.chi_square_homogeneity(a, b, min_cell=10)
    # token 4 (7 in total) is pooled into its own "rare" cell
    table = [[50, 30, 20, 3], [40, 45, 15, 4]]
    ref = chi2_contingency(table, correction=False)
    assert stat == pytest.approx(ref.statistic) and dof == ref.dof and p == pytest.approx(ref.pvalue, rel=1e-6)


def test_chi2_sf_matches_scipy():
    from scipy.stats import chi2

    for x, k in ((0.5, 1), (3.0, 2), (10.0, 4), (40.0, 17)):
        assert correctness.chi2_sf(x, k) == pytest.approx(chi2.sf(x, k), rel=1e-9)


def test_total_variation():
    assert correctness.total_variation(Counter({1: 5, 2: 5}), Counter({1: 10})) == pytest.approx(0.5)


def test_shipped_workloads_valid():
    assert shipped_workloads() == ["chat-grounded", "chat-open", "code-easy", "code-hard", "file-edit", "grounded",
                                   "json", "json-edit", "shared-prefix"]
    for name in shipped_workloads():
        wl = load_workload(name)
        assert 16 <= len(wl.requests) <= 32
        low = 32 if name == "shared-prefix" else 64
        high = 256 if name.endswith("-edit") else 128  # (edits re-emit a whole excerpt)
        assert all(low <= r.max_tokens <= high and len(r.prompt) < 3000 for r in wl.requests)
        chat = name.startswith("chat-") or name.endswith("-edit")
        assert all(bool(r.messages) == chat for r in wl.requests)  # chat: messages
        assert wl.sampled == (name == "code-hard")
    shared = [r.prompt for r in load_workload("shared-prefix").requests]
    common = len(os.path.commonprefix(shared))
    assert common >= 1500 and all(len(p) > common for p in shared)  # one long preamble, then distinct
    g = load_workload("grounded").requests[0]
    head = g.prompt.splitlines()[-1]
    assert g.prompt.count(head) == 2  # the function is shown, then asked for again
    assert all(r.structured_output and "json_schema" in r.structured_output for r in load_workload("json").requests)


def test_workload_file_errors(tmp_path):
    p = tmp_path / "w.jsonl"
    p.write_text(json.dumps({"id": "a", "prompt": "x", "max_tokens": 4}) + "\n" + json.dumps({"id": "b", "prompt": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"w.jsonl:2: missing field 'max_tokens'"):
        load_workload(str(p))
    p.write_text(json.dumps({"id": "a", "prompt": "x", "max_tokens": 4, "temperature": -1}) + "\n")
    with pytest.raises(ValueError, match="temperature"):
        load_workload(str(p))
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("nope")
    p.write_text(json.dumps({"id": "a", "prompt": "x", "max_tokens": 4}) + "\n")
    wl = load_workload(str(p)).head(3)
    assert [r.id for r in wl.requests] == ["a", "a#1", "a#2"]
