"""Drafting across vocabularies: a draft whose tokenizer differs from the target's.

Two tiny byte-level BPE tokenizers trained on different text (the target's knows CJK merges, the
draft's does not; their special tokens sit at other ids), a tiny random target, and two drafts: a
random one, and the target's own weights carried onto the draft's vocabulary (shared tokens keep
their rows), which agrees with the target often. Checked: the intersection and the translation, the re-tokenization
of the draft's text into target tokens (greedy rows' proposals), the context's rollback and the
K/V a text round keeps, greedy output equal to plain at one and four concurrent requests (greedy
rows drafting text, or over the intersection), q a
distribution on shared target ids, and `draftwise check` (greedy, sampled distribution, rollback,
stops) PASS.
"""
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.cli.main import main
from draftwise.model.vocab_map import VocabMap, token_surfaces
from draftwise.proposers.cross_vocab import CrossVocabProposer, DraftContext
from tiny_models import CORPUS, make_model_dir

CJK = ["# 你好世界\nprint('你好')\n", "s = '世界你好'\n"] * 15


def byte_bpe(corpus, vocab_size: int, specials: list[str], all_bytes: bool = True) -> Tokenizer:
    """`all_bytes`: the 256 single bytes in the vocabulary (else only those of the corpus)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if all_bytes else []
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                        initial_alphabet=alphabet))
    return tok


@pytest.fixture(scope="module")
def toks():
    target = byte_bpe(CORPUS + CJK, 420, ["<|endoftext|>"])
    draft = byte_bpe(CORPUS[::-1] + ["while True:\n    pass\n"] * 10, 330, ["<pad>", "<|endoftext|>"])
    return target, draft


@pytest.fixture(scope="module")
def pair(tmp_path_factory, toks):
    """(target dir, random draft dir, mapped draft dir). The target's vocabulary holds only the
    corpus' bytes (ASCII): a random target's output then decodes to whole characters, which the
    stop-string cases of `check` need."""
    base = tmp_path_factory.mktemp("xvocab")
    ascii_tok = byte_bpe(CORPUS, 300, ["<|endoftext|>"], all_bytes=False)
    target = make_model_dir(base / "target", seed=0, tokenizer=ascii_tok, layers=2, hidden=64)
    rand = make_model_dir(base / "rand", seed=1, tokenizer=toks[1], layers=1, hidden=32, heads=2, kv_heads=1, inter=64)
    mapped = make_model_dir(base / "mapped", seed=2, tokenizer=toks[1], layers=2, hidden=64)
    vmap = VocabMap(ascii_tok, toks[1], ascii_tok.get_vocab_size(), toks[1].get_vocab_size())
    sd_t, sd_d = load_file(str(target / "model.safetensors")), load_file(str(mapped / "model.safetensors"))
    for name, w in sd_t.items():
        if w.shape == sd_d[name].shape:
            sd_d[name] = w.clone()
        else:  # the vocabulary's rows: the shared tokens' from the target, the rest random
            sd_d[name][vmap.shared_draft] = w[vmap.shared_target]
    save_file(sd_d, str(mapped / "model.safetensors"))
    return target, rand, mapped


def test_intersection_matches_bytes_and_specials(toks):
    target, draft = toks
    vmap = VocabMap(target, draft, target.get_vocab_size(), draft.get_vocab_size())
    ts, ds = token_surfaces(target, 10**6, "target"), token_surfaces(draft, 10**6, "draft")
    shared = dict(zip(vmap.shared_target.tolist(), vmap.shared_draft.tolist()))
    assert len(shared) == vmap.size >= 256  # (both hold the 256 single bytes)
    for t, d in shared.items():
        assert ts[t] == ds[d]
    draft_surfaces = set(ds.values())
    assert all(t in shared for t, s in ts.items() if s in draft_surfaces)  # nothing shared left out
    eot = target.token_to_id("<|endoftext|>")
    assert shared[eot] == draft.token_to_id("<|endoftext|>") != eot  # matched by content, not by id
    assert vmap.draft_id(target.token_to_id("<|endoftext|>") + 1000) is None


def test_unshared_tokens_are_re_encoded_from_their_bytes(toks):
    target, draft = toks
    vmap = VocabMap(target, draft, target.get_vocab_size(), draft.get_vocab_size())
    ts, ds = token_surfaces(target, 10**6, "target"), token_surfaces(draft, 10**6, "draft")
    unshared = [t for t in ts if vmap.draft_id(t) is None and not ts[t][0]]
    assert unshared
    partial = 0  # tokens that end inside a UTF-8 character (the byte-alphabet path)
    for t in unshared:
        got = vmap.draft_tokens(t)
        assert len(got) >= 2 and b"".join(ds[d][1] for d in got) == ts[t][1]
        try:
            ts[t][1].decode("utf-8")
        except UnicodeDecodeError:
            partial += 1
    assert partial > 0
    ids = target.encode("print('你好世界')\nwhile True:").ids
    d, ends = vmap.translate(ids)
    assert draft.decode(d) == target.decode(ids) and len(ends) == len(ids) and ends[-1] == len(d)


def test_draft_text_is_re_tokenized_into_target_tokens(toks):
    """A text round's proposals: the draft tokens' text in the target's own tokens (merges the draft
    lacks included), cut at a special token (its target id kept) and before bytes that end inside a
    character."""
    target, draft = toks
    vmap = VocabMap(target, draft, target.get_vocab_size(), draft.get_vocab_size())
    text = "s = '世界你好'\nprint('你好')"
    d = draft.encode(text).ids
    got = vmap.target_tokens(d)
    assert got == target.encode(text).ids and target.decode(got) == text
    assert any(vmap.draft_id(t) is None for t in got)  # (CJK merges only the target knows)
    eot_d, eot_t = draft.token_to_id("<|endoftext|>"), target.token_to_id("<|endoftext|>")
    assert vmap.target_tokens(d + [eot_d] + d) == target.encode(text).ids + [eot_t]
    assert vmap.target_tokens([eot_d]) == [eot_t]
    assert vmap.target_tokens([draft.token_to_id("<pad>")] + d) == []  # the target has no such token
    partial = [draft.token_to_id(c) for c in _byte_chars("ab".encode() + "世".encode("utf-8")[:2])]
    assert vmap.target_tokens(partial) == target.encode("ab").ids
    assert sum(vmap.byte_length(t, draft=False) for t in got) == len(text.encode("utf-8"))
    assert sum(vmap.byte_length(i, draft=True) for i in d) == len(text.encode("utf-8"))


def _byte_chars(data: bytes) -> list[str]:
    """Each byte as its character of the byte-level alphabet (the single-byte tokens' strings)."""
    from draftwise.model.vocab_map import byte_alphabet

    chars = {b: c for c, b in byte_alphabet().items()}
    return [chars[b] for b in data]


def test_a_text_rounds_k_v_stay_valid_where_the_translation_repeats_them(toks):
    target, draft = toks
    vmap = VocabMap(target, draft, target.get_vocab_size(), draft.get_vocab_size())
    ctx = DraftContext()
    ctx.extend(vmap, target.encode("x = 1\n").ids)
    before = list(ctx.ids)
    y = vmap.translate(target.encode("y = 2").ids)[0]
    ctx.extend(vmap, target.encode("y = 2").ids)
    ctx.keep_fed(before + y[:2] + [y[2] + 1, 5])  # the draft fed two of the proposals' draft tokens
    assert ctx.computed == len(before) + 2
    ctx.keep_fed(before + y + [5])
    assert ctx.computed == len(ctx.ids)
    ctx.keep_fed([before[0] + 1])
    assert ctx.computed == 0


def test_context_rollback_is_a_truncation(toks):
    target, draft = toks
    vmap = VocabMap(target, draft, target.get_vocab_size(), draft.get_vocab_size())
    ids = target.encode("s = '世界你好'\nfor i in range(10):").ids
    ctx = DraftContext()
    ctx.extend(vmap, ids)
    full_ids, full_ends = list(ctx.ids), list(ctx.ends)
    ctx.computed = len(ctx.ids)
    for n in range(len(ids), -1, -1):
        ctx.truncate(n)
        want, ends = vmap.translate(ids[:n])
        assert ctx.ids == want and ctx.ends == ends and ctx.computed == len(want)
    ctx.extend(vmap, ids)
    assert (ctx.ids, ctx.ends) == (full_ids, full_ends)


@pytest.mark.parametrize("text", [True, False])
@pytest.mark.parametrize("concurrent", [1, 4])
def test_greedy_equals_plain(pair, concurrent, text, capsys):
    """Greedy rows drafting re-tokenized text (`text`) or over the intersection: plain's tokens."""
    target, rand, mapped = pair
    prompts = ["def add(a, b):", "for i in range(10):\n", "class Point:\n    def", "import os\n"]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(target))
    want = [o.token_ids for o in plain.generate(prompts, sp)]
    for draft in (rand, mapped):
        llm = LLM(str(target), draft=str(draft), spec=SpecConfig(method="draft", k=4))
        assert isinstance(llm.engine.proposer, CrossVocabProposer)
        llm.engine.proposer.text = text
        if concurrent == 1:
            got = [llm.generate([p], sp)[0].token_ids for p in prompts]
        else:
            got = [o.token_ids for o in llm.generate(prompts, sp)]
        assert got == want
        if draft is mapped:
            assert llm.engine.stats.accepted_tokens > 0  # the mapped draft is right often
    assert "drafting across vocabularies over the" in capsys.readouterr().err


