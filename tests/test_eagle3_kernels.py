"""EAGLE-3's kernel calls (model/eagle3_native.py, kernels/eagle3.c) on a target whose packed head
the kernels take: greedy rows' one-call steps equal to plain and to the PyTorch steps, the
one-call cache writes equal to a fresh forward, and other rows' one-call-a-step drafting equal to
the PyTorch steps with q the processed distribution of the logits handed to the chooser."""
import pytest
import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.model import cpu_kernels, load_model
from draftwise.sampling import process_logits
from test_eagle3_engine import make_eagle3_dir, plain  # noqa: F401 (plain: a fixture)
from test_dspark_engine import assert_equal_but_near_ties
from tiny_models import make_model_dir


@pytest.fixture(scope="module")
def wide_head(tmp_path_factory, tokenizer, plain):
    """A target whose packed head the kernels take (2048 x 64: dw_gemm_f32's, as the embedded
    target's), its drafter, and plain decoding's greedy outputs of `plain`'s prompts."""
    if not cpu_kernels.usable(torch.float32):
        pytest.skip("the CPU kernels are not built here")
    path = tmp_path_factory.mktemp("wide")
    target = make_model_dir(path / "target", seed=0, tokenizer=tokenizer, vocab_size=2048, layers=2, hidden=64)
    eagle3 = make_eagle3_dir(path / "eagle3", target)
    _, ps, sp, _ = plain
    ref = LLM(str(target))
    return target, eagle3, ref, [o.token_ids for o in ref.generate(ps, sp)]


@pytest.mark.parametrize("seqs,blocks", [(1, None), (16, None), (16, 14)])
def test_kernel_steps_greedy_equals_plain(wide_head, plain, seqs, blocks):
    """Greedy rows drafting in one kernel call: output equal to plain at 1 and 16 in flight and under
    preemption."""
    target, eagle3, ref, want = wide_head
    _, ps, sp, _ = plain
    llm = LLM(str(target), draft=str(eagle3), spec=SpecConfig(method="eagle3", k=4), max_num_seqs=seqs,
              num_kv_blocks=blocks, max_model_len=64)
    prop = llm.engine.proposer
    assert prop.kernel is not None
    calls = []
    real = prop.kernel.greedy
    prop.kernel.greedy = lambda *a, **kw: calls.append(len(a[1])) or real(*a, **kw)
    outs = llm.generate(ps, sp)
    assert_equal_but_near_ties(ref.engine.target.model, ps, [o.token_ids for o in outs], want)
    st = llm.engine.stats
    assert st.proposed_tokens > 0 and calls
    assert max(calls) == 1 if seqs == 1 else max(calls) > 1  # (rows of a batch in one call)
    if blocks:
        assert st.preemptions > 0


def test_kernel_steps_equal_the_reference(wide_head, plain):
    """Greedy rows' one-call steps (`Eagle3Kernel.greedy`) give `Eagle3Drafter.draft`'s tokens, its
    logits within float rounding (the same products, the kernels' norms and attention for torch's)
    and max q as confidences, for rows of different context lengths and step counts; the committed
    cache is left as it was (the steps' K/V go to scratch slots); `propose` takes that call for greedy
    rows and the step-by-step path for sampled ones in the same batch."""
    target, eagle3, _, _ = wide_head
    _, ps, _, _ = plain
    llm = LLM(str(target), draft=str(eagle3), spec=SpecConfig(method="eagle3", k=5))
    eng, prop = llm.engine, llm.engine.proposer
    assert prop.kernel is not None
    params = [SamplingParams(temperature=0 if i != 2 else 0.9, seed=i, max_tokens=8, ignore_eos=True) for i in range(6)]
    seqs = [eng.add_request(f"k{i}", p, sp) for i, (p, sp) in enumerate(zip(ps[:6], params))]
    while any(s.num_computed == 0 or s.is_prefilling for s in seqs):
        eng.step()
    ks = [5, 3, 5, 1, 4, 2]
    lengths = [s.draft_computed for s in seqs]
    committed = prop.cache[:, :, : prop.num_slots].clone()
    with torch.inference_mode():
        first, slots = prop.step_slots([s.seq_id for s in seqs], lengths, ks)
        toks, conf, logits = prop.kernel.greedy(first, [n - 1 for n in lengths], ks, prop.cache, slots, logits=True)
        k, v, pos, last = prop.context([s.seq_id for s in seqs], lengths)
        start = torch.tensor(lengths) - 1
        ref = prop.drafter.draft(last, start, k, v, pos < start[:, None], 5)
    assert torch.equal(prop.cache[:, :, : prop.num_slots], committed)
    assert torch.equal(first, last)
    for b, n in enumerate(ks):
        assert toks[b] == ref.tokens[b, :n].tolist()
        assert torch.allclose(logits[b, :n], ref.logits[b, :n], atol=1e-4, rtol=1e-5)
        q = torch.softmax(ref.logits[b, :n], -1).amax(-1)
        assert torch.allclose(torch.tensor(conf[b]), q, atol=1e-5)
    calls = []
    real = prop.kernel.greedy
    prop.kernel.greedy = lambda *a, **kw: calls.append(len(a[1])) or real(*a, **kw)
    blocks = prop.propose(seqs, ks)
    assert calls == [5]  # the five greedy rows in one call; the sampled row stepped apart
    assert [len(b.token_ids) for b in blocks] == ks
    assert blocks[2].probs is not None and all(b.probs is None for i, b in enumerate(blocks) if i != 2)
    assert [b.token_ids for i, b in enumerate(blocks) if i != 2] == [t for i, t in enumerate(toks) if i != 2]
    assert torch.equal(prop.cache[:, :, : prop.num_slots], committed)


