"""What a feature drafter (EAGLE-3, DSpark) trains on, shared by both trainers: the token streams
(the corpus's windows, or `--data self`: the target's own replies to chat prompts, self_data.py)
and the drafting head over the target's kept tokens (`--draft-vocab N`: those rows of the target's
LM head, frozen, in float32 whatever the target's dtype)."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..model.eagle3_vocab import float_rows, frequent_tokens
from . import self_data
from .data import load_streams

DATA_KINDS = ("corpus", "self")


class KeptRowsHead(torch.nn.Module):
    """Training's head over the kept tokens: [..., H] -> [..., N] float32 logits, the target head's
    kept rows (frozen); at evaluation a `PrunedHead` spreads them over the whole vocabulary."""

    def __init__(self, rows: torch.Tensor):
        super().__init__()
        self.register_buffer("rows", rows.detach().float().contiguous())
        self.out_features, self.in_features = self.rows.shape

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.rows)


def kept_tokens(loaded, draft_vocab: int | None) -> torch.Tensor | None:
    """`--draft-vocab N`: the sorted ids of the target's N most frequent tokens; None for the whole
    vocabulary (no N, or N covering it)."""
    if draft_vocab is None:
        return None
    kept = frequent_tokens(loaded, draft_vocab)
    return None if len(kept) >= loaded.config.vocab_size else kept


def kept_rows_head(target, kept: torch.Tensor) -> KeptRowsHead:
    """The training head over the `kept` tokens (all of them: torch.arange(V)) of `target`'s LM head."""
    rows = float_rows(target, kept)
    if rows is None:
        raise ValueError("--draft-vocab: the target's LM head has no float rows to train over")
    return KeptRowsHead(rows)


def training_streams(loaded, target_dir: Path, ckpt_dir: Path, split, data: str, data_dir: Path | None,
                     gen: dict, log) -> dict[str, torch.Tensor]:
    """{"train", "val"} token streams: the corpus split's (tokenized once, cached in `ckpt_dir`), or
    the self-generated replies in `data_dir` (generated first up to gen["tokens"] where asked;
    resumable)."""
    if data not in DATA_KINDS:
        raise ValueError(f"data: corpus or self, got {data!r}")
    if data == "corpus":
        return load_streams(loaded.tokenizer, split, ckpt_dir)
    if gen.get("tokens"):
        self_data.generate(gen.get("model") or target_dir, data_dir, gen["tokens"],
                           max_tokens=gen.get("max_tokens", 192), minutes=gen.get("minutes"), log=log or print)
    return self_data.load_streams(data_dir, loaded.config.eos_token_id[0])
