"""`--draft-vocab N` (model/draft_vocab.py): the draft's head over its most frequent tokens, and
`--draft-quantization`: the output stays the target's, q stays a distribution."""
import pytest
import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.model import draft_vocab
from draftwise.model.draft_vocab import FLOOR, MIN_TOKENS, PrunedHead, kept_rows, kept_tokens, token_ranking
from draftwise.model.pair import load_pair
from draftwise.model.quantize import GROUP, Int8Linear, quantization_of
from draftwise.sampling.processors import probs_from_logits


@pytest.fixture
def small_count(monkeypatch, tmp_path):
    monkeypatch.setattr(draft_vocab, "COUNT_CHARS", 200_000)
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path))


def test_kept_tokens_take_the_always_set_then_the_most_frequent():
    kept = kept_tokens([5, 3, 300, 7, 9] + list(range(400, 700)), MIN_TOKENS, 1000, always=[999, 3])
    assert len(kept) == MIN_TOKENS and kept.tolist() == sorted(kept.tolist())
    assert {999, 3, 5, 300, 7, 9} <= set(kept.tolist())
    assert 699 not in kept.tolist()  # ranked too low
    short = kept_tokens([5], MIN_TOKENS, 1000, always=[])  # too few ranked: the lowest ids fill up
    assert len(short) == MIN_TOKENS and 5 in short.tolist() and 0 in short.tolist()
    with pytest.raises(ValueError, match="at least"):
        kept_tokens([1, 2], MIN_TOKENS - 1, 1000, always=[])


def test_the_ranking_counts_the_corpus_once_and_is_cached(small_count, tokenizer, tmp_path):
    first = token_ranking(tokenizer)
    assert first and len(set(first)) == len(first)
    assert list((tmp_path / "draft-vocab").glob("*.json"))
    draft_vocab.COUNT_CHARS = 0  # a recount would see nothing: the cache answers
    assert token_ranking(tokenizer) == first


def test_a_pruned_int8_group_head_gives_the_same_logits_at_the_kept_ids():
    torch.manual_seed(0)
    O, N = 100, 2 * GROUP
    q = torch.randint(-127, 128, (O, N), dtype=torch.int8)
    gs = (torch.rand(O, N // GROUP) * 0.01 + 1e-3).half()
    head = Int8Linear([], blocks=[(q, gs)], float_out=True)
    kept = torch.tensor(sorted(torch.randperm(O)[:MIN_TOKENS].tolist()))
    pruned = PrunedHead(kept_rows(head, kept, None), kept, O)
    h = torch.randn(3, N)
    full, out = head(h).float(), pruned(h)
    assert out.shape == full.shape
    torch.testing.assert_close(out[:, kept], full[:, kept], rtol=1e-5, atol=1e-5)
    others = torch.ones(O, dtype=torch.bool)
    others[kept] = False
    assert (out[:, others] == FLOOR).all()
    p = probs_from_logits(out)
    assert torch.isfinite(p).all() and (p[:, others] == 0).all()
    masked = out.clone()
    masked[:, kept] = -torch.inf  # a grammar allowing none of the kept tokens: still a distribution
    pm = probs_from_logits(masked)
    assert torch.isfinite(pm).all() and torch.allclose(pm.sum(-1), torch.ones(3))


@pytest.mark.parametrize("dq", [None, "int8", "int4"])
def test_greedy_output_with_a_pruned_draft_equals_plain(small_count, target_dir, draft_dir, dq):
    prompts = [[5, 17, 42, 99, 7, 60, 61], [3, 3, 3, 8, 105, 11]]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(target_dir, spec=SpecConfig(), kv_cache_memory="64MB")
    spec = LLM(target_dir, draft=draft_dir, spec=SpecConfig(method="draft", k=4), kv_cache_memory="64MB",
               draft_vocab=MIN_TOKENS, draft_quantization=dq)
    head = spec.engine.proposer.runner.model.lm_head
    assert isinstance(head, PrunedHead) and len(head.kept) == MIN_TOKENS
    out = spec.generate(prompts, sp)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain.generate(prompts, sp)]
    assert sum(o.stats.proposed_tokens for o in out) > 0


def test_draft_quantization_applies_to_the_draft_only(target_dir, draft_dir):
    """(The tiny models' projections stay float, below quantize's size floor: the head says it.)"""
    target, draft = load_pair(target_dir, target_dir, needs_draft=True, draft_quantization="int4")
    assert quantization_of(target.model) is None and isinstance(draft.model.lm_head, Int8Linear)
    target, draft = load_pair(target_dir, draft_dir, needs_draft=True, quantization="int8", draft_quantization="none")
    assert isinstance(target.model.lm_head, Int8Linear) and quantization_of(draft.model) is None


def test_draft_vocab_below_the_minimum_is_a_clear_error(small_count, target_dir, draft_dir):
    with pytest.raises(ValueError, match="--draft-vocab 8: keep at least"):
        load_pair(target_dir, draft_dir, needs_draft=True, draft_vocab=8)


def test_draft_options_without_a_draft_model_are_clear_errors(target_dir, capsys):
    from draftwise.cli.main import main

    with pytest.raises(ValueError, match="--draft-vocab applies to a draft model; method 'ngram' loads none"):
        load_pair(target_dir, None, needs_draft=False, method="ngram", draft_vocab=1024)
    assert main(["generate", "--model", str(target_dir), "--method", "ngram", "--draft-quantization", "int4",
                 "hello", "--max-tokens", "2"]) != 0
    assert "--draft-quantization applies to a draft model" in capsys.readouterr().err
