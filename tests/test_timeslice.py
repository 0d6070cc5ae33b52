"""Time-sliced runs (lab/timeslice.py): several runs share the CPU in slices, each timed by its own."""
import json

import pytest

from draftwise.cli.main import main
from draftwise.lab import timeslice
from draftwise.lab.timeslice import SliceClock, WallClock, drain, run_sliced


class FakeTime:
    """perf_counter that moves only when a test says so (work done, sleeping)."""

    def __init__(self):
        self.t = 100.0

    def perf_counter(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += max(0.0, s)


@pytest.fixture
def fake_time(monkeypatch):
    ft = FakeTime()
    monkeypatch.setattr(timeslice.time, "perf_counter", ft.perf_counter)
    monkeypatch.setattr(timeslice.time, "sleep", ft.sleep)
    return ft


def test_a_slice_clock_runs_only_while_resumed_and_jumps_idle_waits(fake_time):
    c = SliceClock()
    assert c.now() == 0.0
    fake_time.t += 5.0  # paused: the others' slices do not count
    assert c.now() == 0.0
    c.resume()
    fake_time.t += 0.25
    assert c.now() == pytest.approx(0.25)
    c.pause()
    fake_time.t += 3.0
    assert c.now() == pytest.approx(0.25)
    c.resume()
    fake_time.t += 0.5
    assert c.now() == pytest.approx(0.75)
    before = fake_time.t
    c.wait_until(2.0)  # an open loop's wait for its next arrival: the clock jumps, no wall time passes
    assert c.now() == pytest.approx(2.0) and fake_time.t == before
    c.wait_until(1.0)  # the past: nothing
    assert c.now() == pytest.approx(2.0)
    c.pause()
    c.wait_until(3.0)
    assert c.now() == pytest.approx(3.0)


def test_the_wall_clock_sleeps(fake_time):
    WallClock.wait_until(fake_time.t + 2.0)
    assert WallClock.now() == pytest.approx(102.0)


def test_sliced_runs_each_take_their_own_time_their_slices_alternating(fake_time):
    """Two runs of steps of known cost: each one's clock sees only its own steps (as if alone),
    the slices alternate (each pass in a shuffled order), a run that finishes leaves the CPU to the
    other, results come in order."""
    trace = []

    def run(name: str, steps: int, cost: float, clock: SliceClock):
        start = clock.now()
        for _ in range(steps):
            trace.append(name)
            fake_time.t += cost  # the step's work
            yield
        return name, clock.now() - start

    ca, cb = SliceClock(), SliceClock()
    out = run_sliced([(run("a", 10, 0.02, ca), ca), (run("b", 4, 0.03, cb), cb)], slice_s=0.05)
    assert out[0] == ("a", pytest.approx(10 * 0.02)) and out[1] == ("b", pytest.approx(4 * 0.03))
    # slices of 0.05 s: a runs 3 steps (0.06 s >= 0.05) a slice, b 2; every pass slices each live
    # run once, in a shuffled order (two slices of one run meet only across a pass's end)
    text = "".join(trace)
    assert sorted(text) == ["a"] * 10 + ["b"] * 4
    assert all(len(r) in (2, 4) for r in text.split("a") if r)  # b: whole slices of 2 steps
    live = text[: text.rindex("b")]  # while b runs, a gets at most two slices in a row (a pass's end, the next's start)
    assert all(len(r) <= 6 for r in live.split("b") if r)
    trace.clear()
    ca, cb = SliceClock(), SliceClock()
    run_sliced([(run("a", 10, 0.02, ca), ca), (run("b", 4, 0.03, cb), cb)], slice_s=0.05)
    assert "".join(trace) == text  # (seeded: the same runs slice the same way)
    with pytest.raises(ValueError, match="time slice"):
        run_sliced([], 0.0)


def test_a_step_that_outlasts_the_slice_still_advances_and_drain_returns(fake_time):
    def slow(clock):
        for _ in range(3):
            fake_time.t += 1.0
            yield
        return clock.now()

    c = SliceClock()
    assert run_sliced([(slow(c), c)], slice_s=0.001) == [pytest.approx(3.0)]
    assert drain(iter_return(7)) == 7


def iter_return(value):
    yield
    return value


def test_capacity_rounds_go_together_when_the_runner_slices():
    """`find_capacities(together=...)`: every round of a step is one call with all the configs
    still searching, in the rotated order; the result is the sequential one's for the same runs."""
    from draftwise.lab.capacity import find_capacities

    def summary(rate, limit):
        return {"num_requests": 8, "completed": 8, "requests_per_s": rate,
                "tpot_ms": {"p90": 80.0 if rate > limit else 40.0}}

    limits = {"a": 3.3, "b": 12.0}
    calls = []

    def together(probes, rnd):
        calls.append([name for name, _ in probes])
        return {name: summary(rate, limits[name]) for name, rate in probes}

    measures = {n: (lambda rate, rnd, n=n: summary(rate, limits[n])) for n in limits}
    res = find_capacities(measures, {"tpot": 50.0}, repeats=2, start_rate=1.0, together=together)
    seq = find_capacities(measures, {"tpot": 50.0}, repeats=2, start_rate=1.0)
    assert res == seq
    assert calls[:2] == [["a", "b"], ["b", "a"]]
    assert ["a"] not in calls[: 2 * len(res["a"]["probes"])] and calls[-1] == ["b"]


def test_bench_time_slice_runs_a_round_together_same_outputs(target_dir, draft_dir, tmp_path):
    """--time-slice: every config's figures come from its own slices; greedy outputs equal `none`'s
    token for token, and the sliced round takes its wall time from the configs' own clocks."""
    out = tmp_path / "ts"
    assert main(["bench", "--model", str(target_dir), "--draft", str(draft_dir), "--workload", "grounded",
                 "--configs", "none,draft:k=4,draft:k=4:policy=goodput", "--concurrency", "1,4",
                 "--num-requests", "6", "--max-tokens", "12", "--repeats", "2", "--time-slice", "5",
                 "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["time_slice_ms"] == 5.0
    runs = res["workloads"][0]["runs"]
    assert {(r["config"], r["level_label"]) for r in runs} == {
        (c, lv) for c in ("none", "draft:k=4", "draft:k=4:policy=goodput") for lv in ("c=1", "c=4")}
    for r in runs:
        assert r["completed"] == 6 and r["output_tokens"] == 6 * 12
        assert r["correctness"]["mismatching_requests"] == 0
        assert r["rounds"]["greedy_outputs_identical"] is True
        assert r["wall_seconds"] > 0 and r["ttft_ms"]["p90"] >= 0
    assert main(["bench", "--model", str(target_dir), "--configs", "none", "--time-slice", "0",
                 "--out", str(out)]) == 2


def test_an_open_loop_sliced_run_keeps_its_arrival_schedule(target_dir):
    """Open loop on a slice clock: the run's idle waits jump its clock, so its wall time is at
    least the last arrival's offset, and arrivals keep the schedule's order and spacing."""
    from draftwise.engine import EngineConfig, LLMEngine, SpecConfig
    from draftwise.lab.arrivals import LoadLevel, arrival_times
    from draftwise.lab.backends import EngineBackend, sampling_params
    from draftwise.lab.workload import load_workload
    from draftwise.model.pair import load_pair

    target, _ = load_pair(str(target_dir), None, needs_draft=False)
    reqs = load_workload("grounded").head(5).requests
    prompts = [target.tokenizer.encode(f"def f{i}(x):\n    return").ids for i in range(5)]
    params = [sampling_params(r, i, 4) for i, r in enumerate(reqs)]
    level = LoadLevel("rate", 50.0)
    engines = [EngineBackend(LLMEngine(target, None, SpecConfig(), EngineConfig(max_num_seqs=4))) for _ in range(2)]
    clocks = [SliceClock(), SliceClock()]
    outs = run_sliced([(b.steps(reqs, prompts, params, level, 3, None, c), c) for b, c in zip(engines, clocks)],
                      0.002)
    offsets = arrival_times(5, 50.0, 1.0, 3)
    for out in outs:
        arrivals = [r.arrival - out.records[0].arrival for r in out.records]
        assert arrivals == pytest.approx(offsets)
        assert out.wall >= offsets[-1]
        assert all(r.output_tokens == 4 for r in out.records)
    assert [r.token_ids for r in outs[0].records] == [r.token_ids for r in outs[1].records]
