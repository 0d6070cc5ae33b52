"""DSpark's kernel calls (model/dspark_native.py, kernels/dspark.c) on a target whose packed head the
kernels take: greedy output equal to plain at 1 and 16 in flight and under preemption; one call's
block (the parallel stage, and the sequential stage of greedy rows and of rows sampled at a
temperature alone) equal to the PyTorch path's, for bidirectional and causal blocks, float32 and
bfloat16; the kernel's draws fitting the q they report; the one-call cache writes equal to a fresh
forward after rollbacks."""
import json
import shutil

import pytest
import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.model import cpu_kernels, load_model
from draftwise.model.draft_vocab import FLOOR
from test_dspark_engine import assert_cache_is_fresh, assert_equal_but_near_ties, make_dspark_dir, plain  # noqa: F401
from tiny_models import make_model_dir


@pytest.fixture(scope="module")
def wide(tmp_path_factory, tokenizer, plain):
    """A target whose packed head the kernels take (2048 x 64), its DSpark drafter (and a causal-block
    copy), and plain decoding's greedy outputs of `plain`'s prompts."""
    if not cpu_kernels.usable(torch.float32):
        pytest.skip("the CPU kernels are not built here")
    path = tmp_path_factory.mktemp("wide")
    target = make_model_dir(path / "target", seed=0, tokenizer=tokenizer, vocab_size=2048, layers=2, hidden=64)
    dspark = make_dspark_dir(path / "dspark", target)
    causal = path / "causal"  # the same weights, its blocks causal
    shutil.copytree(dspark, causal)
    cfg = json.loads((causal / "config.json").read_text())
    (causal / "config.json").write_text(json.dumps({**cfg, "causal_block": True}))
    _, ps, sp, _ = plain
    ref = LLM(str(target))
    return target, dspark, causal, ref, [o.token_ids for o in ref.generate(ps, sp)]


def _spy(prop):
    calls = []
    block = prop.kernel.block
    prop.kernel.block = lambda *a, **k: calls.append(a[3]) or block(*a, **k)
    return calls


@pytest.mark.parametrize("seqs,blocks,vocab", [(1, None, None), (16, None, None), (16, 14, None), (16, None, 512)])
def test_kernel_blocks_greedy_equals_plain(wide, plain, seqs, blocks, vocab):
    target, dspark, _, ref, want = wide
    _, ps, sp, _ = plain
    llm = LLM(str(target), draft=str(dspark), spec=SpecConfig(method="dspark", k=4), max_num_seqs=seqs,
              num_kv_blocks=blocks, max_model_len=64, draft_vocab=vocab)
    prop = llm.engine.proposer
    assert prop.kernel is not None and prop.kernel.sequential and (prop.kernel.head is not None) == bool(vocab)
    calls = _spy(prop)
    outs = llm.generate(ps, sp)
    assert_equal_but_near_ties(ref.engine.target.model, ps, [o.token_ids for o in outs], want)
    assert calls and all(k > 0 for ks in calls for k in ks)  # every greedy row drafted in the call
    assert llm.engine.stats.proposed_tokens > 0
    if blocks:
        assert llm.engine.stats.preemptions > 0


