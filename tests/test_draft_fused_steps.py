"""A drafter's greedy steps in one kernel call (`ModelRunner.greedy_steps`, `dw_draft_greedy`; for
several rows `greedy_steps_rows`, `dw_draft_greedy_rows`): the proposals, the K/V written and the
speculative output are those of the step-by-step loop."""
import pytest
import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.model import cpu_kernels, load_model
from draftwise.model.runner import ModelRunner
from tiny_models import make_model_dir, runner_with_prompts

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler: the fused kernels are off")

V = 2048  # a head of >= 2^17 elements at hidden 64: packed for dw_gemm (the fused steps' head)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer):
    out = {}
    for tie in (False, True):
        root = tmp_path_factory.mktemp(f"fused-steps-{tie}")
        out[tie] = (make_model_dir(root / "target", seed=0, tokenizer=tokenizer, vocab_size=V, layers=2, hidden=64),
                    make_model_dir(root / "draft", seed=1, tokenizer=tokenizer, vocab_size=V, layers=1, hidden=64,
                                   heads=2, kv_heads=1, inter=64, tie_word_embeddings=tie))
    return out


def _loop(runner, seq_id, feed, start, k):
    """The step-by-step path: run, the last row's argmax, its max softmax probability."""
    toks, conf = [], []
    for _ in range(k):
        logits = runner.run([seq_id], [feed], [start], [1])[0]
        tok = int(logits.argmax())
        toks.append(tok)
        conf.append(float(torch.softmax(logits, -1).max()))
        start += len(feed)
        feed = [tok]
    return toks, conf


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_fused_steps_equal_the_loop(pair, dtype, tie, paged):
    draft = load_model(pair[tie][1], dtype=dtype, load_tokenizer=False)
    runs = {}
    for fused in (True, False):
        r = ModelRunner(draft, 64, 16)
        if paged:  # interleaved block tables: sequence 0's blocks are not consecutive
            for n in range(1, 6):
                r.kv.reserve(0, 16 * n)
                r.kv.reserve(1, 16 * n)
        r.kv.reserve(0, 80)
        assert (r.kv.contiguous_start(0, 40) is None) == paged
        feed, start, k = [3, 17, 200, 45, 9], 0, 6
        r.run([0], [[5] * 20], [0], [1])  # some context first
        got = r.greedy_steps(0, feed, 20, k, confidence=True) if fused else _loop(r, 0, feed, 20, k)
        assert got is not None, "the fused steps did not run"
        # the K/V each path wrote: positions 0 .. 20 + len(feed) + k - 2
        end = 20 + len(feed) + k - 1
        slots = r.kv.slots([0], [end])[0]
        runs[fused] = (got[0], got[1], r.cache[:, :, slots].clone())
    assert runs[True][0] == runs[False][0]
    assert torch.allclose(torch.tensor(runs[True][1]), torch.tensor(runs[False][1]), rtol=1e-4, atol=1e-6)
    assert torch.equal(runs[True][2], runs[False][2])


def test_fused_steps_leave_a_token_outside_the_vocabulary_to_the_step_by_step_path(pair):
    """The kernel reads embedding rows by id unchecked: an id outside the vocabulary is not passed to
    it (None: the caller's step-by-step path raises its error)."""
    r = ModelRunner(load_model(pair[False][1], load_tokenizer=False), 16, 16)
    r.kv.reserve(0, 32)
    assert r.greedy_steps(0, [3, V], 0, 2) is None
    assert r.greedy_steps(0, [3, -1], 0, 2) is None
    assert r.greedy_steps(0, [3, V - 1], 0, 2) is not None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_output_is_the_same_with_and_without_fused_steps(pair, dtype):
    """Greedy speculative decoding through the engine: a lone request (consecutive slots), two
    requests drafting together (`greedy_steps_rows`) and a long request left alone after a short one
    (interleaved blocks) give the same tokens and the same acceptance either way, and the fused
    steps ran."""
    target, draft = pair[True]
    prompts = [[5, 6, 7, 8, 9] * 6, [40, 41, 42] * 5]
    sps = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    outs, calls = {}, {"greedy_steps": 0, "greedy_steps_rows": 0}
    for fused in (True, False):
        llm = LLM(str(target), draft=str(draft), spec=SpecConfig(method="draft", k=4), dtype=dtype)
        prop = llm.engine.proposer
        prop.fused_steps = fused
        for name in calls:
            _count_fused(prop.runner, name, calls)
        alone = llm.generate([prompts[0]], sps[0])
        together = llm.generate(prompts, sps)
        outs[fused] = [(o.token_ids, o.stats.accepted_tokens, o.stats.proposed_tokens) for o in alone + together]
    assert outs[True] == outs[False]
    assert calls["greedy_steps"] > 0 and calls["greedy_steps_rows"] > 0  # a lone row's steps, two rows' together


