"""A draft head over its frequent tokens (`--draft-vocab`, `PrunedHead`) inside the fused kernels:
its kept rows run as the int8-group head they are (`NativeIO.head_ids`: each row's token id), so
the draft's one-call forward and its greedy steps (`dw_forward`, `dw_draft_greedy[_rows]`) run
with it; logits, proposals and K/V are those of the PyTorch path (`PrunedHead.forward`)."""
import pytest
import torch

from draftwise.engine import EngineConfig, LLMEngine, SpecConfig
from draftwise.model import act8, cpu_kernels, load_model
from draftwise.model.draft_vocab import FLOOR, PrunedHead, prune_head
from draftwise.model.quantize import Int8Linear, int8_groups
from draftwise.model.runner import ModelRunner
from draftwise.sampling import SamplingParams
from tiny_models import make_model_dir, runner_with_prompts

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None or not act8.enabled(),
                                reason="the int8-group head runs in the kernels on a VNNI build only")

V = 2048


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("pruned-head")
    return (make_model_dir(root / "target", seed=0, tokenizer=tokenizer, vocab_size=V, layers=2, hidden=64),
            make_model_dir(root / "draft", seed=1, tokenizer=tokenizer, vocab_size=V, layers=1, hidden=64, heads=2,
                           kv_heads=1, inter=64, tie_word_embeddings=False))


def _kept() -> torch.Tensor:  # every third id and the top ones: token 0 and most others pruned
    return torch.tensor(sorted(set(range(1, V, 3)) | set(range(V - 40, V))), dtype=torch.long)


def _pruned_draft(path, dtype: str = "float32", kernels: bool = True):
    """The tiny draft with an int8-group head (a GGUF's Q8_0 blocks, as the Qwen draft's), pruned to
    `_kept()`; `kernels=False`: its forward layer by layer and its head in PyTorch (the reference)."""
    draft = load_model(path, dtype=dtype, load_tokenizer=False)
    m = draft.model
    m.lm_head = Int8Linear([], blocks=[int8_groups(m.head_rows)], float_out=True)
    m.head_rows = None
    prune_head(m, _kept())
    assert isinstance(m.lm_head, PrunedHead) and m.lm_head.inner.act8
    if not kernels:
        m._decoder_plan = ()  # (no one-call plan: native_logits and greedy_steps decline)
    return draft


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_one_call_forward_gives_the_pruned_heads_logits(dirs, dtype):
    logits = {}
    for kernels in (True, False):
        r = ModelRunner(_pruned_draft(dirs[1], dtype, kernels), 16, 16)
        r.kv.reserve(0, 48)
        r.run([0], [[5] * 20], [0], [1])
        logits[kernels] = r.run([0], [[3, 17, 200, 45, 9]], [20], [3])  # [3, V]
    kept = _kept()
    pruned = torch.ones(V, dtype=torch.bool)
    pruned[kept] = False
    assert logits[True].shape == (3, V) and (logits[True][:, pruned] == FLOOR).all()
    assert torch.equal(logits[True], logits[False])


def _loop(runner, seq_id, feed, start, k):
    toks, conf = [], []
    for _ in range(k):
        logits = runner.run([seq_id], [feed], [start], [1])[0]
        toks.append(int(logits.argmax()))
        conf.append(float(torch.softmax(logits, -1).max()))
        start += len(feed)
        feed = [toks[-1]]
    return toks, conf


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_steps_with_a_pruned_head_equal_the_loop(dirs, dtype):
    """The proposals are token ids (a row's id, not its index among the kept rows), the loop's; so
    are the K/V written; the confidences agree to rounding (the kept logits' softmax)."""
    runs = {}
    for fused in (True, False):
        r = ModelRunner(_pruned_draft(dirs[1], dtype, kernels=fused), 64, 16)
        r.kv.reserve(0, 80)
        r.run([0], [[5] * 20], [0], [1])
        feed, k = [3, 17, 200, 45, 9], 6
        got = r.greedy_steps(0, feed, 20, k, confidence=True) if fused else _loop(r, 0, feed, 20, k)
        assert got is not None, "the fused steps did not run"
        slots = r.kv.slots([0], [20 + len(feed) + k - 1])[0]
        runs[fused] = (got[0], got[1], r.cache[:, :, slots].clone())
    assert runs[True][0] == runs[False][0] and set(runs[True][0]) <= set(_kept().tolist())
    assert max(runs[True][0]) >= len(_kept())  # ids beyond the kept count: mapped, not row indices
    assert torch.allclose(torch.tensor(runs[True][1]), torch.tensor(runs[False][1]), rtol=1e-4, atol=1e-6)
    assert torch.equal(runs[True][2], runs[False][2])


def test_greedy_steps_of_several_rows_with_a_pruned_head_give_ids_and_runners_up(dirs):
    feeds, ks = [[3, 17, 200], [45, 9]], [4, 3]
    got = {}
    for fused in (True, False):
        r = runner_with_prompts(_pruned_draft(dirs[1], kernels=fused), len(feeds))
        if fused:
            got[fused] = r.greedy_steps_rows([0, 1], feeds, [20, 20], ks, confidence=True, runners_up=True)
            continue
        rows = []
        for b, (f, k) in enumerate(zip(feeds, ks)):
            toks, tok2, feed, start = [], [], f, 20
            for _ in range(k):
                top = torch.topk(r.run([b], [feed], [start], [1])[0], 2).indices.tolist()
                toks.append(top[0])
                tok2.append(top[1])
                start += len(feed)
                feed = [toks[-1]]
            rows.append((toks, tok2))
        got[fused] = rows
    toks, _, runners = got[True]
    for b, (t, t2) in enumerate(got[False]):
        assert toks[b] == t and runners[b][0] == t2


def test_speculative_output_with_a_pruned_head_in_the_kernels_equals_plain(dirs):
    """Through the engine: greedy output equal to plain decoding's, the draft's steps in one call."""
    target = load_model(dirs[0])
    prompts = [[5, 6, 7, 8, 9] * 6, [40, 41, 42] * 5]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs, fused = {}, []
    for method in (None, "draft"):
        draft = _pruned_draft(dirs[1]) if method else None
        engine = LLMEngine(target, draft, SpecConfig(method=method, k=4), EngineConfig())
        if method:
            for name in ("greedy_steps", "greedy_steps_rows"):  # record what each fused call returned
                _record(engine.proposer.runner, name, fused)
        got = {}
        for batch in ([prompts[0]], prompts):  # a lone row's steps, then two rows' together
            for ids in batch:
                engine.add_request(f"r{len(got)}", ids, sp)
                got[f"r{len(got)}"] = []
            while engine.has_unfinished():
                for o in engine.step():
                    got[o.seq.request_id].extend(o.new_token_ids)
        outs[method] = got
    assert outs["draft"] == outs[None]
    # (a round that feeds the whole prompt, more rows than the tiny draft's float products take, steps one by one)
    assert {name for name, got in fused if got is not None} == {"greedy_steps", "greedy_steps_rows"}


def _record(runner, name: str, calls: list) -> None:
    orig = getattr(runner, name)

    def recorded(*a, **kw):
        got = orig(*a, **kw)
        calls.append((name, got))
        return got

    setattr(runner, name, recorded)
