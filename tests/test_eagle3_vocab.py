"""`--method eagle3 --draft-vocab N` (model/eagle3_vocab.py): the drafter's steps over the target's N
most frequent tokens. Greedy output equal to plain decoding at 1 and 16 in flight, with the kernels
and without; the kernel steps' logits the full head's on the kept rows and FLOOR elsewhere, their
argmax mapped to token ids; DraftBlock.probs zero outside the kept set; `draftwise check` PASS; bad
N a clear error."""
import random

import pytest
import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.cli.main import main
from draftwise.model import cpu_kernels, draft_vocab
from draftwise.model.draft_vocab import FLOOR, MIN_TOKENS, PrunedHead
from draftwise.model.pair import load_pair
from test_dspark_engine import assert_equal_but_near_ties
from test_eagle3_engine import make_eagle3_dir
from tiny_models import make_model_dir

KEEP = 256


@pytest.fixture(scope="module")
def rank_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("draft-vocab")


@pytest.fixture
def small_count(monkeypatch, rank_dir):
    """The ranking counted over a small part of the corpus, cached in this module's own folder (not
    DRAFTWISE_CACHE, which also holds the engine's hardware profiles: a fresh one per test would
    measure a profile per engine)."""
    monkeypatch.setattr(draft_vocab, "COUNT_CHARS", 200_000)
    monkeypatch.setattr(draft_vocab, "_cache_dir", lambda: rank_dir)


