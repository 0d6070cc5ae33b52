"""`train draft --data self`: the target's own chat replies as the draft's data, generated in
resumable shards (int32 ids above 32767 kept), then a draft trained on them."""
from __future__ import annotations

import json

import pytest
import torch

from draftwise import corpus
from draftwise.model import load_model
from draftwise.train import distill, self_data
from test_train_vocab import SHIFT, big_vocab_setup

SOURCE = '''"""Helpers for parsing and joining words.

This module holds a few small text helpers used by the examples: they split text into words,
join words back into text, count them and find the longest one. None of them keeps state, and
every one of them accepts any string, including the empty string, for which they return empty
results or zero.
"""


def split_words(text):
    """Split the text into a list of words separated by whitespace."""
    words = []
    for part in text.split():
        if part:
            words.append(part)
    return words


def join_words(words, sep=" "):
    """Join the words back into a single string with the separator."""
    out = ""
    for i, word in enumerate(words):
        if i:
            out += sep
        out += word
    return out


def count_words(text):
    """Count the number of whitespace separated words in the text."""
    total = 0
    for part in text.split():
        total += 1
    if total < 0:
        total = 0
    return total
'''


@pytest.fixture
def setup(tmp_path, monkeypatch):
    return big_vocab_setup(tmp_path, monkeypatch, SOURCE, SOURCE)


def test_prompts_come_from_the_training_files_only(setup):
    prompts = self_data.chat_prompts(corpus.split().texts("train"))
    assert len(prompts) >= 4  # module docstring + 3 functions (grounded), 3 open asks
    text = [m[0][1] for m in prompts]
    assert any("split_words" in t for t in text) and any(t.startswith("Write a Python function") for t in text)


def test_generation_is_resumable_and_refuses_other_settings(setup, tmp_path):
    tok, target = setup
    data = tmp_path / "data"
    first = self_data.generate(target, data, tokens=1, max_tokens=4, batch=2, log=lambda m: None)
    assert first["shards"] == 1 and first["prompts_done"] == 2  # stops once the budget is reached
    again = self_data.generate(target, data, tokens=10**9, max_tokens=4, batch=2, log=lambda m: None)
    n = again["prompts_total"]
    assert again["prompts_done"] == n and again["shards"] == -(-n // 2)
    samples = [s for i in range(again["shards"]) for s in torch.load(data / f"shard_{i:05d}.pt")]
    assert len(samples) == n - again["prompts_skipped"] >= 4 and all(s.dtype == torch.int32 for s in samples)
    assert min(int(s.min()) for s in samples) >= 0 and max(int(s.max()) for s in samples) >= SHIFT
    assert sum(len(s) for s in samples) == again["tokens"]
    with pytest.raises(ValueError, match="other settings"):
        self_data.generate(target, data, tokens=10**9, max_tokens=5, batch=2)
    eos = tok.token_to_id("<|endoftext|>")
    streams = self_data.load_streams(data, eos)
    assert streams["train"].dtype == torch.int32 and int((streams["train"] == eos).sum()) >= len(samples) - 1


def test_train_draft_on_self_data(setup, tmp_path):
    tok, target = setup
    summary = distill.train_draft(tmp_path / "draft", target, tokens=2 * 2 * 16, ckpt_dir=tmp_path / "ckpt",
                                  data="self", gen_tokens=10**9, gen_max_tokens=8,
                                  overrides=dict(shape="tiny", batch_size=2, seq_len=16, warmup_steps=1))
    assert summary["self_data"]["prompts_done"] == summary["self_data"]["prompts_total"]
    assert "sequence-level" in summary["objective"]
    assert json.loads((tmp_path / "draft" / "training.json").read_text())["role"] == "draft"
    draft = load_model(tmp_path / "draft", load_tokenizer=False, fuse=False)
    assert draft.config.vocab_size == tok.get_vocab_size() > 32767
    again = distill.train_draft(tmp_path / "draft2", target, tokens=2 * 2 * 16, ckpt_dir=tmp_path / "ckpt2",
                                data="self", data_dir=tmp_path / "ckpt" / "self_data", gen_tokens=0,
                                overrides=dict(shape="tiny", batch_size=2, seq_len=16, warmup_steps=1))
    assert again["self_data"]["tokens"] == summary["self_data"]["tokens"]  # trained on what was there


def test_train_eagle3_on_self_data_over_kept_tokens(setup, tmp_path, monkeypatch):
    """`train eagle3 --data self --draft-vocab N`: trained on the replies, over N tokens whose ids are
    saved with the drafter; loaded, it drafts over exactly those (a PrunedHead) and greedy output
    stays plain decoding's."""
    from draftwise import LLM, SamplingParams, SpecConfig
    from draftwise.model import draft_vocab
    from draftwise.model.draft_vocab import PrunedHead
    from draftwise.train.eagle3 import train_eagle3

    monkeypatch.setattr(draft_vocab, "_cache_dir", lambda: tmp_path / "rank")
    tok, target = setup
    n = 300
    summary = train_eagle3(tmp_path / "e3", target, tokens=2 * 2 * 16, ckpt_dir=tmp_path / "ck", steps=2,
                           data="self", gen={"tokens": 10**9, "max_tokens": 8}, draft_vocab=n,
                           overrides=dict(batch_size=2, seq_len=16, warmup_steps=1))
    assert summary["data"] == "self" and summary["draft_vocab"] == n
    assert json.loads((tmp_path / "e3" / "config.json").read_text())["draft_vocab"] == n
    llm = LLM(str(target), draft=str(tmp_path / "e3"), spec=SpecConfig(method="eagle3", k=3))
    head = llm.engine.proposer.drafter.head
    assert isinstance(head, PrunedHead) and len(head.kept) == n
    assert torch.equal(head.kept.cpu(), llm.engine.proposer.drafter.draft_vocab_ids.cpu())
    assert head.kept.unique().numel() == n and int(head.kept.max()) < tok.get_vocab_size()
    ps = [tok.encode(t).ids for t in ("def split_words(text):", "Count the words")]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(target)).generate(ps, sp)
    assert [o.token_ids for o in llm.generate(ps, sp)] == [o.token_ids for o in plain]