def _after_prefill(llm, ps, params):
    eng = llm.engine
    seqs = [eng.add_request(f"b{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, params))]
    while any(s.num_computed == 0 or s.is_prefilling for s in seqs):
        eng.step()
    for _ in range(2):
        eng.step()
    return seqs


def _reference_q(prop, seq, hidden, toks, temperature):
    """q_k = softmax((U_k + B(x_{k-1})) / t) of a drafted block, from the PyTorch path's hidden states
    [gamma, H] of the row."""
    d = prop.drafter
    base = d.head(hidden)  # [gamma, V]
    prev = [seq.all_ids[-1]] + toks
    out = []
    for k in range(len(toks)):
        _, bias = d.markov.step(None, torch.tensor([prev[k]]), hidden[k: k + 1])
        out.append(torch.softmax((base[k: k + 1] + bias) / temperature, -1)[0])
    return torch.stack(out)


@pytest.mark.parametrize("causal,dtype,vocab", [(False, "float32", None), (True, "float32", None),
                                                (False, "bfloat16", None), (False, "float32", 512)])
def test_kernel_block_equals_the_pytorch_path(wide, plain, causal, dtype, vocab):
    """Rows of different context lengths in one call: greedy rows' tokens and confidences equal the
    PyTorch path's; a row sampled at a temperature alone gets q_k = softmax((U_k + B(x_{k-1})) / t)
    of the tokens it drew; rows with top-k get the hidden states and base logits of the PyTorch
    path, and draw in `draw` (up to float rounding). With --draft-vocab the head is the target's
    most frequent rows: FLOOR logits and no q mass elsewhere, as `PrunedHead` gives them."""
    if not cpu_kernels.usable(getattr(torch, dtype)):
        pytest.skip(f"no {dtype} kernels here")
    target, dspark, causal_dir, _, _ = wide
    _, ps, _, _ = plain
    llm = LLM(str(target), draft=str(causal_dir if causal else dspark), spec=SpecConfig(method="dspark", k=5),
              dtype=dtype, draft_vocab=vocab)
    prop = llm.engine.proposer
    assert prop.kernel is not None and prop.drafter.cfg.causal_block == causal
    kept = torch.arange(2048) if vocab is None else prop.drafter.kept_head.kept
    assert len(kept) == (vocab or 2048)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.7, seed=i, max_tokens=20, ignore_eos=True) if i == 4 else
              SamplingParams(temperature=1.0, top_k=20, seed=i, max_tokens=20, ignore_eos=True) for i in range(6)]
    seqs = _after_prefill(llm, ps[:6], params)
    rows = list(range(6))
    lengths = [s.draft_computed for s in seqs]
    anchors = [s.all_ids[-1] for s in seqs]
    cut = [5, 3, 5, 1, 4, 5]
    with torch.inference_mode():
        hidden, base, done, _ = prop._kernel_block(seqs, rows, lengths, anchors, cut, set(), {})
        ref_hidden = prop._block_hidden(seqs, rows, lengths, anchors)
        ref_base = prop.drafter.head(ref_hidden)
    tol = 2e-2 if dtype == "bfloat16" else 1e-4
    assert sorted(done) == [1, 3, 4, 5]  # the greedy rows and the temperature-only one
    topk = torch.tensor([0, 2])
    assert (hidden[topk].float() - ref_hidden[topk].float()).abs().max() <= tol
    got, want = base[topk][..., kept], ref_base[topk][..., kept]
    assert (got - want).abs().max() <= tol * max(1.0, float(want.abs().max()))
    outside = torch.ones(2048, dtype=torch.bool)
    outside[kept] = False
    assert bool((base[topk][..., outside] == FLOOR).all())
    toks, q, conf = done[4]
    assert len(toks) == 4 and q.shape == (4, 2048) and not bool(q[:, outside].any())
    with torch.inference_mode():
        ref_q = _reference_q(prop, seqs[4], ref_hidden[4], toks, 0.7)
    assert (q - ref_q).abs().max() <= tol and all(q[k, t] > 0 for k, t in enumerate(toks))
    prop.kernel = None
    with torch.inference_mode():
        ref = prop.propose(seqs, cut)
    for r in (1, 3, 5):
        toks, q, conf = done[r]
        assert len(toks) == cut[r] and q is None
        assert toks == ref[r].token_ids or dtype == "bfloat16"  # (bfloat16: near-ties may part)
        n = next((j for j, (a, b) in enumerate(zip(toks, ref[r].token_ids)) if a != b), len(toks))
        assert n > 0 and max(abs(a - b) for a, b in zip(conf[:n], ref[r].confidence[:n])) <= tol


def test_kernel_draws_follow_q(wide, plain):
    """A row sampled at a temperature alone draws its tokens in the kernel: over 3000 blocks drafted
    from one state, x_1's counts fit q_1 and, after the most frequent x_1, x_2's fit q_2(. | x_1)
    (chi-square goodness of fit, cells pooled to an expected count of 10 or more)."""
    from scipy.stats import chisquare
    target, dspark, _, _, _ = wide
    _, ps, _, _ = plain
    llm = LLM(str(target), draft=str(dspark), spec=SpecConfig(method="dspark", k=2))
    prop = llm.engine.proposer
    (seq,) = _after_prefill(llm, ps[:1], [SamplingParams(temperature=0.3, seed=3, max_tokens=20, ignore_eos=True)])
    n, draws, q1, q2 = 3000, [], None, {}
    with torch.inference_mode():
        for _ in range(n):
            (b,) = prop.propose([seq], [2])
            draws.append(tuple(b.token_ids))
            q1 = b.probs[0] if q1 is None else q1
            assert torch.allclose(b.probs[0], q1)  # one state: one q_1
            q2[b.token_ids[0]] = b.probs[1]

    def fit(counts, q, total):
        order = torch.argsort(q, descending=True).tolist()
        cells, obs, exp = [], 0.0, 0.0
        for t in order:  # tokens in decreasing q, pooled until the expected count reaches 10
            obs, exp = obs + counts.get(t, 0), exp + total * float(q[t])
            if exp >= 10:
                cells.append((obs, exp))
                obs, exp = 0.0, 0.0
        if cells and exp:
            cells[-1] = (cells[-1][0] + obs, cells[-1][1] + exp)
        assert len(cells) >= 3, cells  # a test with something to compare
        o, e = zip(*cells)
        return chisquare(o, [x * sum(o) / sum(e) for x in e]).pvalue

    first = {}
    for a, _ in draws:
        first[a] = first.get(a, 0) + 1
    top = max(first, key=first.get)
    second = {}
    for a, b in draws:
        if a == top:
            second[b] = second.get(b, 0) + 1
    assert fit(first, q1, n) > 1e-3 and fit(second, q2[top], first[top]) > 1e-3


