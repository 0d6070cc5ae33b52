"""The map between a draft's vocabulary and the target's when their tokenizers differ.

Drafting across vocabularies (proposers/cross_vocab.py) needs two things from the tokenizers:

- the **intersection**: the tokens whose surface is the same in both vocabularies, matched by
  their decoded bytes (both tokenizers byte-level BPE, GPT-2's byte alphabet); special tokens
  match special tokens by their content only, never a normal token of the same text. The draft
  proposes only intersection tokens, so its q can be mapped onto target ids
  (`shared_target` <-> `shared_draft`), zero elsewhere: a proper distribution over the target's
  vocabulary, and the rejection sampler stays exact.
- the **translation** of a committed target token into draft tokens (`draft_tokens`): an
  intersection token is its draft id; any other is re-encoded from its bytes with the draft's
  tokenizer (its special-token content as text). Token by token, so that a context translated
  so far can be cut back at any target token (proposers/cross_vocab.py keeps the cumulative
  lengths).
- the **re-tokenization** of draft tokens into target tokens (`target_tokens`): their text encoded
  by the target's tokenizer, the way a greedy row's proposals are made from the draft's own
  greedy tokens (any proposals keep a greedy row exact: the target decides every token).

Ids at or past a model's vocabulary size (a tokenizer larger than its model) take no part.
"""
from __future__ import annotations

import json
from functools import lru_cache

import torch


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte in a
    byte-level BPE vocabulary, mapped back to the byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:  # bytes without a printable stand-in take code points from 256 on, in order
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _is_byte_level(tokenizer) -> bool:
    """Does the tokenizer decode with GPT-2's byte-level decoder (alone or in a sequence)?"""
    # (the decoder's own JSON, as pickling serialises it: not the whole tokenizer's)
    dec = json.loads(tokenizer.decoder.__getstate__()) if tokenizer.decoder is not None else {}
    kinds = [dec.get("type")] + [d.get("type") for d in dec.get("decoders", []) or []]
    return "ByteLevel" in kinds


def token_surfaces(tokenizer, vocab_size: int, name: str) -> dict[int, tuple[bool, bytes]]:
    """Each id's (special?, bytes) below `vocab_size`: a normal token's bytes through the byte
    alphabet, an added token's its content's UTF-8. ValueError naming `name` where the tokenizer
    is not byte-level BPE."""
    if not _is_byte_level(tokenizer):
        raise ValueError(f"drafting across vocabularies needs byte-level BPE tokenizers (GPT-2's byte alphabet); "
                         f"the {name}'s tokenizer.json has another decoder")
    alphabet = byte_alphabet()
    added = tokenizer.get_added_tokens_decoder()  # {id: AddedToken}
    out: dict[int, tuple[bool, bytes]] = {}
    for tok, i in tokenizer.get_vocab(with_added_tokens=False).items():
        if i < vocab_size and i not in added and all(c in alphabet for c in tok):
            out[i] = (False, bytes(alphabet[c] for c in tok))
    for i, tok in added.items():
        if i < vocab_size:
            out[i] = (bool(tok.special), tok.content.encode("utf-8"))
    return out