def test_train_dspark_on_self_data_over_kept_tokens_with_a_bfloat16_target(setup, tmp_path, monkeypatch):
    """`train dspark --data self --draft-vocab N --target-dtype bfloat16`: trained on the replies
    (generated by the same settings as for EAGLE-3, so the shards are shared), over N tokens whose
    ids are saved; the Markov bias stays zero outside them; loaded, the drafter drafts over exactly
    those and greedy output stays plain decoding's."""
    from draftwise import LLM, SamplingParams, SpecConfig
    from draftwise.model import draft_vocab
    from draftwise.model.draft_vocab import PrunedHead
    from draftwise.model.dspark import load_dspark
    from draftwise.train.dspark import train_dspark

    monkeypatch.setattr(draft_vocab, "_cache_dir", lambda: tmp_path / "rank")
    tok, target = setup
    n = 300
    summary = train_dspark(tmp_path / "ds", target, tokens=2 * 2 * 16, ckpt_dir=tmp_path / "ck", block_size=3,
                           data="self", gen={"tokens": 10**9, "max_tokens": 8}, draft_vocab=n,
                           target_dtype="bfloat16", overrides=dict(batch_size=2, seq_len=16, warmup_steps=1,
                                                                   anchors=4))
    assert summary["data"] == "self" and summary["draft_vocab"] == n and summary["target_dtype"] == "bfloat16"
    assert json.loads((tmp_path / "ds" / "config.json").read_text())["draft_vocab"] == n
    drafter = load_dspark(tmp_path / "ds", load_model(target).model)
    off = torch.ones(drafter.cfg.vocab_size, dtype=torch.bool)
    off[drafter.draft_vocab_ids] = False
    assert drafter.markov.w2.weight[drafter.draft_vocab_ids].abs().sum() > 0
    assert drafter.markov.w2.weight[off].abs().sum() == 0  # no gradient reached the other tokens' bias
    llm = LLM(str(target), draft=str(tmp_path / "ds"), spec=SpecConfig(method="dspark", k=3))
    head = llm.engine.proposer.drafter.kept_head
    assert isinstance(head, PrunedHead) and torch.equal(head.kept.cpu(), drafter.draft_vocab_ids)
    ps = [tok.encode(t).ids for t in ("def split_words(text):", "Count the words")]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(target)).generate(ps, sp)
    assert [o.token_ids for o in llm.generate(ps, sp)] == [o.token_ids for o in plain]
