"""Does a draft's tokenizer agree with the target's? The count of token ids mapped to different strings.

Speculation compares token ids, so a draft whose ids mean other strings than the target's (of the
same vocabulary size) would propose tokens the target rarely accepts; where this count is not 0
the draft drafts across vocabularies instead (proposers/cross_vocab.py, over the tokens both
share), as it does for a draft whose vocabulary size differs.
"""
from __future__ import annotations


def _id_to_token(tokenizer) -> dict[int, str]:
    return {i: t for t, i in tokenizer.get_vocab(with_added_tokens=True).items()}


def count_differing_tokens(target_tokenizer, draft_tokenizer) -> tuple[int, int]:
    """(ids mapped to different strings or present in only one, ids compared) of two `tokenizers.Tokenizer`s."""
    a, b = _id_to_token(target_tokenizer), _id_to_token(draft_tokenizer)
    ids = a.keys() | b.keys()
    return sum(1 for i in ids if a.get(i) != b.get(i)), len(ids)
