"""Tiny random GGUF files written with `gguf.GGUFWriter`, as llama.cpp's converter writes them.

`write_gguf(path, arch, qtype)` makes a 2-layer model (hidden 64, 4 query heads, 2 K/V heads,
head_dim 16) with a byte-level BPE vocabulary of ~300 tokens trained here on a few sentences,
special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` and a ChatML template. The weights
are drawn in Hugging Face layout, then stored as llama.cpp stores them: Q/K rows permuted for the
llama and mistral families (not qwen2/qwen3), 2-D weights quantised to `qtype`, norms and
biases in F32.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT = (
    "The quick brown fox jumps over the lazy dog. def parse_args(argv):\n    return argv[1:]\n"
    "Speculative decoding: a draft proposes, the target verifies. Hello, world! 12345 tokens. "
    "import os, sys\nfor i in range(10):\n    print(i * 2)\n"
) * 4
PRE = {"llama": "llama-bpe", "mistral": "gpt2", "qwen2": "qwen2", "qwen3": "qwen2"}


def tiny_vocab(vocab_size: int = 320) -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary (tokens in id order, specials first) and its merges."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def hf_weights(arch: str, vocab: int, seed: int = 0, hidden: int = 64, inter: int = 128, layers: int = 2,
               heads: int = 4, kv_heads: int = 2, tie: bool = False) -> dict[str, np.ndarray]:
    """Random weights in Hugging Face names and layout ([out, in])."""
    rng = np.random.default_rng(seed)
    hd = hidden // heads

    def w(*shape, scale=0.08):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    sd = {"model.embed_tokens.weight": w(vocab, hidden, scale=0.5), "model.norm.weight": 1 + w(hidden)}
    if not tie:
        sd["lm_head.weight"] = w(vocab, hidden, scale=0.3)
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = 1 + w(hidden)
        sd[p + "post_attention_layernorm.weight"] = 1 + w(hidden)
        sd[p + "self_attn.q_proj.weight"] = w(heads * hd, hidden)
        sd[p + "self_attn.k_proj.weight"] = w(kv_heads * hd, hidden)
        sd[p + "self_attn.v_proj.weight"] = w(kv_heads * hd, hidden)
        sd[p + "self_attn.o_proj.weight"] = w(hidden, heads * hd)
        sd[p + "mlp.gate_proj.weight"] = w(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = w(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = w(hidden, inter)
        if arch == "qwen2":
            sd[p + "self_attn.q_proj.bias"] = w(heads * hd, scale=0.2)
            sd[p + "self_attn.k_proj.bias"] = w(kv_heads * hd, scale=0.2)
            sd[p + "self_attn.v_proj.bias"] = w(kv_heads * hd, scale=0.2)
        if arch == "qwen3":
            sd[p + "self_attn.q_norm.weight"] = 1 + w(hd)
            sd[p + "self_attn.k_norm.weight"] = 1 + w(hd)
    return sd


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute` (rotate-half pairs -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = [
    ("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
]
LAYER_NAMES = [
    ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
    ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"), ("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm"),
    ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down"),
]


def gguf_name(hf: str) -> str:
    for a, b in GGUF_NAMES:
        if hf == a:
            return b
    parts = hf.split(".")
    layer, rest, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    return f"blk.{layer}.{dict(LAYER_NAMES)[rest]}.{kind}"


def write_gguf(path: str | Path, arch: str = "llama", qtype: str = "F32", seed: int = 0, tie: bool = False,
               chat_template: str | None = CHATML, pre: str | None = None, extra: dict | None = None,
               **dims) -> dict[str, np.ndarray]:
    """Write the file; returns the Hugging Face weights it was made from (before quantisation)."""
    import gguf

    tokens, merges = tiny_vocab()
    sd = hf_weights(arch, len(tokens), seed=seed, tie=tie, **dims)
    hidden = sd["model.embed_tokens.weight"].shape[1]
    heads, kv_heads = dims.get("heads", 4), dims.get("kv_heads", 2)
    layers = dims.get("layers", 2)
    inter = sd["model.layers.0.mlp.gate_proj.weight"].shape[0]
    qt = gguf.GGMLQuantizationType[qtype]

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0 if arch != "qwen3" else 1000000.0)
    w.add_layer_norm_rms_eps(1e-6 if arch.startswith("qwen") else 1e-5)
    if arch in ("llama", "mistral"):
        w.add_rope_dimension_count(hidden // heads)
        w.add_vocab_size(len(tokens))
    if arch == "qwen3":
        w.add_key_length(hidden // heads)
        w.add_value_length(hidden // heads)
    w.add_file_type(int(qt) if qt != gguf.GGMLQuantizationType.F32 else 0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre or PRE[arch])
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
    for name, t in sd.items():
        if arch in ("llama", "mistral") and name.endswith("q_proj.weight"):
            t = _permute(t, heads)
        elif arch in ("llama", "mistral") and name.endswith("k_proj.weight"):
            t = _permute(t, kv_heads)
        if t.ndim == 2 and qt != gguf.GGMLQuantizationType.F32:
            data = quantize_q4k(t) if qt == gguf.GGMLQuantizationType.Q4_K else gguf.quants.quantize(t, qt)
            w.add_tensor(gguf_name(name), data, raw_dtype=qt)
        else:
            w.add_tensor(gguf_name(name), t)
    for name, t in (extra or {}).items():  # e.g. rope_freqs.weight
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd


def quantize_q4k(w: np.ndarray) -> np.ndarray:
    """float32 [O, N] (N a multiple of 256) -> Q4_K blocks [O, N/256 * 144] uint8, as llama.cpp lays
    them out (d, dmin float16; 12 bytes of 6-bit sub-block scales and minima; 128 bytes of nibbles,
    32-byte chunk c holding sub-block 2c low and 2c + 1 high), without its importance search: per
    sub-block of 32, step (max - min) / 15 and minimum -min (min clipped to <= 0), both quantised to
    6 bits against the super-block's largest. (The gguf package dequantises Q4_K but cannot quantise it.)"""
    o, n = w.shape
    x = w.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(x.min(-1), 0)
    scale, m = (x.max(-1) - lo) / 15, -lo  # [B, 8]
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (m.max(-1, keepdims=True) / 63).astype(np.float16)
    df, dmf = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(df > 0, df, 1)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(m / np.where(dmf > 0, dmf, 1)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.clip(np.rint((x + (dmf * mn)[..., None]) / np.where(step > 0, step, 1)), 0, 15).astype(np.uint8)
    scales = np.zeros((len(x), 12), dtype=np.uint8)
    scales[:, 0:4], scales[:, 4:8] = sc[:, :4], mn[:, :4]
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    scales[:, 0:4] |= (sc[:, 4:] >> 4) << 6
    scales[:, 4:8] |= (mn[:, 4:] >> 4) << 6
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    raw = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), scales, qs], axis=1)
    return raw.reshape(o, -1)