@pytest.fixture(scope="module")
def wide(tmp_path_factory, tokenizer):
    """A target whose packed head the kernels take (2048 x 64), its drafter, prompts and plain
    decoding's greedy outputs."""
    path = tmp_path_factory.mktemp("e3vocab")
    target = make_model_dir(path / "target", seed=0, tokenizer=tokenizer, vocab_size=2048, layers=2, hidden=64)
    eagle3 = make_eagle3_dir(path / "eagle3", target)
    rng = random.Random(0)
    ps = [[rng.randrange(1, 320) for _ in range(rng.randint(1, 30))] for _ in range(20)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = LLM(str(target))
    return target, eagle3, ref, ps, sp, [o.token_ids for o in ref.generate(ps, sp)]


def pruned(target, eagle3, **kw):
    llm = LLM(str(target), draft=str(eagle3), spec=SpecConfig(method="eagle3", k=4), draft_vocab=KEEP, **kw)
    head = llm.engine.proposer.drafter.head
    assert isinstance(head, PrunedHead) and len(head.kept) == KEEP
    return llm


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("seqs", [1, 16])
def test_greedy_equals_plain(small_count, wide, seqs, kernels):
    target, eagle3, ref, ps, sp, want = wide
    if kernels and not cpu_kernels.usable(torch.float32):
        pytest.skip("the CPU kernels are not built here")
    cpu_kernels.set_enabled(kernels)
    try:
        llm = pruned(target, eagle3, max_num_seqs=seqs, max_model_len=64)
        assert (llm.engine.proposer.kernel is not None) == kernels
        outs = llm.generate(ps, sp)
    finally:
        cpu_kernels.set_enabled(True)
    assert_equal_but_near_ties(ref.engine.target.model, ps, [o.token_ids for o in outs], want)
    assert llm.engine.stats.proposed_tokens > 0


def test_kernel_logits_are_the_full_heads_on_the_kept_rows(small_count, wide):
    """`Eagle3Kernel.greedy` and `.draft` with the pruned head: logits equal to the full head's
    (`Eagle3Drafter.draft` without it) on the kept rows within 1e-4, FLOOR elsewhere; the greedy
    tokens the argmax over the kept rows, as target token ids."""
    if not cpu_kernels.usable(torch.float32):
        pytest.skip("the CPU kernels are not built here")
    target, eagle3, _, ps, _, _ = wide
    llm = pruned(target, eagle3)
    eng, prop = llm.engine, llm.engine.proposer
    assert prop.kernel is not None and prop.kernel.head is not None
    kept = prop.drafter.head.kept
    out = torch.ones(eng.vocab_size, dtype=torch.bool)
    out[kept] = False
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    seqs = [eng.add_request(f"v{i}", p, sp) for i, p in enumerate(ps[:4])]
    while any(s.num_computed == 0 or s.is_prefilling for s in seqs):
        eng.step()
    lengths = [s.draft_computed for s in seqs]
    forced = torch.randint(0, eng.vocab_size, (4, len(seqs)), generator=torch.Generator().manual_seed(0))
    steps = []
    with torch.inference_mode():
        first, slots = prop.step_slots([s.seq_id for s in seqs], lengths, [4] * len(seqs))
        toks, _, logits = prop.kernel.greedy(first, [n - 1 for n in lengths], [4] * len(seqs), prop.cache, slots,
                                             logits=True)
        prop.kernel.draft(first, [n - 1 for n in lengths], 4, prop.cache, slots,
                          lambda j, lg: steps.append(lg.clone()) or forced[j])
        k, v, pos, last = prop.context([s.seq_id for s in seqs], lengths)
        start = torch.tensor(lengths) - 1
        head, prop.drafter._head = prop.drafter._head, []  # the target's whole head
        try:
            greedy_tokens = iter(torch.tensor(toks).T)
            full = prop.drafter.draft(last, start, k, v, pos < start[:, None], 4, lambda j, lg: next(greedy_tokens))
            full_forced = prop.drafter.draft(last, start, k, v, pos < start[:, None], 4, lambda j, lg: forced[j])
        finally:
            prop.drafter._head = head
    assert logits.shape == full.logits.shape
    for got, ref in ((logits, full.logits), (torch.stack(steps, 1), full_forced.logits)):
        assert torch.allclose(got[..., kept], ref[..., kept], atol=1e-4, rtol=1e-5)
        assert bool((got[..., out] == FLOOR).all())
    best = kept[full.logits[..., kept].argmax(-1)]  # [B, 4]
    assert torch.tensor(toks).tolist() == best.tolist()
    assert not bool(torch.isin(torch.tensor(toks), torch.nonzero(out)[:, 0]).any())


@pytest.mark.parametrize("kernels", [True, False])
def test_q_is_zero_outside_the_kept_tokens(small_count, wide, kernels):
    target, eagle3, _, ps, _, _ = wide
    cpu_kernels.set_enabled(kernels)
    try:
        llm = pruned(target, eagle3)
        eng = llm.engine
        sp = SamplingParams(temperature=0.9, top_k=0, seed=3, max_tokens=40, ignore_eos=True)
        seq = eng.add_request("q", ps[0], sp)
        while seq.is_prefilling or seq.num_computed == 0:
            eng.step()
        block = eng.proposer.propose([seq], [4])[0]
    finally:
        cpu_kernels.set_enabled(True)
    kept = eng.proposer.drafter.head.kept
    out = torch.ones(eng.vocab_size, dtype=torch.bool)
    out[kept] = False
    assert block.probs.shape == (4, eng.vocab_size)
    assert bool((block.probs[:, out] == 0).all()) and torch.allclose(block.probs.sum(-1), torch.ones(4))
    assert all(t in set(kept.tolist()) for t in block.token_ids)


def test_check_passes(small_count, target_dir, tmp_path, capsys):
    eagle3 = make_eagle3_dir(tmp_path / "eagle3", target_dir)
    rc = main(["check", "--model", str(target_dir), "--method", "eagle3", "--draft", str(eagle3), "--k", "4",
               "--draft-vocab", str(MIN_TOKENS), "--samples", "300", "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in ("greedy equality", "distribution", "KV rollback"):
        assert f"PASS {name}" in out


def test_bad_draft_vocab(small_count, target_dir, tmp_path, capsys):
    eagle3 = make_eagle3_dir(tmp_path / "eagle3", target_dir)
    with pytest.raises(ValueError, match="--draft-vocab 8: keep at least"):
        load_pair(target_dir, eagle3, needs_draft=True, method="eagle3", draft_vocab=8)
    with pytest.raises(ValueError, match="--draft-vocab 100000: the target's vocabulary has"):
        load_pair(target_dir, eagle3, needs_draft=True, method="eagle3", draft_vocab=100_000)
    with pytest.raises(ValueError, match="--draft-quantization applies to a draft model, not to an EAGLE-3"):
        load_pair(target_dir, eagle3, needs_draft=True, method="eagle3", draft_quantization="int8", draft_vocab=64)
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(target_dir), "--method", "eagle3", "--draft", str(eagle3),
              "--draft-vocab", "0", "hi"])
    assert "--draft-vocab: must be an integer >= 1" in capsys.readouterr().err
