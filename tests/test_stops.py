"""Stops inside accepted blocks: EOS, stop_token_ids, stop strings (also spanning tokens), max_tokens."""
import pytest

from draftwise import LLM, SamplingParams, SpecConfig

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def runs(target_dir):
    plain = LLM(str(target_dir))
    # the target drafting for itself: every proposal accepted, so stops land inside blocks
    spec = LLM(str(target_dir), draft=str(target_dir), spec=SpecConfig(method="draft", k=8),
               draft_dtype="float32")  # its own draft at its precision: whole blocks accepted
    base = plain.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    return plain, spec, base


def test_max_tokens_inside_block(runs):
    plain, spec, base = runs
    for n in (1, 3, 7, 13):
        o = spec.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        assert o.token_ids == base.token_ids[:n] and o.finish_reason == "length"


def test_stop_token_ids_inside_block(runs):
    plain, spec, base = runs
    j = 11
    stop_tok = base.token_ids[j]
    first = base.token_ids.index(stop_tok)
    o = spec.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_tok]))[0]
    assert o.token_ids == base.token_ids[: first + 1]
    assert o.finish_reason == "stop"


def test_eos_inside_block(runs, target_dir):
    plain, spec, base = runs
    # make a committed token the EOS by declaring it so via stop_token_ids and ignore_eos=False
    tok = base.token_ids[6]
    first = base.token_ids.index(tok)
    spec.engine.eos_ids = [tok]
    try:
        o = spec.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40))[0]
    finally:
        spec.engine.eos_ids = plain.engine.eos_ids
    assert o.token_ids == base.token_ids[: first + 1] and o.finish_reason == "stop"


@pytest.mark.parametrize("start,length", [(5, 3), (12, 5), (20, 2)])
def test_stop_string_spanning_tokens(runs, start, length):
    plain, spec, base = runs
    text = base.text
    stop = text[start : start + length]
    assert stop
    cut = text.find(stop)
    for llm in (plain, spec):
        o = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))[0]
        assert o.finish_reason == "stop"
        assert o.text == text[:cut], (stop, o.text)
        # no token after the one that completed the stop string
        dec = llm.tokenizer.decode(o.token_ids)
        assert stop in dec and stop not in llm.tokenizer.decode(o.token_ids[:-1])
        assert o.token_ids == base.token_ids[: len(o.token_ids)]


def test_spec_text_equals_plain_text(runs):
    plain, spec, base = runs
    o = spec.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert o.text == base.text and o.token_ids == base.token_ids
