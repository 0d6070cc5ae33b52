"""SamplingParams: defaults, normalisation, and one ValueError per invalid value naming the parameter."""
import dataclasses
import math

import pytest

from draftwise.sampling import SamplingParams


def test_defaults_and_normalisation():
    sp = SamplingParams()
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p) == (1.0, 0, 1.0, 0.0)
    assert (sp.max_tokens, sp.min_tokens, sp.n, sp.logprobs, sp.seed) == (16, 0, 1, None, None)
    assert sp.stop == [] and sp.stop_token_ids is None and not sp.is_greedy
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=-1).top_k == -1


def test_replace_revalidates_and_copies():
    sp = SamplingParams(temperature=0.5, stop="x", logit_bias={3: 1})
    sp2 = dataclasses.replace(sp, temperature=0.0)
    assert sp2.is_greedy and sp2.stop == ["x"] and sp2.logit_bias == {3: 1.0}
    assert sp.temperature == 0.5
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(sp, top_p=0.0)
    assert sp == dataclasses.replace(sp)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.1), r"temperature must be a finite number >= 0, got -0.1"),
        (dict(temperature=math.inf), r"temperature"),
        (dict(temperature=math.nan), r"temperature"),
        (dict(temperature="hot"), r"temperature"),
        (dict(top_k=-2), r"top_k must be >= -1"),
        (dict(top_k=2.5), r"top_k must be an integer"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
        (dict(min_p=1.1), r"min_p must be in \[0, 1\]"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be in \[0.0001, 10000\]"),
        (dict(repetition_penalty=1e-50), r"repetition_penalty"),
        (dict(temperature=1e39), r"temperature must be a finite number >= 0"),
        (dict(temperature=10**400), r"temperature"),
        (dict(repetition_penalty=-1.0), r"repetition_penalty"),
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
        (dict(presence_penalty=-2.01), r"presence_penalty must be in \[-2, 2\]"),
        (dict(frequency_penalty=3), r"frequency_penalty must be in \[-2, 2\]"),
        (dict(logit_bias={1: 101.0}), r"logit_bias\[1\] must be in \[-100, 100\]"),
        (dict(logit_bias={-1: 1.0}), r"logit_bias: token id must be an integer >= 0"),
        (dict(logit_bias={"a": 1.0}), r"logit_bias: token id"),
        (dict(logit_bias=[1, 2]), r"logit_bias must be a dict"),
        (dict(seed=1.5), r"seed must be an integer"),
        (dict(seed=2**64), r"seed must be an integer in"),
        (dict(max_tokens=0), r"max_tokens must be >= 1, got 0"),
        (dict(min_tokens=-1), r"min_tokens must be in \[0, max_tokens=16\]"),
        (dict(min_tokens=17), r"min_tokens must be in \[0, max_tokens=16\], got 17"),
        (dict(stop=""), r"stop must be a non-empty string"),
        (dict(stop=["ok", ""]), r"stop must be a non-empty string"),
        (dict(stop_token_ids=[-5]), r"stop_token_ids: token id must be an integer >= 0"),
        (dict(ignore_eos=1), r"ignore_eos must be a bool"),
        (dict(logprobs=21), r"logprobs must be in \[0, 20\], got 21"),
        (dict(logprobs=-1), r"logprobs must be in \[0, 20\]"),
        (dict(n=0), r"n must be >= 1, got 0"),
        (dict(n=True), r"n must be an integer"),
    ],
)
def test_invalid_values_raise_naming_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_boundaries_are_allowed():
    SamplingParams(temperature=0, top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2,
                   logprobs=0, min_tokens=16, max_tokens=16, top_k=-1, seed=0)
    SamplingParams(logprobs=20, logit_bias={0: -100, 5: 100})


def test_validate_vocab():
    SamplingParams(logit_bias={8191: 1.0}, stop_token_ids=[0, 8191]).validate_vocab(8192)
    with pytest.raises(ValueError, match=r"stop_token_ids: token id 99999 is outside the vocabulary \[0, 8192\)"):
        SamplingParams(stop_token_ids=[2, 99999]).validate_vocab(8192)
    with pytest.raises(ValueError, match=r"logit_bias: token id 8192 is outside the vocabulary \[0, 8192\)"):
        SamplingParams(logit_bias={8192: 1.0}).validate_vocab(8192)


def test_float32_edge_values():
    """Values that are valid Python floats but 0 or inf in float32."""
    tiny = SamplingParams(temperature=1e-50)
    assert tiny.is_greedy and SamplingParams(temperature=9.9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    SamplingParams(temperature=3e38, min_tokens=3)  # finite in float32
    for kw in (dict(temperature=1e39), dict(repetition_penalty=1e-50), dict(repetition_penalty=1e-5),
               dict(repetition_penalty=1e39), dict(top_p=math.nan), dict(min_p=math.nan),
               dict(logit_bias={1: math.nan})):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)
