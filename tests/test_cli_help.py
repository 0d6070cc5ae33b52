"""--help states the defaults that depend on other options the way the code resolves them, and
`check` explains each result: the figure that decided it beside its threshold."""
import argparse

import pytest

from draftwise.cli.check import DEFAULTS, QUICK
from draftwise.cli.common import spec_from_args
from draftwise.cli.main import build_parser
from draftwise.lab.check import CheckResult
from draftwise.lab.check_explain import explain
from draftwise.lab.correctness import detectable_shift


def _help(command: str, option: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return " ".join(next(a for a in sub._actions if option in a.option_strings).help.split())


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_method_default_follows_model_and_draft_as_the_help_says(command, target_dir):
    parser = build_parser()
    extra = ["hi"] if command == "generate" else []
    method = lambda *argv: spec_from_args(parser.parse_args([command, *argv, *extra])).method  # noqa: E731
    assert method() == "draft"
    assert method("--model", str(target_dir)) is None
    assert method("--model", str(target_dir), "--draft", str(target_dir)) == "draft"
    text = _help(command, "--method")
    assert "default: draft" in text and "none when --model is given without --draft" in text


def test_check_help_names_the_quick_presets():
    for option, key in (("--samples", "samples"), ("--horizon", "horizon"), ("--max-tokens", "max_tokens")):
        text = _help("check", option)
        assert f"default {DEFAULTS[key]}; --quick: {QUICK[key]}" in text, text
    assert "--model without --draft needs" in _help("check", "--method")


def test_bench_help_names_the_dependent_defaults():
    assert "1,2,4,8,16,32 when neither --request-rate nor --find-capacity" in _help("bench", "--concurrency")
    assert "--quick: 1,4" in _help("bench", "--concurrency")
    assert "--quick: 8" in _help("bench", "--num-requests")
    assert "against the reference's run at the same level" in _help("bench", "--reference-url")
    assert "not used with --url" in _help("bench", "--model")


def test_check_quick_preset_is_smaller_and_less_powerful():
    assert all(QUICK[k] < DEFAULTS[k] for k in DEFAULTS)
    full = detectable_shift(DEFAULTS["samples"], 3 * DEFAULTS["horizon"], 0.01)
    quick = detectable_shift(QUICK["samples"], 3 * QUICK["horizon"], 0.01)
    assert 0.1 < full < 0.2 < 0.25 < quick < 0.3  # the figures docs/cli.md quotes: about 0.15 and 0.28


def _dist(p: float, informative: int = 12) -> CheckResult:
    figs = {"temperature": 1.0, "prompts": 3, "horizon": 4, "samples": 400, "tests": 12,
            "informative_tests": informative, "p_value": p, "alpha": 0.01, "tv_spec_vs_plain": 0.4062,
            "tv_plain_vs_plain": 0.3981}
    return CheckResult("distribution (T=1)", p >= 0.01 and informative > 0, figs,
                       "" if informative else "no test had two cells after pooling: raise --samples",
                       kind="distribution")


def test_distribution_explanation_puts_tv_beside_its_noise_floor():
    head, lines = explain(_dist(0.53))
    assert head == "p=0.53 >= alpha=0.01 over 12 chi-square tests; TV 0.406 (sampling noise alone: 0.398)"
    text = " ".join(lines)
    assert "PASS when p >= alpha = 0.01" in text and "It is reported, not tested" in text
    assert f"about {detectable_shift(400, 12, 0.01):.2f} of probability" in text
    assert lines[-1].startswith("why PASS")
    head, lines = explain(_dist(0.002))
    assert head.startswith("p=0.002 < alpha=0.01") and lines[-1].startswith("why FAIL: at some position")
    head, lines = explain(_dist(1.0, informative=0))
    assert head.startswith("none of the 12 chi-square tests") and "raise --samples" in lines[-1]


def test_greedy_and_rollback_explanations_state_their_thresholds():
    head, lines = explain(CheckResult("greedy equality", False, {
        "prompts": 6, "tokens": 192, "mismatches": 2, "near_tie_divergences": 1, "first_mismatch": 7,
        "mean_accepted_length": 2.5}, kind="greedy"))
    assert head.startswith("2 of 6 requests differ") and "1 here" in lines[1]
    assert lines[-1] == "why FAIL: 2 requests differ, the first at output position 7: speculation changed greedy output."
    head, lines = explain(CheckResult("KV rollback", True, {
        "sequences": 3, "rejected_proposals": 0, "max_rel_err_target": "1.00e-06", "max_rel_err_drafter": None,
        "tolerance_target": 1e-4, "tolerance_drafter": None}, "no proposal was rejected, so no rollback was exercised",
        kind="rollback"))
    assert head == "largest logit error 1.00e-06 (tolerance 0.0001); 0 proposals rejected"
    assert "no rollback was exercised" in lines[-1]


def test_python_dash_m_reports_a_user_error_as_one_line(tmp_path):
    """`python -m draftwise.cli.main` runs the module as __main__: a subcommand's UserError (the
    package module's class) is still one line on stderr with exit status 2, not a traceback."""
    import subprocess
    import sys

    got = subprocess.run([sys.executable, "-m", "draftwise.cli.main", "train", "eagle3", "--target",
                          str(tmp_path / "none"), "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert got.returncode == 2, got.stderr
    assert got.stderr.strip().count("\n") == 0 and "not a model directory" in got.stderr
    assert "Traceback" not in got.stderr
