"""`draftwise bench --quick` end to end on the tiny test models (the CI smoke test)."""
import gc
import json
from pathlib import Path

import pytest

from draftwise.cli.main import main


def rss_mib() -> float | None:
    """This process's resident set now (Linux), in MiB."""
    status = Path("/proc/self/status")
    if not status.is_file():
        return None
    for line in status.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def test_bench_quick(target_dir, draft_dir, tmp_path):
    out = tmp_path / "bench"
    md = tmp_path / "BENCH.md"
    gc.collect()
    rss_before = rss_mib()  # torch and the test models are already in: every run's peak is above it
    rc = main(["bench", "--quick", "--model", str(target_dir), "--draft", str(draft_dir), "--out", str(out),
               "--slo", "ttft=60000,tpot=60000", "--dollars-per-hour", "2.5", "--markdown", str(md)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["schema"] == "draftwise.bench/1"
    assert {"cpu", "torch", "torch_threads", "git_commit"} <= set(res["environment"])
    names = [w["name"] for w in res["workloads"]]
    assert names == ["grounded", "code-hard"]
    for wl in res["workloads"]:
        configs = {(r["config"], r["level_label"]) for r in wl["runs"]}
        assert configs == {(c, lv) for c in ("none", "draft:k=4", "ngram:k=4") for lv in ("c=1", "c=4")}
        none = {r["level_label"]: r for r in wl["runs"] if r["config"] == "none"}
        for r in wl["runs"]:
            assert r["completed"] == 8 and r["output_tokens"] == 8 * 32
            assert r["goodput_requests_per_s"] == r["requests_per_s"]  # generous SLOs
            assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["wall_seconds"])
            # $2.5 an hour spread over the tokens of that hour, per million
            assert r["cost_per_million_output_tokens"] == pytest.approx(2.5 / 3600 / r["output_tokens_per_s"] * 1e6)
            ref = none[r["level_label"]]["output_tokens_per_s"]
            assert r["vs_none"]["speedup"] == pytest.approx(r["output_tokens_per_s"] / ref)
            if r["config"] == "none":
                assert r["vs_none"]["speedup"] == 1.0
            if rss_before is not None:  # MiB, not bytes or KiB: above what the process held before
                assert 0.8 * rss_before <= r["memory"]["peak_rss_mib"] < 64 * 1024
            if r["config"] != "none":
                assert r["speculation"]["proposed_tokens"] > 0 or r["config"].startswith("ngram")
                sp = r["speculation"]
                assert 0 <= sp["accepted_tokens"] <= sp["proposed_tokens"] <= 4 * sp["rounds"]
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


def test_configs_with_a_policy_and_output_len():
    from draftwise.lab.runner import BenchPlan, parse_configs
    from draftwise.lab.workload import Request

    cfgs = parse_configs("draft:k=4,draft:k=4:policy=goodput,ngram:k=3:policy=adaptive", profile="p.json")
    assert [c.label for c in cfgs] == ["none", "draft:k=4", "draft:k=4:policy=goodput", "ngram:k=3:policy=adaptive"]
    assert [c.spec.policy for c in cfgs[1:]] == ["fixed", "goodput", "adaptive"]
    assert cfgs[2].spec.profile == "p.json"
    for bad in ("draft:k=4:policy=nope", "draft:policy=", "draft:x=1"):
        with pytest.raises(ValueError):
            parse_configs(bad)
    req = Request("r", "x", 32, 0.0)
    assert BenchPlan([], [], [], max_tokens=16).tokens_for(req) == 16
    assert BenchPlan([], [], [], max_tokens=16, output_len=200).tokens_for(req) == 200


def test_find_capacity_search_and_report(target_dir, tmp_path):
    from draftwise.lab.capacity import find_capacity, slo_holds

    # a server that holds the SLO up to 3.3 requests/s: doubling, then bisection to within 10%
    def measure(rate):
        lat = 40.0 if rate <= 3.3 else 80.0
        return {"num_requests": 8, "completed": 8, "requests_per_s": rate, "tpot_ms": {"p90": lat}}

    res = find_capacity(measure, {"tpot": 50.0}, start_rate=1.0)
    assert 3.0 <= res["requests_per_s"] <= 3.3 and res["converged"]
    assert [p["held"] for p in res["probes"]][:3] == [True, True, False]  # 1, 2 held; 4 broke
    assert not slo_holds({"num_requests": 8, "completed": 7, "tpot_ms": {"p90": 1.0}}, {"tpot": 50.0})
    with pytest.raises(ValueError):
        find_capacity(measure, {})
    out = tmp_path / "cap"
    rc = main(["bench", "--model", str(target_dir), "--configs", "ngram:k=2", "--workload", "grounded",
               "--num-requests", "3", "--max-tokens", "6", "--find-capacity", "--slo", "e2e=60000",
               "--capacity-start-rate", "50", "--repeats", "2", "--out", str(out)])
    assert rc == 0
    wl = json.loads((out / "results.json").read_text())["workloads"][0]
    assert set(wl["capacity"]) == {"none", "ngram:k=2"} and not wl["runs"]
    for c in wl["capacity"].values():
        assert c["requests_per_s"] >= 50 and c["probes"][0]["held"] and c["probes"][0]["runs"] == 2
    report = (out / "report.md").read_text()
    assert "requests/s at the latency limit" in report
    assert "Not converged" in report  # e2e <= 60 s held at every rate probed: said, with the rates achieved
    assert main(["bench", "--model", str(target_dir), "--find-capacity", "--out", str(out)]) == 2  # no --slo


def test_capacity_searches_run_in_lock_step_their_runs_interleaved():
    """Every config's search advances one probe at a time, the configs' runs interleaved run by run
    (order rotated), so that drift weighs on none more than on the others; each probe's median run
    decides; a search that has converged stops probing while the others go on."""
    from draftwise.lab.capacity import find_capacities

    calls = []

    def server(name, limit):
        def run(rate, rnd):
            calls.append((name, rate, rnd))
            slow = rnd == 0 and name == "a"  # one slow run of three: the median decides
            lat = 80.0 if rate > limit or slow else 40.0
            return {"num_requests": 8, "completed": 8, "requests_per_s": rate, "tpot_ms": {"p90": lat}}
        return run

    res = find_capacities({"a": server("a", 3.3), "b": server("b", 12.0)}, {"tpot": 50.0}, repeats=3,
                          start_rate=1.0)
    assert 3.0 <= res["a"]["requests_per_s"] <= 3.3 and res["a"]["converged"]
    assert 10.8 <= res["b"]["requests_per_s"] <= 12.0 and res["b"]["converged"]
    assert all(p["runs"] == 3 for r in res.values() for p in r["probes"])
    # the first probe step: both at 1 req/s, three runs each, alternating with the order rotated
    assert [c[0] for c in calls[:6]] == ["a", "b", "b", "a", "a", "b"]
    # while both search, every step runs both; after one converged the other's steps run alone
    steps = len(res["a"]["probes"])
    assert [c[0] for c in calls[: 6 * steps]].count("a") == 3 * steps
    assert {c[0] for c in calls[6 * steps:]} == {"b"} and len(res["b"]["probes"]) > steps


def test_capacity_table_says_when_the_slo_never_broke():
    from draftwise.lab.tables import capacity_table

    def cap(first_failing, achieved):
        probes = [{"rate": r, "held": r != first_failing, "achieved_requests_per_s": a} for r, a in achieved]
        held = [p["rate"] for p in probes if p["held"]]
        return {"requests_per_s": max(held), "first_failing_rate": first_failing, "probes": probes,
                "slo_ms": {"tpot": 5.0}, "converged": first_failing is not None}

    bounded = capacity_table({"capacity": {"none": cap(16, [(8, 7.4), (16, 12.0)])}})
    assert "Not converged" not in bounded and "| none | 8 |" in bounded
    unbounded = capacity_table({"capacity": {"none": cap(None, [(8, 7.4), (512, 43.5), (256, 40.1)])}})
    assert "Not converged" in unbounded and "none 43.5" in unbounded


def test_a_repeated_capacity_probe_is_decided_by_its_median_run():
    from draftwise.lab.capacity import median_probe, slo_margin

    def run(p90, completed=8):
        return {"num_requests": 8, "completed": completed, "tpot_ms": {"p90": p90}, "ttft_ms": {"p90": 100.0}}

    slo = {"tpot": 20.0, "ttft": 1000.0}
    assert slo_margin(run(30.0), slo) == 1.5 and slo_margin(run(10.0), slo) == 0.5
    assert slo_margin(run(10.0, completed=7), slo) == float("inf")
    # one slow run of three does not break the rate, one fast run does not save it
    assert median_probe([run(30.0), run(12.0), run(15.0)], slo)["tpot_ms"]["p90"] == 15.0
    assert median_probe([run(25.0), run(12.0), run(22.0)], slo)["tpot_ms"]["p90"] == 22.0
    assert median_probe([run(5.0, completed=7), run(12.0), run(9.0)], slo)["tpot_ms"]["p90"] == 12.0


def test_bench_repeats_reports_the_median_round(target_dir, draft_dir, tmp_path):
    """--repeats 3: three rounds of every config per level; the figures are the median round's."""
    out = tmp_path / "rep"
    assert main(["bench", "--model", str(target_dir), "--draft", str(draft_dir), "--workload", "code-hard",
                 "--configs", "none,draft:k=2", "--concurrency", "2", "--max-tokens", "8", "--repeats", "3",
                 "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["repeats"] == 3
    for r in res["workloads"][0]["runs"]:
        rates = r["rounds"]["output_tokens_per_s"]
        assert len(rates) == 3 and r["output_tokens_per_s"] == sorted(rates)[1]
        assert r["rounds"]["greedy_outputs_identical"] is True
    assert main(["bench", "--model", str(target_dir), "--configs", "none", "--repeats", "0", "--out", str(out)]) == 2


def test_median_trial_picks_the_upper_middle():
    from draftwise.lab.runner import median_trial

    trials = [({"output_tokens_per_s": v}, v) for v in (5.0, 1.0, 3.0, 9.0)]
    assert median_trial(trials)[1] == 5.0
    assert median_trial(trials[:3])[1] == 3.0
    assert median_trial(trials[:2])[1] == 5.0


def test_stop_at_eos_lets_replies_end_where_the_model_ends_them(target_dir, tmp_path, monkeypatch, capsys):
    """--stop-at-eos: the measured requests' params honour EOS (the default ignores it: fixed lengths)."""
    from draftwise.lab import runner

    seen = []
    real = runner.sampling_params

    def spy(*args, **kwargs):
        p = real(*args, **kwargs)
        seen.append(p.ignore_eos)
        return p

    monkeypatch.setattr(runner, "sampling_params", spy)
    base = ["bench", "--model", str(target_dir), "--configs", "none", "--workload", "file-edit", "--concurrency", "1",
            "--num-requests", "2", "--max-tokens", "6"]
    assert main(base + ["--out", str(tmp_path / "a")]) == 0
    assert seen and all(seen)
    seen.clear()
    assert main(base + ["--stop-at-eos", "--out", str(tmp_path / "b")]) == 0
    assert seen[:2] == [False, False]  # the measured requests' (the warm-up's after them runs fixed lengths)
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    assert res["settings"]["stop_at_eos"] is True and res["workloads"][0]["runs"][0]["completed"] == 2
    assert main(base + ["--stop-at-eos", "--output-len", "8", "--out", str(tmp_path / "c")]) == 2
    assert "does not combine with --stop-at-eos" in capsys.readouterr().err