def test_a_pruned_draft_head_keeps_greedy_and_q_exact(pair, monkeypatch, tmp_path):
    """`--draft-vocab N` on a draft of another vocabulary: its head over its own most frequent
    tokens; greedy output equals plain, and q stays a distribution on shared target ids."""
    from draftwise.model import draft_vocab
    from draftwise.model.draft_vocab import MIN_TOKENS, PrunedHead

    monkeypatch.setattr(draft_vocab, "COUNT_CHARS", 200_000)
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path))
    target, _, mapped = pair
    prompts = ["def add(a, b):", "for i in range(10):\n"]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(target)).generate(prompts, sp)]
    llm = LLM(str(target), draft=str(mapped), spec=SpecConfig(method="draft", k=3), draft_vocab=MIN_TOKENS)
    head = llm.engine.proposer.runner.model.lm_head
    assert isinstance(head, PrunedHead) and len(head.kept) == MIN_TOKENS
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    eng = llm.engine
    seq = eng.add_request("r", "def add(a, b):", SamplingParams(temperature=1.0, max_tokens=20, seed=1))
    eng.step()
    blk = eng.proposer.propose([seq], [3])[0]
    assert torch.allclose(blk.probs.sum(dim=1), torch.ones(len(blk.token_ids)), atol=1e-5)
    kept_targets = {t for t, d in zip(eng.proposer.vmap.shared_target.tolist(), eng.proposer.vmap.shared_draft.tolist())
                    if d in set(head.kept.tolist())}
    assert all(t in kept_targets for t in blk.token_ids)


