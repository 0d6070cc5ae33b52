"""A feature drafter's drafting head over the target's most frequent tokens (`--method eagle3 / dspark
--draft-vocab N`).

The drafter shares the target's LM head, so every drafting step computes logits over the target's
whole vocabulary, a large part of a step's time. With `--draft-vocab N` the drafter keeps its own
copy of the N most frequent tokens' rows of that head (ranked as draft_vocab.py ranks a draft
model's, with the target's tokenizer; special tokens and EOS always kept) as a `PrunedHead`: each
step computes N logits, and every other token's logit is `FLOOR`. The row stays a
full-vocabulary distribution (q gives the others no mass), so the rejection sampler stays exact and
greedy output stays the target's; only what the drafter proposes changes.

The kept rows are the target head's own values: its float rows (the weight, the kept `head_rows`,
or read back from dw_gemm's packing [ceil(V/16), N, 16]) packed again for dw_gemm, or an int8 /
int4 head's kept blocks (draft_vocab.py's `kept_rows`). The kernel path (model/eagle3_native.py) runs
them as the head of its `dw_io` with their token ids (`head_ids`), the PyTorch path through
`PrunedHead`.

A drafter trained over N tokens (`draftwise train eagle3 --draft-vocab N`) carries their ids in its
weights (`draft_vocab_ids`) and drafts over them unless `--draft-vocab` says otherwise.
"""
from __future__ import annotations

import torch

from .draft_vocab import PrunedHead, kept_rows, kept_tokens, token_ranking
from .packed_weights import PackedLinear


def float_rows(target, kept: torch.Tensor) -> torch.Tensor | None:
    """The target head's float rows of the `kept` tokens [n, H], or None (a quantized head)."""
    head = target.lm_head
    w = getattr(head, "weight", None)
    if w is None:
        w = getattr(target, "head_rows", None)
    if w is not None:
        return w.detach()[kept].contiguous()
    native = getattr(head, "native", None)
    if isinstance(head, PackedLinear) and native is not None:  # dw_gemm's layout: token t at [t // 16, :, t % 16]
        return native[kept // 16, :, kept % 16].contiguous()
    return None


def kept_head(target, kept: torch.Tensor) -> PrunedHead:
    """A `PrunedHead` over the `kept` rows of `target`'s LM head (a prepared LlamaModel)."""
    vocab = target.cfg.vocab_size
    w = float_rows(target, kept)
    if w is None:
        inner = kept_rows(target.lm_head, kept, None)  # int8 / int4: the kept blocks
    else:
        inner = PackedLinear([w], native=True)  # dw_gemm's packing whatever the size: the kernels' head takes it
    return PrunedHead(inner, kept, vocab)


def frequent_tokens(target, n: int) -> torch.Tensor:
    """The sorted ids of the target's N most frequent tokens (target: a `LoadedModel`, its tokenizer
    ranks them; special tokens and EOS always kept)."""
    vocab = target.config.vocab_size
    if n > vocab:
        raise ValueError(f"--draft-vocab {n}: the target's vocabulary has {vocab} tokens")
    if target.tokenizer is None:
        raise ValueError("--draft-vocab: ranking the target's tokens needs its tokenizer.json")
    always = list(target.tokenizer.get_added_tokens_decoder()) + list(target.eos_token_ids)
    return kept_tokens(token_ranking(target.tokenizer), n, vocab, always)


def prune_feature_head(drafter, target, n: int | None) -> None:
    """`--draft-vocab N` for a feature drafter (EAGLE-3, DSpark: both `set_head`): its drafting head
    over the target's N most frequent tokens. N None: over the tokens it was trained to draft over
    (an EAGLE-3 drafter's `draft_vocab_ids`), if any. N equal to the vocabulary keeps the whole head."""
    vocab = target.config.vocab_size
    if n is not None:
        kept = frequent_tokens(target, n)
    elif getattr(drafter, "draft_vocab_ids", None) is not None:
        kept = drafter.draft_vocab_ids.cpu()
        if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= vocab):
            raise ValueError(f"draft_vocab_ids: token ids outside the target's vocabulary of {vocab}")
    else:
        return
    if len(kept) < vocab:
        drafter.set_head(kept_head(target.model, kept))
