"""Lab metrics from synthetic timestamps, against hand-computed values."""
import pytest

from draftwise.lab.metrics import RequestRecord, distribution, parse_slo, speculation_figures, stats_delta, summarize


def rec(rid, arrival, deliveries):
    return RequestRecord(rid, arrival, deliveries=deliveries)


@pytest.fixture
def records():
    # r1: first token at 0.5 s, then a round delivering 3 tokens at 0.7, then 1 at 1.0: 5 tokens
    r1 = rec("a", 0.0, [(0.5, 1), (0.7, 3), (1.0, 1)])
    # r2 arrives at 1.0, first token at 1.2, then one token at 1.6: 2 tokens
    r2 = rec("b", 1.0, [(1.2, 1), (1.6, 1)])
    return [r1, r2]


def test_per_request_figures(records):
    r1, r2 = records
    assert r1.output_tokens == 5
    assert r1.ttft == pytest.approx(0.5)
    assert r1.e2e == pytest.approx(1.0)
    assert r1.itls == pytest.approx([0.2, 0.3])  # tokens of one round arrive together: one gap
    assert r1.tpot == pytest.approx((1.0 - 0.5) / 4)
    assert r2.tpot == pytest.approx(0.4)
    assert rec("c", 0.0, [(0.3, 1)]).tpot is None


