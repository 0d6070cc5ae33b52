"""Incremental detokenization and stop-string detection.

Byte-level BPE tokens may split a UTF-8 character; text is only emitted once the decoded window
no longer ends in U+FFFD. A stop string may span token boundaries or sit in the middle of an
accepted block: the engine appends committed tokens one at a time and checks after each, so no
token after the stop is ever committed; the stop string itself is cut from the text (OpenAI).
"""
from __future__ import annotations

from .sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def step(self, seq: Sequence) -> str:
        """Advance `seq.text` by the newly appended tokens; returns the new text."""
        if self.tokenizer is None:
            return ""
        ids = seq.output_ids
        prefix = self.decode(ids[seq.prefix_offset : seq.read_offset])
        full = self.decode(ids[seq.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            seq.text += new
            seq.prefix_offset = seq.read_offset
            seq.read_offset = len(ids)
            return new
        return ""

    def flush(self, seq: Sequence) -> None:
        """At the end, emit whatever is left (even an incomplete character)."""
        if self.tokenizer is not None and seq.read_offset < len(seq.output_ids):
            prefix = self.decode(seq.output_ids[seq.prefix_offset : seq.read_offset])
            full = self.decode(seq.output_ids[seq.prefix_offset :])
            seq.text += full[len(prefix) :]
            seq.read_offset = len(seq.output_ids)


def find_stop(text: str, new_len: int, stops: list[str]) -> int:
    """Index of the earliest stop string that ends in the last `new_len` chars, or -1."""
    best = -1
    for s in stops:
        start = max(0, len(text) - new_len - len(s) + 1)
        i = text.find(s, start)
        if i != -1 and (best == -1 or i < best):
            best = i
    return best
