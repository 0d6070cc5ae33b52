"""Conditional acceptance by position and the drafter's confidence reliability: the engine's counts
(chain rounds), the figures computed from them, and the lab's plots."""
import json

import pytest

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.engine.sequence import RequestStats
from draftwise.engine.stats import CONFIDENCE_BINS, EngineStats
from draftwise.lab.metrics import speculation_figures, stats_delta
from draftwise.lab.plots import plot_workload
from draftwise.lab.reliability import conditional_acceptance, pooled, reliability
from draftwise.policies import register_policy
from draftwise.policies.fixed import FixedPolicy


def test_count_round_reaches_the_positions_a_chain_verified():
    st = EngineStats()
    req = RequestStats()
    st.count_round(req, 4, 4, 2, 0.0, [0.9, 0.8, 0.3, 0.2])  # 1, 2 accepted, 3 rejected, 4 never reached
    st.count_round(req, 4, 2, 2, 0.0, [0.9, 0.6, 0.5, 0.5])  # 2 verified, both accepted: 3 not reached
    st.count_round(req, 4, 0, 0, 0.0, [0.9, 0.9, 0.9, 0.9])  # nothing verified (a plain step)
    st.count_round(req, 5, 5, 3, 0.0, [0.9] * 5, chain=False)  # a tree: its nodes are no positions
    st.count_round(req, 3, 3, 0, 0.0)  # no confidences: positions only
    assert st.reached_per_position == [3, 2, 1]
    assert st.passed_per_position == [2, 2, 0]
    assert sum(st.confidence_reached.values()) == 5 and sum(st.confidence_passed.values()) == 4
    b = lambda c: int(c * CONFIDENCE_BINS)  # noqa: E731
    assert st.confidence_reached == {b(0.9): 2, b(0.8): 1, b(0.3): 1, b(0.6): 1}
    assert {k: v for k, v in st.confidence_passed.items() if v} == {b(0.9): 2, b(0.8): 1, b(0.6): 1}
    assert st.confidence_sum[b(0.9)] == pytest.approx(1.8)
    assert st.accepted_per_position == [3, 3, 1]  # unchanged meaning: every round, trees included


def test_confidence_one_falls_in_the_last_bin():
    st = EngineStats()
    st.count_round(RequestStats(), 2, 2, 2, 0.0, [1.0, 1.7])
    assert st.confidence_reached == {CONFIDENCE_BINS - 1: 2}
    assert st.confidence_sum[CONFIDENCE_BINS - 1] == pytest.approx(2.0)  # clipped to [0, 1]


def test_figures_from_a_delta_and_pooled_runs():
    before = EngineStats()
    before.count_round(RequestStats(), 2, 2, 0, 0.0, [0.95, 0.95])
    after = EngineStats()
    after.count_round(RequestStats(), 2, 2, 0, 0.0, [0.95, 0.95])
    for _ in range(3):
        after.count_round(RequestStats(), 2, 2, 2, 0.0, [0.95, 0.45])
    after.count_round(RequestStats(), 2, 2, 1, 0.0, [0.95, 0.45])
    d = stats_delta(before.snapshot(), after.snapshot())
    f = speculation_figures(d, output_tokens=10)
    assert f["conditional_acceptance_by_position"] == pytest.approx([1.0, 0.75])
    rel = f["confidence_reliability"]
    # bins: 0.95 (4 positions, all accepted), 0.45 (4 positions, 3 accepted)
    assert rel["positions"] == 8
    assert [b[2] for b in rel["bins"]] == [4, 4]
    assert rel["bins"][0][:2] == pytest.approx([0.45, 0.75]) and rel["bins"][1][:2] == pytest.approx([0.95, 1.0])
    assert rel["ece"] == pytest.approx(0.5 * 0.30 + 0.5 * 0.05)
    # through JSON (string keys) and pooled with a second run
    sp = json.loads(json.dumps(f))
    both = pooled([sp, sp, None])
    assert conditional_acceptance(both["reached"], both["passed"]) == pytest.approx([1.0, 0.75])
    again = reliability(both["confidence"]["reached"], both["confidence"]["passed"], both["confidence"]["sum"])
    assert again["positions"] == 16 and again["ece"] == pytest.approx(rel["ece"])
    assert reliability({}, {}, {}) is None
    assert conditional_acceptance([2, 0], [1, 0]) == [0.5, None]


@register_policy("fixed-with-confidence-test")
class FixedWithConfidence(FixedPolicy):
    """Test only: `fixed` (drafts and verifies all it may) that asks the drafter for confidences."""

    needs_confidence = True


def test_engine_counts_agree_with_its_acceptances(target_dir, draft_dir):
    """A draft model whose policy asks for confidences: chain rounds only, so the positions passed
    are the accepted ones, position 1 is reached in every round, and every reached position is
    binned once by its confidence."""
    llm = LLM(str(target_dir), draft=str(draft_dir), spec=SpecConfig(method="draft", k=3,
                                                                     policy="fixed-with-confidence-test"))
    llm.generate([[20 + i, 3, 4, 5] for i in range(4)], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    st = llm.engine.stats
    n = len(st.passed_per_position)
    assert st.passed_per_position == st.accepted_per_position[:n] and not any(st.accepted_per_position[n:])
    assert st.reached_per_position[0] == st.rounds - st.verified_per_round.get(0, 0) > 0
    assert all(r >= p for r, p in zip(st.reached_per_position, st.passed_per_position))
    assert sum(st.confidence_reached.values()) == sum(st.reached_per_position)
    assert sum(st.confidence_passed.values()) == sum(st.passed_per_position)
    assert 0 < sum(st.confidence_sum.values()) <= sum(st.reached_per_position)


def test_plots_of_the_new_figures(tmp_path):
    st = EngineStats()
    for a in (0, 1, 2, 2):
        st.count_round(RequestStats(), 2, 2, a, 0.0, [0.8, 0.6])
    sp = json.loads(json.dumps(speculation_figures(st.snapshot(), output_tokens=9)))

    def run(config, c, spec):
        return {"config": config, "level": {"kind": "concurrency", "value": c}, "level_label": f"c={c}",
                "output_tokens_per_s": 10.0, "e2e_ms": {"p50": 100.0}, "tpot_ms": {"p50": 10.0}, "speculation": spec}

    wl = {"name": "w", "runs": [run("none", 1, None), run("none", 4, None), run("draft:k=2", 1, sp),
                                run("draft:k=2", 4, sp)]}
    names = plot_workload(wl, tmp_path)
    for n in ("w-acceptance-by-position.png", "w-confidence-reliability.png", "w-drafted-verified.png"):
        assert n in names and (tmp_path / n).read_bytes()[:4] == b"\x89PNG"
