"""Does a draft's tokenizer agree with the target's? The count of token ids mapped to different strings.

Speculation compares token ids, so a draft whose ids mean other strings than the target's stays
exact (the target decides every token) but proposes tokens the target rarely accepts. The
engine already refuses a draft whose vocabulary *size* differs; this finds the rest: ids that
both tokenizers have but spell differently, or that only one of them has (added tokens).
"""
from __future__ import annotations

from pathlib import Path


def _id_to_token(tokenizer) -> dict[int, str]:
    return {i: t for t, i in tokenizer.get_vocab(with_added_tokens=True).items()}


def count_differing_tokens(target_tokenizer, draft_tokenizer) -> tuple[int, int]:
    """(ids mapped to different strings or present in only one, ids compared) of two `tokenizers.Tokenizer`s."""
    a, b = _id_to_token(target_tokenizer), _id_to_token(draft_tokenizer)
    ids = a.keys() | b.keys()
    return sum(1 for i in ids if a.get(i) != b.get(i)), len(ids)


def tokenizer_mismatch(target_dir: str | Path, draft_dir: str | Path) -> tuple[int, int] | None:
    """`count_differing_tokens` of two model directories' tokenizer.json; None when either has none
    (or it cannot be read: loading the model reports that)."""
    from tokenizers import Tokenizer

    files = [Path(target_dir) / "tokenizer.json", Path(draft_dir) / "tokenizer.json"]
    if not all(f.is_file() for f in files):
        return None
    try:
        target, draft = (Tokenizer.from_file(str(f)) for f in files)
    except Exception:  # tokenizers raises a bare Exception; load_model names the file
        return None
    return count_differing_tokens(target, draft)
