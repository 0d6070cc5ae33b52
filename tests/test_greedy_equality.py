"""Greedy speculative decoding equals plain greedy decoding, token for token (float32).

Configurations cover every acceptance regime: the target drafting for itself (every proposal
accepted), an unrelated random draft and a drafter that is always wrong (none accepted), and
n-gram lookup and suffix decoding (some). A mismatch is tolerated only at a near-tie of the
target (top-2 logit gap < 1e-5), where a one-token and a multi-token forward may round
differently; the count is reported.
"""
import random

import pytest
import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.model import load_model
from draftwise.proposers import DraftBlock, register_proposer
from draftwise.proposers.draft_model import DraftModelProposer


@register_proposer("test-always-wrong")
class AlwaysWrongProposer(DraftModelProposer):
    """Proposes the draft model's token + 1: at temperature 0 with draft = target, never accepted."""

    def propose(self, seqs, ks, num_forced=None):
        vocab = self.runner.cfg.vocab_size
        blocks = super().propose(seqs, ks)
        return [DraftBlock([(t + 1) % vocab for t in b.token_ids], None) for b in blocks]


def prompts(vocab: int, n: int = 20) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(1, 30))] for _ in range(n)]


def near_tie(model, ids: list[int], pos: int) -> bool:
    """Is the target's top-2 logit gap below 1e-5 when predicting token `pos` of `ids`?"""
    with torch.no_grad():
        logits = model.logits(torch.tensor([ids[:pos]]))[0, -1]
    top2 = torch.topk(logits, 2).values
    return float(top2[0] - top2[1]) < 1e-5


def near_tie_divergences(target, ps, outs, base) -> int:
    """How many outputs differ from the plain ones; each must first differ at a near-tie."""
    ties = 0
    for p, o, b in zip(ps, outs, base):
        if o.token_ids == b.token_ids:
            continue
        j = next(i for i, (x, y) in enumerate(zip(o.token_ids, b.token_ids)) if x != y)
        assert near_tie(target, p + b.token_ids, len(p) + j), f"mismatch at output position {j} is not a near-tie"
        ties += 1
    return ties


@pytest.fixture(scope="module")
def plain(target_dir):
    llm = LLM(str(target_dir))
    ps = prompts(llm.engine.vocab_size)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return ps, sp, llm.generate(ps, sp)


CONFIGS = [("draft", "target"), ("draft", "draft"), ("test-always-wrong", "target"), ("ngram", None), ("suffix", None)]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("method,draft", CONFIGS)
def test_greedy_speculative_equals_plain(plain, target_dir, draft_dir, method, draft, k):
    ps, sp, base = plain
    d = {"target": target_dir, "draft": draft_dir, None: None}[draft]
    # the target as its own draft at the same precision accepts everything; the other draft runs
    # in the CPU default (bfloat16)
    llm = LLM(str(target_dir), draft=str(d) if d else None, spec=SpecConfig(method=method, k=k),
              draft_dtype="float32" if draft == "target" else None)
    outs = llm.generate(ps, sp)
    target = load_model(target_dir, load_tokenizer=False).model
    ties = near_tie_divergences(target, ps, outs, base)
    print(f"{method}/{draft} k={k}: {ties} near-tie divergences")
    proposed = sum(o.stats.proposed_tokens for o in outs)
    accepted = sum(o.stats.accepted_tokens for o in outs)
    assert proposed > 0
    if (method, draft) == ("draft", "target"):
        assert accepted == proposed  # every proposal accepted
        assert all(o.stats.mean_accepted_length > 1 for o in outs)
    if method == "test-always-wrong":
        assert accepted == 0  # none accepted
        assert all(o.stats.mean_accepted_length == 1.0 for o in outs)
    for o in outs:
        assert len(o.token_ids) == sp.max_tokens and o.finish_reason == "length"
        assert sum(o.stats.accepted_per_position) == o.stats.accepted_tokens


@pytest.mark.parametrize("draft", ["target", "draft"])
def test_greedy_equality_with_packed_projections(target_dir, draft_dir, draft, monkeypatch):
    """The same check with every projection packed for oneDNN, as the shipped models' are (the
    tiny test weights are below the packing size): one-token and K+1-token products go through
    oneDNN (or, on CPUs without AVX-512, dw_gemm_f32, bitwise the same) in both the drafter and
    the target."""
    import draftwise.model.packed_weights as packed_weights

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    monkeypatch.setattr(packed_weights, "PACK_MIN_NUMEL", 0)
    plain_llm = LLM(str(target_dir))
    head = plain_llm.engine.runner.model.lm_head
    assert head.is_packed
    ps = prompts(plain_llm.engine.vocab_size)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = plain_llm.generate(ps, sp)
    d = target_dir if draft == "target" else draft_dir
    outs = LLM(str(target_dir), draft=str(d), spec=SpecConfig(method="draft", k=4)).generate(ps, sp)
    target = load_model(target_dir, load_tokenizer=False).model
    ties = near_tie_divergences(target, ps, outs, base)
    print(f"packed draft/{draft} k=4: {ties} near-tie divergences")
    assert sum(o.stats.accepted_tokens for o in outs) > 0