def test_summary(records):
    s = summarize(records, wall=2.0, slo={"ttft": 300.0}, dollars_per_hour=3.6)
    assert s["output_tokens"] == 7
    assert s["output_tokens_per_s"] == pytest.approx(3.5)
    assert s["requests_per_s"] == pytest.approx(1.0)
    # only r2 (TTFT 200 ms) meets ttft <= 300 ms
    assert s["goodput_requests_per_s"] == pytest.approx(0.5)
    assert s["slo_attainment"] == pytest.approx(0.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(350.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(350.0)
    assert s["ttft_ms"]["p90"] == pytest.approx(200 + 0.9 * 300)
    assert s["e2e_ms"]["p99"] == pytest.approx(600 + 0.99 * 400)
    assert s["itl_ms"]["p50"] == pytest.approx(300.0)  # gaps 200, 300, 400
    assert s["tpot_ms"]["mean"] == pytest.approx((125 + 400) / 2)
    assert s["tokens_per_delivery"] == pytest.approx(7 / 5)
    # $3.6/h = $0.001/s at 3.5 tok/s -> 0.001/3.5 * 1e6 $ per million tokens
    assert s["cost_per_million_output_tokens"] == pytest.approx(1e3 / 3.5)


def test_goodput_with_two_slos(records):
    s = summarize(records, wall=2.0, slo={"ttft": 600.0, "tpot": 200.0})
    # r1: ttft 500 ok, tpot 125 ok; r2: ttft 200 ok, tpot 400 too slow
    assert s["goodput_requests_per_s"] == pytest.approx(0.5)
    s = summarize(records, wall=2.0, slo={"e2e": 650.0})
    assert s["goodput_requests_per_s"] == pytest.approx(0.5)  # only r2 (600 ms)
    s = summarize(records, wall=2.0, slo={"itl": 350.0})
    # r1 p99 gap = 0.2 + 0.99 * 0.1 = 0.299 s ok; r2 gap 0.4 s too slow
    assert s["goodput_requests_per_s"] == pytest.approx(0.5)
    assert summarize(records, wall=2.0)["goodput_requests_per_s"] == pytest.approx(1.0)


def test_errors_and_empty():
    bad = RequestRecord("x", 0.0, error="boom")
    s = summarize([bad], wall=1.0, slo={"ttft": 1.0})
    assert s["completed"] == 0 and s["errors"] == 1 and s["goodput_requests_per_s"] == 0
    assert s["ttft_ms"]["p50"] is None
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_percentiles_linear_interpolation():
    d = distribution([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert d["p50"] == pytest.approx(5.5)
    assert d["p90"] == pytest.approx(9.1)
    assert d["p99"] == pytest.approx(9.91)


def test_parse_slo():
    assert parse_slo("ttft=500, tpot=50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_slo(None) == {}
    for bad in ("ttft", "foo=1", "tpot=-1"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_speculation_figures_and_delta():
    before = {"rounds": 2, "propose_seconds": 0.1, "verify_seconds": 0.2, "other_seconds": 0.0, "draft_tokens": 8,
              "accepted_tokens": 4, "committed_tokens": 6, "accepted_per_position": [2, 1, 1, 0],
              "committed_per_round": {3: 1, 2: 1}}
    after = {"rounds": 6, "propose_seconds": 0.5, "verify_seconds": 1.0, "other_seconds": 0.1, "draft_tokens": 24,
             "accepted_tokens": 10, "committed_tokens": 20, "accepted_per_position": [5, 3, 1, 1],
             "committed_per_round": {3: 2, 2: 1, 1: 1, 5: 1, 4: 1}}
    d = stats_delta(before, after)
    assert d["rounds"] == 4 and d["accepted_per_position"] == [3, 2, 0, 1]
    assert d["committed_per_round"] == {3: 1, 1: 1, 5: 1, 4: 1}
    f = speculation_figures(d, output_tokens=16)
    assert f["mean_accepted_length"] == pytest.approx(14 / 4)
    assert f["acceptance_rate"] == pytest.approx(6 / 16)
    assert f["acceptance_by_position"] == pytest.approx([0.75, 0.5, 0.0, 0.25])
    ms = f["ms_per_token"]
    assert ms["drafting"] == pytest.approx(400 / 16) and ms["verification"] == pytest.approx(800 / 16)
    assert ms["total"] == pytest.approx(1300 / 16)


def test_grown_lists_and_the_grammar_time_per_step():
    """Per-position counts grow past k when forced proposals go deeper (structured output): the
    delta pads the shorter list; the grammar's time per step is its own figure, and the report
    shows it against `none`'s step at the same level."""
    from draftwise.lab.tables import workload_table

    before = {"steps": 10, "accepted_per_position": [2, 1], "grammar_seconds": 0.01, "propose_seconds": 0.0,
              "verify_seconds": 0.1, "other_seconds": 0.0}
    after = {"steps": 30, "accepted_per_position": [5, 3, 2, 1], "grammar_seconds": 0.03, "propose_seconds": 0.2,
             "verify_seconds": 0.3, "other_seconds": 0.1, "rounds": 4, "accepted_tokens": 11, "committed_tokens": 15}
    d = stats_delta(before, after)
    assert d["accepted_per_position"] == [3, 2, 2, 1]
    f = speculation_figures(d, output_tokens=15)
    assert f["grammar_ms_per_step"] == pytest.approx(1.0) and f["step_ms"] == pytest.approx(25.0)
    assert speculation_figures({"steps": 5}, 5)["grammar_ms_per_step"] is None
    run = {"level_label": "c=1", "output_tokens_per_s": 1.0, "requests_per_s": 1.0, "goodput_requests_per_s": 1.0,
           **{k: {"p50": 1.0, "p99": 1.0} for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")}}
    table = workload_table({"runs": [dict(run, config="none", speculation={"step_ms": 8.0, "grammar_ms_per_step": 0.3}),
                                     dict(run, config="draft:k=4", speculation=f)]})
    assert "| 0.30 (3.8%) |" in table and "| 1.00 (12.5%) |" in table


def test_policy_against_the_better_fixed_choice():
    """The report rates a load-aware config at each point against the better of `none` and the same
    config verifying every proposal (its fixed counterpart): the question such a policy answers."""
    from draftwise.lab.policy_compare import policy_points, policy_summary

    def run(config, level, tps):
        return {"config": config, "level_label": level, "output_tokens_per_s": tps}

    wl = {"name": "w", "runs": [run("none", "c=1", 100.0), run("draft:k=4", "c=1", 150.0),
                                run("draft:k=4:policy=goodput", "c=1", 147.0),
                                run("none", "c=32", 200.0), run("draft:k=4", "c=32", 140.0),
                                run("draft:k=4:policy=goodput", "c=32", 180.0),
                                run("ngram:k=4:policy=goodput", "c=1", 120.0),  # no ngram:k=4 ran: not rated
                                run("draft:k=2:policy=fixed", "c=1", 150.0)]}  # fixed: not load-aware
    pts = policy_points({"workloads": [wl]})
    assert list(pts) == ["draft:k=4:policy=goodput"]
    assert pts["draft:k=4:policy=goodput"] == [("w", "c=1", pytest.approx(0.98)), ("w", "c=32", pytest.approx(0.9))]
    (line,) = policy_summary({"workloads": [wl]})
    assert "within 3% at 1 of 2 points" in line and "geometric mean 0.939" in line and "lowest 0.90 (w c=32)" in line


def test_an_aa_copy_is_judged_as_a_policy_and_against_its_original():
    """`copy=N` runs a config again in an engine of its own (an A/A control): the report judges the
    copy as it judges a load-aware policy (against max(none, its original)) and gives its ratios to
    the original: how far the machine's noise alone moves a cell."""
    from draftwise.lab.policy_compare import control_points, policy_points, policy_summary
    from draftwise.lab.runner import parse_configs

    cfgs = parse_configs("none,draft:k=4,draft:k=4:copy=2,none:copy=2,draft:k=4:policy=goodput:copy=2")
    assert [c.label for c in cfgs] == ["none", "draft:k=4", "draft:k=4:copy=2", "none:copy=2",
                                       "draft:k=4:policy=goodput:copy=2"]
    assert cfgs[2].spec == cfgs[1].spec and cfgs[2].copy == 2 and cfgs[3].method is None
    with pytest.raises(ValueError, match="twice"):
        parse_configs("draft:k=4:copy=2,draft:k=4:copy=2")
    with pytest.raises(ValueError, match="copy=2"):
        parse_configs("draft:k=4:copy=two")

    def run(config, level, tps):
        return {"config": config, "level_label": level, "output_tokens_per_s": tps}

    wl = {"name": "w", "runs": [run("none", "c=1", 100.0), run("draft:k=4", "c=1", 150.0),
                                run("draft:k=4:copy=2", "c=1", 140.0),
                                run("none", "c=32", 200.0), run("draft:k=4", "c=32", 140.0),
                                run("draft:k=4:copy=2", "c=32", 145.0)]}
    res = {"workloads": [wl]}
    assert policy_points(res)["draft:k=4:copy=2"] == [("w", "c=1", pytest.approx(140 / 150)),
                                                      ("w", "c=32", pytest.approx(145 / 200))]
    assert control_points(res)["draft:k=4:copy=2"] == [("w", "c=1", pytest.approx(140 / 150)),
                                                       ("w", "c=32", pytest.approx(145 / 140))]
    judged, control = policy_summary(res)  # (no load-aware config: no line on misses beyond the noise)
    assert judged.startswith("`draft:k=4:copy=2` against the better of `none` and `draft:k=4` (an A/A copy")
    assert "within 3% at 0 of 2 points" in judged
    assert control.startswith("A/A control `draft:k=4:copy=2` against `draft:k=4`")
    assert "within 3% either way at 0 of 2 points, more than 3% below at 1" in control
    assert "from 0.93 (w c=1) to 1.04 (w c=32)" in control


def test_steal_share_and_its_report_line():
    """The hypervisor's share of CPU time between two /proc/stat samples, and the report's line
    over every measured round."""
    from draftwise.lab import steal
    from draftwise.lab.tables import steal_line

    assert steal.share((10, 1000), (60, 2000)) == pytest.approx(0.05)
    assert steal.share(None, (60, 2000)) is None and steal.share((10, 1000), (10, 1000)) is None
    s = steal.sample()
    assert s is None or (len(s) == 2 and 0 <= s[0] <= s[1])
    wl = {"runs": [{"config": "none", "level_label": "c=1", "rounds": {"steal_share": [0.01, 0.2, 0.03]}},
                   {"config": "draft:k=4", "level_label": "c=1", "steal_share": 0.05},
                   {"config": "draft:k=4", "level_label": "c=2", "steal_share": None}]}
    line = steal_line(wl)
    assert "4 measured runs" in line and "median 5.0%" in line
    assert "from 1.0% (none c=1) to 20.0% (none c=1)" in line
    assert steal_line({"runs": [{"config": "none", "level_label": "c=1"}]}) == ""


def test_misses_beyond_the_aa_noise():
    """With an A/A copy in the grid, the report counts the points where a load-aware config falls
    below max(none, fixed) - 3% by more than twice the copies' noise (the sd of log(copy / original))."""
    from draftwise.lab.policy_compare import policy_summary

    def run(config, level, tps):
        return {"config": config, "level_label": level, "output_tokens_per_s": tps}

    runs = []
    for lv, fixed, copy, goodput in (("c=1", 100.0, 110.0, 99.0), ("c=2", 100.0, 90.0, 80.0), ("c=4", 100.0, 100.0, 60.0)):
        runs += [run("none", lv, 50.0), run("draft:k=4", lv, fixed), run("draft:k=4:copy=2", lv, copy),
                 run("draft:k=4:policy=goodput", lv, goodput)]
    lines = policy_summary({"workloads": [{"name": "w", "runs": runs}]})
    (far,) = [x for x in lines if "twice the A/A noise" in x]
    # sd of log(1.1), log(0.9), log(1.0) = 0.0819; floor 0.97 * exp(-0.1638) = 0.823: 0.80 and 0.60 are below
    assert far.startswith("`draft:k=4:policy=goodput` more than 3% below") and "below 0.82): 2 of 3 points" in far
    assert "(w c=2 0.80, w c=4 0.60)" in far


def test_speedup_matrix_without_a_baseline_shows_the_rates():
    """`bench --url` alone runs no `none`: the summary gives each config's rate, not empty speedups."""
    from draftwise.lab.tables import speedup_matrix
    run = {"config": "server:target", "method": "server", "level_label": "c=1", "output_tokens_per_s": 11.94}
    table = speedup_matrix({"runs": [run, dict(run, level_label="c=4", output_tokens_per_s=30.0)]})
    assert table.splitlines()[0] == "| out tok/s | c=1 | c=4 |"
    assert table.splitlines()[2] == "| server:target | 11.9 | 30.0 |"
    assert "none" not in table
    base = dict(run, config="none", method="none", output_tokens_per_s=10.0)
    spec = dict(run, vs_none={"speedup": 1.19})
    assert "| none (out tok/s) | 10.0 |" in speedup_matrix({"runs": [base, spec]})