def write_spm_gguf(path: str | Path) -> None:
    """A 1-layer llama file with a SentencePiece vocabulary (`tokenizer.ggml.model = llama`): byte
    tokens `<0x00>`..`<0xFF>`, scores and no merges, as Llama 2 / Mistral v0.1 files have."""
    import gguf

    words = sorted({"▁" + w for w in TEXT.lower().split()})
    subs = sorted({w[i:j] for w in words for i in range(len(w)) for j in range(i + 2, min(len(w), i + 5) + 1)})[:200]
    chars = sorted(set("".join(words)))
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + chars + subs
    scores = [0.0] * 259 + [-1.0 - 0.01 * i for i in range(len(chars))] + [-0.5 * (10 - len(s)) - 0.001 * i
                                                                           for i, s in enumerate(subs)]
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in [(w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, 32),
                   (w.add_feed_forward_length, 64), (w.add_head_count, 2), (w.add_head_count_kv, 1),
                   (w.add_rope_dimension_count, 16), (w.add_layer_norm_rms_eps, 1e-5)]:
        add(v)
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(chars) + len(subs)))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((len(pieces), 32)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(32, np.float32))
    for n, shape in [("attn_norm", (32,)), ("ffn_norm", (32,)), ("attn_q", (32, 32)), ("attn_k", (16, 32)),
                     ("attn_v", (16, 32)), ("attn_output", (32, 32)), ("ffn_gate", (64, 32)), ("ffn_up", (64, 32)),
                     ("ffn_down", (32, 64))]:
        w.add_tensor(f"blk.0.{n}.weight", rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
