"""Token streams of vocabularies above 32767 (SmolLM2 has 49152): stored as int32, and
`train draft --target DIR` runs end to end on one (tiny model, tiny corpus, a few steps)."""
from __future__ import annotations

import json

import torch
from tokenizers import Tokenizer

from draftwise import corpus
from draftwise.model import load_model
from draftwise.train import distill
from draftwise.train.data import encode_stream, stream_dtype
from tiny_models import CORPUS, make_model_dir, make_tokenizer

SHIFT = 40000  # every real token gets an id above 32767; filler tokens take the low ids


def big_vocab_tokenizer() -> Tokenizer:
    d = json.loads(make_tokenizer(320).to_str())
    d["model"]["vocab"] = {**{f"<fill{i}>": i for i in range(SHIFT)},
                           **{t: i + SHIFT for t, i in d["model"]["vocab"].items()}}
    for added in d["added_tokens"]:
        added["id"] += SHIFT
    return Tokenizer.from_str(json.dumps(d))


def test_stream_dtype_by_vocabulary():
    assert stream_dtype(8192) == torch.int16 and stream_dtype(32768) == torch.int16
    assert stream_dtype(32769) == torch.int32 and stream_dtype(49152) == torch.int32


def test_stream_keeps_ids_above_int16():
    tok = big_vocab_tokenizer()
    stream = encode_stream(tok, ["def add(a, b):\n", "return a"])
    assert stream.dtype == torch.int32
    ids = [tok.token_to_id("<|endoftext|>"), *tok.encode("def add(a, b):\n").ids,
           tok.token_to_id("<|endoftext|>"), *tok.encode("return a").ids]
    assert stream.tolist() == ids and min(ids) >= SHIFT


def big_vocab_setup(tmp_path, monkeypatch, train_text: str, held_text: str):
    """A tiny target on `big_vocab_tokenizer` and a two-file corpus (one training, one held-out
    file) that `corpus.split()` returns: (tokenizer, target directory)."""
    tok = big_vocab_tokenizer()
    target = make_model_dir(tmp_path / "target", tokenizer=tok, layers=1, hidden=32, heads=2, kv_heads=1, inter=64,
                            eos_token_id=tok.token_to_id("<|endoftext|>"))
    root = tmp_path / "corpus"
    (root / "json").mkdir(parents=True)
    (root / "lib.py").write_text(train_text)
    (root / "json" / "held.py").write_text(held_text)
    real_split = corpus.split
    monkeypatch.setattr(corpus, "split", lambda *a: real_split(root))
    return tok, target


def test_train_draft_on_a_vocabulary_above_32767(tmp_path, monkeypatch):
    tok, target = big_vocab_setup(tmp_path, monkeypatch, "".join(CORPUS), "".join(CORPUS[:40]))
    summary = distill.train_draft(tmp_path / "draft", target, tokens=3 * 2 * 16, ckpt_dir=tmp_path / "ckpt",
                                  overrides=dict(shape="tiny", batch_size=2, seq_len=16, warmup_steps=1))
    assert summary["corpus"]["train_tokens"] > 100
    draft = load_model(tmp_path / "draft", load_tokenizer=False, fuse=False)
    assert draft.config.vocab_size == tok.get_vocab_size() > 32767
