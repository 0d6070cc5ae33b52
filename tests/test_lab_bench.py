"""`draftwise bench --quick` end to end on the tiny test models (the CI smoke test)."""
import json
import time

from draftwise.cli.main import main


def test_bench_quick(target_dir, draft_dir, tmp_path):
    out = tmp_path / "bench"
    md = tmp_path / "BENCH.md"
    t0 = time.perf_counter()
    rc = main(["bench", "--quick", "--model", str(target_dir), "--draft", str(draft_dir), "--out", str(out),
               "--slo", "ttft=60000,tpot=60000", "--dollars-per-hour", "2.5", "--markdown", str(md)])
    assert rc == 0
    assert time.perf_counter() - t0 < 120
    res = json.loads((out / "results.json").read_text())
    assert res["schema"] == "draftwise.bench/1"
    assert {"cpu", "torch", "torch_threads", "git_commit"} <= set(res["environment"])
    names = [w["name"] for w in res["workloads"]]
    assert names == ["grounded", "code-hard"]
    for wl in res["workloads"]:
        configs = {(r["config"], r["level_label"]) for r in wl["runs"]}
        assert configs == {(c, lv) for c in ("none", "draft:k=4", "ngram:k=4") for lv in ("c=1", "c=4")}
        for r in wl["runs"]:
            assert r["completed"] == 8 and r["output_tokens"] == 8 * 32
            assert r["goodput_requests_per_s"] == r["requests_per_s"]  # generous SLOs
            assert r["cost_per_million_output_tokens"] > 0
            assert r["vs_none"]["speedup"] > 0
            assert r["memory"]["peak_rss_mib"] > 0
            if r["config"] != "none":
                assert r["speculation"]["proposed_tokens"] > 0 or r["config"].startswith("ngram")
        for p in wl["plots"]:
            assert (out / p).stat().st_size > 1000
    grounded, hard = res["workloads"]
    # greedy workload: every config reproduces `none` token for token
    for r in grounded["runs"]:
        assert r["correctness"]["compared"] == 8 and r["correctness"]["mismatching_requests"] == 0
    # sampled workload: a distribution comparison per speculative config
    assert set(hard["distribution"]) == {"draft:k=4", "ngram:k=4"}
    assert all(0.0 <= d["p_value"] <= 1.0 for d in hard["distribution"].values())
    report = (out / "report.md").read_text()
    assert "## grounded" in report and "speedup" in report
    assert "](bench/grounded-concurrency.png)" in md.read_text()


def test_bench_open_loop_and_errors(target_dir, tmp_path, capsys):
    rc = main(["bench", "--model", str(target_dir), "--configs", "none,ngram:k=2", "--workload", "grounded",
               "--request-rate", "50", "--burstiness", "0.5", "--num-requests", "4", "--max-tokens", "8",
               "--out", str(tmp_path / "o")])
    assert rc == 0
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    runs = res["workloads"][0]["runs"]
    assert [r["level"] for r in runs] == [{"kind": "rate", "value": 50.0, "burstiness": 0.5}] * 2
    assert all(r["completed"] == 4 for r in runs)
    assert main(["bench", "--configs", "draft:k=x", "--model", str(target_dir)]) == 2
    assert main(["bench", "--workload", "nope", "--model", str(target_dir)]) == 2
    assert "unknown workload" in capsys.readouterr().err
