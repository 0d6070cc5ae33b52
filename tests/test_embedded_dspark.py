"""The embedded DSpark drafter `models/dspark` (made by `make models`' recipe): it fits the embedded
target, `--method dspark` picks it without --draft, its greedy output equals plain decoding's, and
the model card's section renders from its training record."""
import json

import pytest

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.cli.main import main
from draftwise.model.dspark_config import DSparkConfig
from draftwise.model.pair import load_pair
from draftwise.paths import default_draft, default_target, models_dir
from draftwise.train.report import dspark_section

PROMPTS = ["def parse_header(line):\n    \"\"\"Split a header line into its name and value.\"\"\"\n",
           "class Stack:\n    def __init__(self):\n"]

pytestmark = pytest.mark.skipif(not (models_dir() / "dspark" / "config.json").is_file(),
                                reason="models/dspark is not there")


def test_default_drafter_by_method():
    assert default_draft("dspark") == models_dir() / "dspark"
    assert default_draft("draft") == default_draft() == models_dir() / "draft"
    assert default_draft("eagle3") == models_dir() / "draft"  # (no embedded EAGLE-3 drafter: the draft model's error)


def test_it_fits_the_embedded_target():
    cfg = DSparkConfig.from_dir(default_draft("dspark"))
    assert cfg.confidence_temperatures and len(cfg.confidence_temperatures) == cfg.block_size  # calibrated
    target, drafter = load_pair(None, None, needs_draft=True, method="dspark")
    assert target.path == default_target()
    assert type(drafter).__name__ == "LoadedDSpark" and drafter.path == default_draft("dspark")


def test_greedy_output_equals_plain():
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in LLM(spec=SpecConfig(method=None)).generate(PROMPTS, params)]
    llm = LLM(spec=SpecConfig(method="dspark", k=4))
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == plain
    assert llm.engine.stats.proposed_tokens > 0  # it drafted


def test_generate_from_the_command_line(capsys):
    assert main(["generate", "--method", "dspark", "def add(a, b):", "--max-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["stats"]["proposed_tokens"] > 0  # the embedded DSpark drafter drafted, with no --draft


def test_model_card_section():
    record = json.loads((default_draft("dspark") / "training.json").read_text())
    text = "\n".join(dspark_section(models_dir()))
    assert text.startswith("## DSpark drafter (`models/dspark`)")
    first = record["held_out"]["per_position"][0]
    assert f"{first:.2f}" in text and f"{record['held_out']['expected_accepted']:.2f}" in text
    assert dspark_section(models_dir() / "no-such-dir") == []
