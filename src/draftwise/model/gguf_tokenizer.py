"""A GGUF file's tokenizer metadata -> a `tokenizers.Tokenizer` and `tokenizer_config.json`.

A GGUF carries no `tokenizer.json`: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`, in
id order), the token types (1 normal, 3 control, 4 user-defined, 6 byte), the BPE merges, the
special token ids and the name of the pre-tokenizer (`tokenizer.ggml.pre`). Two models:

- `gpt2`: byte-level BPE (Llama 3, Qwen2/3, SmolLM, GPT-2 style vocabularies). The text is split
  by the pre-tokenizer's regular expressions (llama.cpp's table in `llama-vocab.cpp`, here in the
  form of the original `tokenizer.json` patterns), then mapped to the byte alphabet.
- `llama`: SentencePiece BPE (Llama 2, Mistral v0.1): `▁` for spaces, byte fallback (`<0x0A>`),
  merges rebuilt from the token scores when the file has none.

Control tokens become special added tokens (matched whole, skipped when decoding), user-defined
tokens plain added tokens. BOS/EOS are added by the post-processor only when the file says
`add_bos_token` / `add_eos_token` (as llama.cpp does).
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

CONTROL, USER_DEFINED = 3, 4

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's fallback for an unrecognised pre-tokenizer: four splits applied in turn
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]

# tokenizer.ggml.pre -> (regular expressions applied in turn, ignore_merges)
PRE_TOKENIZERS: dict[str, tuple[list[str], bool]] = {}
for _names, _split in [
    (("gpt2", "gpt-2", "mpt", "olmo", "jais", "phi-2", "roberta-bpe", "trillion"), ([_GPT2], False)),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), ([r"\p{N}", _GPT2], False)),
    (("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral"), ([_LLAMA3], True)),
    (("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"), ([_QWEN2], False)),
    (("tekken",), ([_TEKKEN], False)),
    (("gpt-4o", "llama4"), ([_GPT4O], False)),
    (("default",), (_DEFAULT, False)),
]:
    for _name in _names:
        PRE_TOKENIZERS[_name] = _split


class TokenizerImportError(ValueError):
    """The file's tokenizer cannot be rebuilt; the message names the field."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the byte-level alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece files list no merges: every split of a token into two vocabulary pieces is a
    merge, ranked by the merged token's score (higher first), as transformers rebuilds them."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for tok, score in zip(tokens, scores):
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                found.append((-score, vocab[left], vocab[right], left, right))
    found.sort()
    return [(f[3], f[4]) for f in found]


def _byte_level(meta: dict) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise TokenizerImportError(
            f"tokenizer.ggml.pre: pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    splits, ignore_merges = PRE_TOKENIZERS[pre]
    alphabet = _bytes_to_unicode()
    letters = set(alphabet.values())
    tokens = [t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))
              for t in meta["tokenizer.ggml.tokens"]]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    if not merges:
        raise TokenizerImportError("tokenizer.ggml.merges: a byte-level BPE vocabulary needs its merges")
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=ignore_merges))
    steps = [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: dict) -> Tokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    if not merges:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise TokenizerImportError("tokenizer.ggml.scores: needed to rebuild the merges of a SentencePiece vocabulary")
        merges = merges_from_scores(tokens, scores)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token=unk, byte_fallback=True,
                               fuse_unk=True))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def special_token(meta: dict, key: str) -> str | None:
    i = meta.get(f"tokenizer.ggml.{key}_token_id")
    tokens = meta["tokenizer.ggml.tokens"]
    return tokens[i] if i is not None and 0 <= i < len(tokens) else None


def build_tokenizer(meta: dict) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise TokenizerImportError("tokenizer.ggml.tokens: the file has no vocabulary")
    if kind == "gpt2":
        tok = _byte_level(meta)
        add_bos_default = False
    elif kind == "llama":
        tok = _sentencepiece(meta)
        add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary unless told otherwise
    else:
        raise TokenizerImportError(f"tokenizer.ggml.model: {kind!r} is not supported (supported: gpt2, llama)")
    types = meta.get("tokenizer.ggml.token_type") or []
    tokens = meta["tokenizer.ggml.tokens"]
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    if kind == "gpt2":  # a control token outside the byte alphabet is a mislabel llama.cpp tolerates
        letters = set(_bytes_to_unicode().values())
        control = [t for t in control if set(t.content) <= letters]
    tok.add_special_tokens(control)
    tok.add_tokens(user)

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = special_token(meta, "bos"), special_token(meta, "eos")
    single, specials = "$A:0", []
    if add_bos and bos is not None:
        single = f"{bos}:0 " + single
        specials.append((bos, meta["tokenizer.ggml.bos_token_id"]))
    if add_eos and eos is not None:
        single += f" {eos}:0"
        specials.append((eos, meta["tokenizer.ggml.eos_token_id"]))
    if specials:
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    return tok


def tokenizer_config(meta: dict, max_len: int) -> dict:
    """`tokenizer_config.json`: special tokens, BOS/EOS flags, the chat template."""
    kind = meta.get("tokenizer.ggml.model")
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    for name, key in [("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")]:
        tok = special_token(meta, key)
        if tok is not None:
            cfg[name] = tok
    if meta.get("tokenizer.chat_template"):
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    return cfg
