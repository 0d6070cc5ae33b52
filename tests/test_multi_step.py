"""Multi-step plain decoding (`EngineConfig.multi_step`): a lone greedy sequence commits up to that
many tokens a step from one kernel call; outputs, stops and finish reasons are those of one token a
step."""
import pytest

from draftwise import LLM, SamplingParams
from draftwise.engine import EngineConfig
from draftwise.model import cpu_kernels
from tiny_models import make_model_dir

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: the fused kernels are off")

V = 2048  # a head packed for dw_gemm (the fused steps' head)
PROMPTS = [[5, 6, 7, 8, 9] * 6, [40, 41, 42] * 5, [300, 301]]


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer):
    return make_model_dir(tmp_path_factory.mktemp("multi-step") / "target", seed=0, tokenizer=tokenizer,
                          vocab_size=V, layers=2, hidden=64)


def _run(target, multi_step, dtype, sps, together=False):
    llm = LLM(str(target), dtype=dtype, multi_step=multi_step)
    if together:
        outs = llm.generate(PROMPTS, sps)
    else:
        outs = [llm.generate([p], sp)[0] for p, sp in zip(PROMPTS, sps)]
    return [(o.token_ids, o.finish_reason) for o in outs], llm.engine.stats.steps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_multi_step_greedy_output_is_one_token_a_step(target, dtype):
    """Alone (multi-step) and together (one token a step: several rows), lengths that are not a
    multiple of the step: the same tokens as multi_step=1, in fewer steps alone."""
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (37, 8, 1)]
    one, steps_one = _run(target, 1, dtype, sps)
    many, steps_many = _run(target, 8, dtype, sps)
    assert many == one
    assert [len(t) for t, _ in many] == [37, 8, 1]
    assert steps_many < steps_one
    assert _run(target, 8, dtype, sps, together=True)[0] == one


def test_multi_step_stops_where_one_token_a_step_stops(target):
    """A stop token inside a multi-step chunk: nothing after it is committed, with the same finish
    reasons (stop strings go through the same token-by-token commit); sampled requests (not
    multi-step) are unchanged too."""
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref, _ = _run(target, 1, "float32", [free] * 3)
    stop_ids = [toks[11] for toks, _ in ref]  # the 12th token of each greedy output
    sps = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[t]) for t in stop_ids]
    one, _ = _run(target, 1, "float32", sps)
    many, _ = _run(target, 8, "float32", sps)
    assert many == one and all(r == "stop" and len(t) <= 12 for t, r in many)
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=20, ignore_eos=True) for i in range(3)]
    assert _run(target, 8, "float32", sampled)[0] == _run(target, 1, "float32", sampled)[0]


def test_multi_step_is_validated():
    with pytest.raises(ValueError, match="multi_step"):
        EngineConfig(multi_step=0)


def test_a_speculative_row_that_drafts_nothing_takes_its_tokens_in_one_call(target):
    """n-gram lookup without a match proposes nothing: the step commits the 1 + k tokens reserved for
    the row from one greedy_steps call; the output is plain decoding's."""
    from draftwise import SpecConfig

    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [[1000 + i for i in range(12)], *PROMPTS]  # the first: no repeated n-gram to look up
    plain = LLM(str(target), dtype="float32", multi_step=1)
    llm = LLM(str(target), spec=SpecConfig(method="ngram", k=4), dtype="float32")
    calls = 0
    orig = llm.engine.runner.greedy_steps

    def counted(*a, **kw):
        nonlocal calls
        got = orig(*a, **kw)
        calls += got is not None
        return got

    llm.engine.runner.greedy_steps = counted
    for p in prompts:
        assert llm.generate([p], sp)[0].token_ids == plain.generate([p], sp)[0].token_ids
    assert calls > 0



def test_a_long_draft_budget_does_not_lengthen_a_plain_call(target):
    """suffix:k=16 with nothing to propose (no earlier occurrence): the lone row's call runs at most
    `multi_step` tokens, not 1 + k, so the drafter looks again after them; the output is plain's."""
    from draftwise import SpecConfig

    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = [1000 + i for i in range(12)]
    plain = LLM(str(target), dtype="float32", multi_step=1).generate([prompt], sp)[0].token_ids
    llm = LLM(str(target), spec=SpecConfig(method="suffix", k=16), dtype="float32", multi_step=8)
    asked = []
    orig = llm.engine.runner.greedy_steps

    def counted(seq_id, feed, start, n, **kw):
        asked.append(n)
        return orig(seq_id, feed, start, n, **kw)

    llm.engine.runner.greedy_steps = counted
    assert llm.generate([prompt], sp)[0].token_ids == plain
    assert asked and max(asked) == 8, asked


def test_a_policy_sure_of_plain_steps_gets_multi_step_tokens_a_call(target):
    """A speculative engine whose policy says the next step drafts nothing for certain
    (`plain_next`: the goodput policy's coasting lease of plain decoding) lets a lone greedy row
    commit up to `multi_step` tokens in one call, as plain decoding does, not 1 + k: the same
    tokens, in fewer engine steps."""
    from draftwise import SpecConfig

    sp = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    plain = LLM(str(target), dtype="float32", multi_step=1).generate([PROMPTS[2]], sp)[0].token_ids
    steps = {}
    for sure in (True, False):
        llm = LLM(str(target), draft=str(target), dtype="float32", spec=SpecConfig(method="draft", k=4))
        llm.engine.policy.plan = lambda seqs, max_draft: [0] * len(seqs)  # plain steps only
        llm.engine.scheduler.plain_next = (lambda num_seqs: True) if sure else None
        assert llm.generate([PROMPTS[2]], sp)[0].token_ids == plain
        steps[sure] = llm.engine.stats.steps
    assert steps[True] <= -(-120 // 8) + 1 and steps[False] >= 120 // 5, steps


def test_a_multi_step_call_tells_the_policy_its_steps(target):
    """A lone row's plain steps in one call reach the policy as one `StepTiming` with `num_steps`
    (the target steps it ran: 1 + k here), `seconds` None (not the forward the cost model fits)
    and their time in `untimed_seconds`; every other step has num_steps 1."""
    from draftwise import SpecConfig

    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    llm = LLM(str(target), draft=str(target), dtype="float32", spec=SpecConfig(method="draft", k=4))
    llm.engine.policy.plan = lambda seqs, max_draft: [0] * len(seqs)  # plain steps only
    timings = []
    observe = llm.engine.policy.observe_step
    llm.engine.policy.observe_step = lambda t: timings.append(t) or observe(t)
    llm.generate([PROMPTS[2]], sp)
    several = [t for t in timings if t.num_steps > 1]
    assert several and all(t.num_steps <= 5 and t.seconds is None and t.untimed_seconds > 0 for t in several)
    assert max(t.num_steps for t in several) == 5
    assert all(t.num_steps == 1 for t in timings if t.untimed_seconds is None)
    assert sum(t.num_steps for t in timings) >= 59  # every token after the prefill's