def test_kernel_cache_writes_equal_a_fresh_forward(wide_head, plain):
    """A verification's committed rows go into the drafter's cache in one kernel call
    (`Eagle3Kernel.commit`; a long prefill chunk through PyTorch): after every step the cached rows
    and K/V of each sequence are those of a fresh forward over its committed tokens."""
    target, eagle3, _, _ = wide_head
    _, ps, _, _ = plain
    llm = LLM(str(target), draft=str(eagle3), spec=SpecConfig(method="eagle3", k=4), max_model_len=64)
    eng, prop = llm.engine, llm.engine.proposer
    assert prop.kernel is not None and prop.kernel.commits
    calls = []
    real = prop.kernel.commit
    prop.kernel.commit = lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw)
    fresh_target = load_model(target, fuse=False, load_tokenizer=False).model.eval()
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_tokens=20, ignore_eos=True)
              for i in range(4)]
    seqs = [eng.add_request(f"c{i}", p, sp) for i, (p, sp) in enumerate(zip(ps[:4], params))]
    checked = 0
    while eng.has_unfinished():
        eng.step()
        for s in seqs:
            if not (s.is_finished or s.is_prefilling or s.num_computed == 0):
                assert prop.cache_error(s, fresh_target) <= 1e-4
                checked += 1
    assert checked > 10 and calls and max(calls) > 1


def test_kernel_chosen_steps_equal_the_reference(wide_head, plain):
    """Sampled rows step through the kernel (`Eagle3Kernel.draft`, one call a step): its logits are
    `Eagle3Drafter.draft`'s fed the same tokens (within float rounding), the committed cache stays;
    `propose` takes it for every sampled row, DraftBlock.probs[j] = softmax(process_logits(step j's
    logits it handed the chooser)): the q each token was drawn from."""
    target, eagle3, _, _ = wide_head
    _, ps, _, _ = plain
    llm = LLM(str(target), draft=str(eagle3), spec=SpecConfig(method="eagle3", k=4))
    eng, prop = llm.engine, llm.engine.proposer
    params = [SamplingParams(temperature=0.8, top_k=50 * (i % 2), repetition_penalty=1.0 + 0.1 * (i % 3), seed=i,
                             max_tokens=8, ignore_eos=True) for i in range(5)]
    seqs = [eng.add_request(f"c{i}", p, sp) for i, (p, sp) in enumerate(zip(ps[:5], params))]
    while any(s.num_computed == 0 or s.is_prefilling for s in seqs):
        eng.step()
    lengths = [s.draft_computed for s in seqs]
    committed = prop.cache[:, :, : prop.num_slots].clone()
    forced = torch.randint(0, eng.vocab_size, (4, len(seqs)), generator=torch.Generator().manual_seed(0))
    steps = []  # each step's logits
    with torch.inference_mode():
        first, slots = prop.step_slots([s.seq_id for s in seqs], lengths, [4] * len(seqs))
        prop.kernel.draft(first, [n - 1 for n in lengths], 4, prop.cache, slots,
                          lambda j, logits: steps.append(logits.clone()) or forced[j])
        k, v, pos, last = prop.context([s.seq_id for s in seqs], lengths)
        start = torch.tensor(lengths) - 1
        ref = prop.drafter.draft(last, start, k, v, pos < start[:, None], 4, lambda j, logits: forced[j])
    assert torch.equal(prop.cache[:, :, : prop.num_slots], committed)
    assert torch.allclose(torch.stack(steps, 1), ref.logits, atol=1e-4, rtol=1e-5)
    calls, kept, real = [], [], prop.kernel.draft
    prop.kernel.draft = lambda first, starts, n, cache, slots, choose: calls.append(len(starts)) or real(
        first, starts, n, cache, slots, lambda j, logits: kept.append(logits.clone()) or choose(j, logits))
    blocks = prop.propose(seqs, [4, 3, 4, 2, 1])
    assert calls == [5] and [len(b.token_ids) for b in blocks] == [4, 3, 4, 2, 1]
    assert torch.equal(prop.cache[:, :, : prop.num_slots], committed)
    for b, (s, blk) in enumerate(zip(seqs, blocks)):
        for j, tok in enumerate(blk.token_ids):
            hist = s.output_ids + blk.token_ids[:j]
            q = torch.softmax(process_logits(kept[j][b: b + 1], [s.params], [s.prompt_ids], [hist]), -1)
            assert torch.equal(blk.probs[j], q[0]) and blk.probs[j, tok] > 0