@pytest.mark.parametrize("blocks", [None, 14])
def test_kernel_cache_writes_equal_a_fresh_forward(wide, plain, blocks):
    """After rounds with rejections (and recomputes after preemption), the cache written by the
    kernel's calls (a step's fed rows of every sequence in one, rejected proposals' rows too, past
    the committed length) holds the committed context's K/V and fused features as a fresh forward
    gives them."""
    target, dspark, _, _, _ = wide
    _, ps, _, _ = plain
    llm = LLM(str(target), draft=str(dspark), spec=SpecConfig(method="dspark", k=4), num_kv_blocks=blocks,
              max_model_len=64)
    eng, prop = llm.engine, llm.engine.proposer
    commits = []
    commit = prop.kernel.commit
    prop.kernel.commit = lambda f, *a: commits.append(f.shape[0]) or commit(f, *a)
    fresh_target = load_model(target, fuse=False, load_tokenizer=False).model.eval()
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_tokens=30, ignore_eos=True)
              for i in range(len(ps))]
    seqs = [eng.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, params))]
    checked = 0
    while eng.has_unfinished():
        eng.step()
        for s in seqs:
            if s.is_finished or s.is_prefilling or s.num_computed == 0:
                continue
            assert s.draft_computed == s.num_computed
            assert_cache_is_fresh(prop, fresh_target, s)
            checked += 1
    assert checked > 20 and len(commits) <= eng.stats.steps and max(commits) > 16  # a step's rows in one call
    assert eng.stats.proposed_tokens > eng.stats.accepted_tokens > 0
    if blocks:
        assert eng.stats.preemptions > 0


@pytest.mark.parametrize("vocab,confidence,dtype", [(None, False, "float32"), (None, True, "float32"),
                                                    (512, True, "float32"), (None, True, "bfloat16")])
def test_kernel_trees_equal_the_pytorch_trees(wide, plain, vocab, confidence, dtype):
    """Greedy rows' trees grown in the block call (kernels/dspark_tree.c) are `markov_trees` over the
    same block's base logits: the same nodes and parents, their q and confidences up to float
    rounding, with a learned calibration and a price; with --draft-vocab over the kept tokens; in
    bfloat16."""
    from draftwise.proposers.dspark_tree import markov_trees
    from draftwise.proposers.tree_budget import NodeCalibration

    if not cpu_kernels.usable(getattr(torch, dtype)):
        pytest.skip(f"no {dtype} kernels here")
    target, dspark, _, _, _ = wide
    _, ps, _, _ = plain
    llm = LLM(str(target), draft=str(dspark), spec=SpecConfig(method="dspark", k=8, tree=3), draft_vocab=vocab,
              dtype=dtype)
    prop = llm.engine.proposer
    prop.confidence = confidence
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seqs = _after_prefill(llm, ps[:5], [sp] * 5)
    cal = NodeCalibration()
    for i, q in enumerate([0.9, 0.3, 0.05, 0.6, 0.12] * 8):  # some verified trees' outcomes
        cal._count(q, i % 3 != 0, i % 2 == 0)
    prop.calibration = cal
    rows, lengths, anchors = list(range(5)), [s.draft_computed for s in seqs], [s.all_ids[-1] for s in seqs]
    budgets = [8, 3, 0, 8, 5]
    for price in (0.0, 0.05):
        prop.budget = prop.budget.__class__(price, ())
        with torch.inference_mode():
            fused = {r: n for r, n in enumerate(budgets) if n}
            _, _, _, grown = prop._kernel_block(seqs, rows, lengths, anchors, [5] * 5, set(fused), fused)
            hidden, base, _, _ = prop._kernel_block(seqs, rows, lengths, anchors, [5] * 5, set(rows), {})
            want = markov_trees(prop.drafter, hidden, base, anchors, budgets, 3, cal, price, confidence)
        assert sorted(grown) == [r for r, n in enumerate(budgets) if n]
        for r, (blk, record) in grown.items():
            ref, ref_record = want[r]
            assert blk.token_ids == ref.token_ids and blk.parents == ref.parents
            assert len(blk.token_ids) <= budgets[r] and (blk.token_ids or price > 0)
            assert blk.confidence == pytest.approx(ref.confidence, abs=1e-4)
            if record is None:  # (no node pays the price)
                assert ref_record is None and price > 0
                continue
            assert record.qs == pytest.approx(ref_record.qs, abs=1e-4) and record.firsts == ref_record.firsts