class VocabMap:
    """The intersection of two vocabularies and the translation of target tokens to draft tokens."""

    def __init__(self, target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int):
        self.target_vocab, self.draft_vocab = target_vocab, draft_vocab
        self._draft_tokenizer, self._target_tokenizer = draft_tokenizer, target_tokenizer
        self._target = token_surfaces(target_tokenizer, target_vocab, "target")
        draft = token_surfaces(draft_tokenizer, draft_vocab, "draft")
        by_surface: dict[tuple[bool, bytes], int] = {}
        for i in sorted(draft):  # a surface spelled by several draft ids: the lowest
            by_surface.setdefault(draft[i], i)
        self._draft_bytes = {i: s[1] for i, s in draft.items() if not s[0]}
        self._t2d: dict[int, int] = {}
        used: set[int] = set()
        for t in sorted(self._target):  # a surface spelled by several target ids: the lowest
            d = by_surface.get(self._target[t])
            if d is not None and d not in used:
                self._t2d[t] = d
                used.add(d)
        # a draft special token's target id (matched by content), where the target has it
        self._special_d2t = {d: t for t, d in self._t2d.items() if self._target[t][0]}
        self.shared_target = torch.tensor(sorted(self._t2d), dtype=torch.long)  # [S] target ids
        self.shared_draft = torch.tensor([self._t2d[t] for t in sorted(self._t2d)], dtype=torch.long)  # [S]
        self._encoded: dict[int, list[int]] = {}

    @property
    def size(self) -> int:
        """Tokens in the intersection."""
        return len(self._t2d)

    def draft_id(self, target_id: int) -> int | None:
        """The draft id of an intersection token; None for any other."""
        return self._t2d.get(target_id)

    def byte_length(self, token_id: int, draft: bool) -> int:
        """How many bytes a draft (`draft`) or target token spells (a special token's content)."""
        if draft:
            b = self._draft_bytes.get(token_id)
            return len(b) if b is not None else len(self._target.get(self._special_d2t.get(token_id, -1), (0, b""))[1])
        return len(self._target.get(token_id, (False, b""))[1])

    def draft_tokens(self, target_id: int) -> list[int]:
        """The draft tokens that spell target token `target_id`: its draft id when shared, else its
        bytes re-encoded with the draft's tokenizer (empty where it has no surface: an id past the
        tokenizer, or bytes the draft's tokenizer cannot spell)."""
        d = self._t2d.get(target_id)
        if d is not None:
            return [d]
        got = self._encoded.get(target_id)
        if got is None:
            surface = self._target.get(target_id)
            got = self._encode(surface[1]) if surface is not None else []
            self._encoded[target_id] = got
        return got

    def _encode(self, data: bytes) -> list[int]:
        """`data` in draft tokens: the draft tokenizer's own encoding where it spells `data` back
        exactly (valid UTF-8), else its BPE model over the byte-alphabet string (a token that
        ends inside a UTF-8 character), else nothing."""
        tok = self._draft_tokenizer
        try:
            ids = [i for i in tok.encode(data.decode("utf-8"), add_special_tokens=False).ids if i < self.draft_vocab]
            if b"".join(self._draft_bytes.get(i, b"\0\0") for i in ids) == data:
                return ids
        except UnicodeDecodeError:
            pass
        chars = {b: c for c, b in byte_alphabet().items()}
        try:
            ids = [t.id for t in tok.model.tokenize("".join(chars[b] for b in data)) if t.id < self.draft_vocab]
        except Exception:  # tokenizers raises a bare Exception for what its model cannot spell
            return []
        return ids if b"".join(self._draft_bytes.get(i, b"\0\0") for i in ids) == data else []

    def target_tokens(self, draft_ids: list[int]) -> list[int]:
        """The target tokens that spell draft tokens `draft_ids`: their bytes as text encoded by the
        target's tokenizer, up to the first special token (its target id, where the target has it;
        nothing after it) or the first id without a surface. Trailing bytes that end inside a UTF-8
        character are left out, and so is everything from the first invalid byte."""
        data, tail = bytearray(), []
        for d in draft_ids:
            b = self._draft_bytes.get(d)
            if b is None:
                t = self._special_d2t.get(d)
                tail = [t] if t is not None else []
                break
            data += b
        text = _valid_prefix(bytes(data))
        ids = self._target_tokenizer.encode(text, add_special_tokens=False).ids if text else []
        whole = len(text.encode("utf-8")) == len(data)  # (a special token after cut bytes: left out)
        return [i for i in ids if i < self.target_vocab] + (tail if whole else [])

    def translate(self, target_ids: list[int]) -> tuple[list[int], list[int]]:
        """(draft ids, cumulative draft length after each target token) of a target sequence."""
        ids, ends = [], []
        for t in target_ids:
            ids.extend(self.draft_tokens(t))
            ends.append(len(ids))
        return ids, ends


def _valid_prefix(data: bytes) -> str:
    """The longest prefix of `data` that is valid UTF-8, decoded."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        return data[: e.start].decode("utf-8")
