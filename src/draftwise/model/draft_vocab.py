"""A draft head over the most frequent tokens only (`--draft-vocab N`).

A draft step of a large-vocabulary model pays much of its time in the LM head: Qwen2.5-Coder-0.5B's
151,936 x 896 head is a quarter of the weights it reads per token. The tokens a draft proposes and
the target accepts are mostly frequent ones (counted over the training corpus with the Qwen
tokenizer, the 32,768 most frequent tokens cover 99% of held-out code), so the draft's head keeps
the rows of the N most frequent tokens (and every special token) and computes N logits (FR-Spec's
frequency-ranked draft vocabulary).

Exactness is untouched: the head's output is still a full-vocabulary row. The other tokens get the
logit `FLOOR`, so q gives them no mass while any kept token is allowed, and the rejection sampler
(which needs only that q is a distribution that depends on the accepted history) is exact for any
q. Where a grammar or `min_tokens` masks every kept token, the floor keeps the row a distribution
(uniform over the allowed others) instead of an all -inf row. Only the target decides what is
committed; the pruned tokens are proposed never (or, under such a mask, at random), not lost.

The ranking is counted once per tokenizer over the training split of the corpus (corpus.py, up to
`COUNT_CHARS` characters) and cached under `~/.cache/draftwise/draft-vocab/` by the hash of the
tokenizer's vocabulary; ties and tokens never seen keep their id order.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from .. import corpus
from .quantize import Int4Linear, Int8Linear

FLOOR = -1e9  # the logit of a token outside the kept set (finite: see the module's docstring)
COUNT_CHARS = 8_000_000  # the corpus characters counted for the ranking
MIN_TOKENS = 64


def _cache_dir() -> Path:
    return Path(os.environ.get("DRAFTWISE_CACHE", "~/.cache/draftwise")).expanduser() / "draft-vocab"


def token_ranking(tokenizer) -> list[int]:
    """Token ids by frequency over the corpus's training files, most frequent first (ids never
    seen are not listed). Cached by the vocabulary's hash."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    key = hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()[:20]
    path = _cache_dir() / f"{key}.json"
    if path.is_file():
        try:
            return [int(i) for i in json.loads(path.read_text())]
        except (ValueError, OSError):
            pass  # a damaged cache file: counted again
    counts: dict[int, int] = {}
    seen = 0
    split = corpus.split()
    for f in split.train:
        try:
            text = (split.root / f).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for i in tokenizer.encode(text, add_special_tokens=False).ids:
            counts[i] = counts.get(i, 0) + 1
        seen += len(text)
        if seen >= COUNT_CHARS:
            break
    ranking = sorted(counts, key=lambda i: (-counts[i], i))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(ranking))
    tmp.replace(path)
    return ranking


def kept_tokens(ranking: list[int], n: int, vocab_size: int, always: list[int]) -> torch.Tensor:
    """The sorted ids a pruned head keeps: `always` (special tokens, EOS) and the most frequent
    ones up to `n` in all, then the lowest ids never ranked."""
    if n < MIN_TOKENS:
        raise ValueError(f"--draft-vocab {n}: keep at least {MIN_TOKENS} tokens")
    keep = dict.fromkeys(i for i in always if 0 <= i < vocab_size)
    for i in ranking:
        if len(keep) >= n:
            break
        if 0 <= i < vocab_size:
            keep.setdefault(i)
    i = 0
    while len(keep) < min(n, vocab_size):
        keep.setdefault(i)
        i += 1
    return torch.tensor(sorted(keep), dtype=torch.long)


def kept_rows(head: nn.Module, kept: torch.Tensor, head_rows: torch.Tensor | None) -> nn.Module:
    """A head module over the `kept` rows of `head`: the same values, fewer outputs."""
    if isinstance(head, Int8Linear) and head.group:
        blocks = [(head.qweight[kept].contiguous(), head.group_scales()[kept].contiguous())]
        return Int8Linear([], blocks=blocks, float_out=True)
    if isinstance(head, Int8Linear):
        return Int8Linear([head.dequantized()[kept]], float_out=True)
    if isinstance(head, Int4Linear):
        q, sm = head.blocks()
        return Int4Linear([], blocks=[(q[kept].contiguous(), sm[kept].contiguous())])
    w = getattr(head, "weight", None)
    if w is None:
        w = head_rows
    if w is None or getattr(head, "bias", None) is not None:
        raise ValueError("--draft-vocab: the draft's head is packed for the fused kernels and its float rows are "
                         "not kept; run the draft quantized (--draft-quantization int8) to prune its head")
    lin = nn.Linear(w.shape[1], len(kept), bias=False)
    lin.weight = nn.Parameter(w.detach()[kept].clone(), requires_grad=False)
    return lin


class PrunedHead(nn.Module):
    """The LM head over the kept tokens; a full-vocabulary row out, the others at `FLOOR`."""

    float_out = True

    def __init__(self, inner: nn.Module, kept: torch.Tensor, vocab_size: int):
        super().__init__()
        self.inner = inner
        self.register_buffer("kept", kept)
        self.vocab_size = vocab_size
        self.in_features, self.out_features = inner.in_features, vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V] float32
        part = self.inner(hidden).float()
        out = part.new_full((*part.shape[:-1], self.vocab_size), FLOOR)
        out[..., self.kept] = part
        return out

    def extra_repr(self) -> str:
        return f"{len(self.kept)} of {self.vocab_size} tokens"


def prune_head(model: nn.Module, kept: torch.Tensor) -> None:
    """Replace `model.lm_head` (a prepared model: after fuse_projections) by its kept rows."""
    head = model.lm_head
    vocab = head.out_features
    if len(kept) >= vocab:
        return
    model.lm_head = PrunedHead(kept_rows(head, kept, getattr(model, "head_rows", None)), kept, vocab)
    if getattr(model, "head_rows", None) is not None:
        model.head_rows = None  # (refine_top_logits' rows: the kept head's logits are its own)
    model._io = None  # the fused kernels' head: found again (the kept rows, where they run there)