@pytest.mark.parametrize("constraint", [{"regex": r"[a-c]{2,5}x"}, {"choice": ["yes", "no", "maybe so"]}])
def test_grammar_masks_q_on_target_ids(pair, constraint):
    """Constrained rows draft under the target's grammar mask: greedy output equals plain, and
    sampled output follows the constraint."""
    target, _, mapped = pair
    plain = LLM(str(target))
    cross = LLM(str(target), draft=str(mapped), spec=SpecConfig(method="draft", k=3))
    prompts = ["def add(a, b):", "class Point:"]
    greedy = SamplingParams(temperature=0, max_tokens=24, structured_output=constraint)
    assert [o.token_ids for o in cross.generate(prompts, greedy)] == [o.token_ids for o in plain.generate(prompts, greedy)]
    sampled = SamplingParams(temperature=1.0, max_tokens=24, seed=5, structured_output=constraint)
    for o in cross.generate(prompts, sampled):
        assert o.finish_reason == "stop"
        if "regex" in constraint:
            assert re.fullmatch(constraint["regex"], o.text), o.text
        else:
            assert o.text in constraint["choice"], o.text


def test_q_is_a_distribution_on_shared_target_ids(pair):
    target, _, mapped = pair
    llm = LLM(str(target), draft=str(mapped), spec=SpecConfig(method="draft", k=3))
    eng = llm.engine
    seq = eng.add_request("r", "def add(a, b):", SamplingParams(temperature=1.0, max_tokens=20, seed=1))
    shared = torch.zeros(eng.vocab_size, dtype=torch.bool)
    shared[eng.proposer.vmap.shared_target] = True
    for _ in range(3):
        eng.step()
    blocks = eng.proposer.propose([seq], [3])
    blk = blocks[0]
    assert len(blk.token_ids) == 3 and blk.probs.shape == (3, eng.vocab_size)
    assert torch.allclose(blk.probs.sum(dim=1), torch.ones(3), atol=1e-5)
    assert float(blk.probs[:, ~shared].abs().max()) == 0.0
    assert all(bool(shared[t]) and float(blk.probs[j, t]) > 0 for j, t in enumerate(blk.token_ids))


def test_check_passes_on_a_cross_vocab_pair(pair, capsys):
    target, _, mapped = pair
    rc = main(["check", "--model", str(target), "--draft", str(mapped), "--k", "3", "--samples", "300",
               "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in ("greedy equality", "distribution", "KV rollback", "stops inside accepted blocks"):
        assert f"PASS {name}" in out


def test_tiny_intersection_and_trees_are_errors(tmp_path, pair, toks):
    target, _, _ = pair
    chars = byte_bpe(["abc"] * 5, 300, ["<s>"])
    chars.decoder = decoders.Metaspace()  # not byte-level: cannot be mapped
    other = make_model_dir(tmp_path / "meta", seed=3, tokenizer=chars, layers=1, hidden=32, heads=2, kv_heads=1,
                           inter=64)
    with pytest.raises(ValueError, match="byte-level BPE"):
        LLM(str(target), draft=str(other), spec=SpecConfig(method="draft"))
    big = make_model_dir(tmp_path / "big", seed=3, tokenizer=toks[1], vocab_size=20000, layers=1, hidden=32,
                         heads=2, kv_heads=1, inter=64)
    with pytest.raises(ValueError, match=r"shares only \d+ of its 20000 tokens"):
        LLM(str(target), draft=str(big), spec=SpecConfig(method="draft"))
    with pytest.raises(ValueError, match="drafts chains only"):
        LLM(str(target), draft=str(pair[2]), spec=SpecConfig(method="draft", tree=2))