def _count_fused(runner, name: str, calls: dict) -> None:
    """Wrap runner.<name> to count the calls in which the fused steps ran (a result, not None)."""
    orig = getattr(runner, name)

    def counted(*a, **kw):
        got = orig(*a, **kw)
        calls[name] += got is not None
        return got

    setattr(runner, name, counted)


def _loop_rows(runner, seq_ids, feeds, starts, ks):
    """The drafter's step-by-step loop over several rows: one `run` of the rows still drafting a step."""
    toks = [[] for _ in seq_ids]
    conf = [[] for _ in seq_ids]
    feeds, starts = [list(f) for f in feeds], list(starts)
    active = list(range(len(seq_ids)))
    while active:
        logits = runner.run([seq_ids[i] for i in active], [feeds[i] for i in active], [starts[i] for i in active],
                            [1] * len(active))
        for r, i in enumerate(active):
            tok = int(logits[r].argmax())
            toks[i].append(tok)
            conf[i].append(float(torch.softmax(logits[r], -1).max()))
            starts[i] += len(feeds[i])
            feeds[i] = [tok]
        active = [i for i in active if len(toks[i]) < ks[i]]
    return toks, conf


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ks", [(4, 4, 4), (1, 4, 2)])
def test_fused_steps_of_several_rows_equal_the_loop(pair, dtype, ks):
    """`greedy_steps_rows` (`dw_draft_greedy_rows`): rows feeding different catch-ups (1-5 tokens)
    on interleaved block tables, drafting the same or different numbers of tokens: the proposals,
    their confidences and the K/V written are the loop's."""
    draft = load_model(pair[False][1], dtype=dtype, load_tokenizer=False)
    feeds = [[3, 17, 200, 45, 9], [11], [7, 8]]
    ctx = [20, 33, 9]
    runs = {}
    for fused in (True, False):
        r = ModelRunner(draft, 64, 16)
        for n in range(1, 5):  # interleaved block tables
            for sid in range(3):
                r.kv.reserve(sid, 16 * n)
        r.run([0, 1, 2], [[5] * c for c in ctx], [0, 0, 0], [1, 1, 1])  # some context first
        if fused:
            got = r.greedy_steps_rows([0, 1, 2], feeds, ctx, list(ks), confidence=True)
        else:
            got = _loop_rows(r, [0, 1, 2], feeds, ctx, list(ks))
        assert got is not None, "the fused steps did not run"
        ends = [c + len(f) + k - 1 for c, f, k in zip(ctx, feeds, ks)]
        kv = [r.cache[:, :, r.kv.slots([sid], [e])[0]].clone() for sid, e in zip(range(3), ends)]
        runs[fused] = (got[0], got[1], kv)
    assert runs[True][0] == runs[False][0]
    assert [len(t) for t in runs[True][0]] == list(ks)
    for a, b in zip(runs[True][1], runs[False][1]):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-6)
    for a, b in zip(runs[True][2], runs[False][2]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_steps_give_each_slots_runner_up(pair, dtype):
    """`runners_up`: with the same proposals and confidences, each step's second most probable token
    and its probability, as the loop's logits give them (what a greedy tree's sibling leaves are)."""
    draft = load_model(pair[False][1], dtype=dtype, load_tokenizer=False)
    feeds, ks = [[3, 17, 200], [45, 9]], [4, 3]
    got = {}
    for fused in (True, False):
        r = runner_with_prompts(draft, len(feeds))
        if fused:
            got[fused] = r.greedy_steps_rows([0, 1], feeds, [20, 20], ks, confidence=True, runners_up=True)
            continue
        rows = []
        for b, (f, k) in enumerate(zip(feeds, ks)):
            toks, conf, tok2, p2, feed, start = [], [], [], [], f, 20
            for _ in range(k):
                logits = r.run([b], [feed], [start], [1])[0].float()
                probs = torch.softmax(logits, -1)
                top = torch.topk(logits, 2)
                toks.append(int(top.indices[0]))
                conf.append(float(probs[toks[-1]]))
                tok2.append(int(top.indices[1]))
                p2.append(float(probs[tok2[-1]]))
                start += len(feed)
                feed = [toks[-1]]
            rows.append((toks, conf, tok2, p2))
        got[fused] = rows
    toks, conf, runners = got[True]
    for b, (t, c, t2, p2) in enumerate(got[False]):
        assert toks[b] == t and runners[b][0] == t2
        assert conf[b] == pytest.approx(c, rel=1e-4) and runners[b][1] == pytest.approx(p2, rel=1e-4)
        assert all(x < y for x, y in zip(runners[b][1], conf[b]))
