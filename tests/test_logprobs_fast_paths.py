"""Logprobs on the greedy fast paths: a request that asks for its tokens' log-probabilities
(`SamplingParams.logprobs = 0`, what `bench --url` and the OpenAI clients send) keeps the
multi-step plain kernel calls and the argmax verification (chains and trees), with the tokens and
the values the processed-logits path gives.

The reference forces that path: `logit_bias={0: 0.0}` adds nothing to the logits (same p, same
greedy tokens) but counts as a processor, so every row goes through `process_logits` and
`sampling.verify`, one token a step, and reports log_softmax(p's row)[token]."""
import math

import pytest

import draftwise.engine.engine as engine_module
import draftwise.engine.tree_verify as tree_module
from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.model import cpu_kernels
from tiny_models import make_model_dir

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: the fused kernels are off")

V = 2048  # a head packed for dw_gemm (the fused steps' head)
PROMPTS = [[5, 6, 7, 8, 9] * 6, [40, 41, 42] * 5, [300, 301], [7, 1000, 7, 1000, 12]]
TOL = 1e-4


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer):
    return make_model_dir(tmp_path_factory.mktemp("lp-target") / "t", seed=0, tokenizer=tokenizer,
                          vocab_size=V, layers=2, hidden=64)


@pytest.fixture(scope="module")
def near_draft(tmp_path_factory, tokenizer):
    """The target's weights plus noise: many proposals accepted, some rejected."""
    return make_model_dir(tmp_path_factory.mktemp("lp-draft") / "d", seed=0, tokenizer=tokenizer,
                          vocab_size=V, layers=2, hidden=64, perturb=0.15)


def _params(n: int, top: int = 0, slow: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=top,
                          logit_bias={0: 0.0} if slow else None)


def _generate(llm, sps, together):
    outs = llm.generate(PROMPTS[: len(sps)], sps) if together else \
        [llm.generate([p], sp)[0] for p, sp in zip(PROMPTS, sps)]
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


@pytest.fixture(scope="module")
def reference(target):
    """Tokens and logprobs (top 2 alternatives) of the processed-logits path, one token a step."""
    llm = LLM(str(target), dtype="float32", multi_step=1)
    return _generate(llm, [_params(n, top=2, slow=True) for n in (37, 9, 1, 20)], together=False)


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


def _assert_same(got, ref, top=False):
    (toks, lps), (rtoks, rlps) = got, ref
    assert toks == rtoks
    for seq_lp, ref_lp, seq_toks in zip(lps, rlps, toks):
        assert [x.token_id for x in seq_lp] == seq_toks
        assert all(math.isfinite(x.logprob) and x.logprob <= 0.0 for x in seq_lp)
        assert max(abs(x.logprob - r.logprob) for x, r in zip(seq_lp, ref_lp)) < TOL
        if top:
            assert [[t for t, _ in x.top] for x in seq_lp] == [[t for t, _ in r.top] for r in ref_lp]
            assert max(abs(v - w) for x, r in zip(seq_lp, ref_lp) for (_, v), (_, w) in zip(x.top, r.top)) < TOL
        else:
            assert all(x.top == [] for x in seq_lp)


@pytest.mark.parametrize("together", [False, True])
def test_plain_multi_step_reports_the_processed_paths_logprobs(target, reference, monkeypatch, together):
    """Alone: each request's tokens from multi-step kernel calls (fewer steps than tokens), its
    logprobs those of one token a step through process_logits; several in flight: one token a step
    through the argmax verification, the same values."""
    slow = _counting(monkeypatch, engine_module, "verify_proposals")
    llm = LLM(str(target), dtype="float32", multi_step=8)
    got = _generate(llm, [_params(n) for n in (37, 9, 1, 20)], together)
    _assert_same(got, reference)
    assert not slow  # never the processed-logits path
    if not together:
        assert llm.engine.stats.steps < sum(len(t) for t in got[0])


def test_top_logprobs_leave_multi_step_and_match(target, reference, monkeypatch):
    """Top alternatives need p's rows: one token a step (no multi-step call), through the argmax
    verification, the same tokens, values and alternatives as the processed-logits path."""
    llm = LLM(str(target), dtype="float32", multi_step=8)
    multi = []
    real = llm.engine.runner.greedy_steps
    llm.engine.runner.greedy_steps = lambda *a, **kw: multi.append(1) or real(*a, **kw)
    _assert_same(_generate(llm, [_params(n, top=2) for n in (37, 9, 1, 20)], together=False), reference, top=True)
    assert not multi


@pytest.mark.parametrize("tree,together", [(0, False), (0, True), (3, False), (3, True)])
def test_speculative_greedy_verification_reports_the_processed_paths_logprobs(
        target, near_draft, reference, monkeypatch, tree, together):
    """A draft model's chains (tree 0) or trees, at 1 and 4 requests in flight: the argmax
    verification commits plain's tokens with the processed path's logprobs, proposals accepted."""
    slow = _counting(monkeypatch, engine_module, "verify_proposals")
    slow_tree = _counting(monkeypatch, tree_module, "verify_proposals")
    llm = LLM(str(target), draft=str(near_draft), spec=SpecConfig(method="draft", k=4, tree=tree),
              dtype="float32", draft_dtype="float32")
    got = _generate(llm, [_params(n) for n in (37, 9, 1, 20)], together)
    _assert_same(got, reference)
    assert not slow and not slow_tree
    assert llm.engine.stats.accepted_tokens > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_multi_step_logprobs_equal_one_token_a_step(target, dtype):
    """In the model's own dtype: the multi-step kernel's values against one-token steps' rows."""
    sps = [_params(n) for n in (37, 9)]
    one = _generate(LLM(str(target), dtype=dtype, multi_step=1), sps, together=False)
    many = _generate(LLM(str(target), dtype=dtype, multi_step=8), sps, together=False)
    _assert_same(many, one)
