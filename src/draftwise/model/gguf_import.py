"""A GGUF file (llama.cpp's format) -> a Hugging Face model directory that `load_model` reads.

    import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "models/smollm2", dtype="float32")

writes `config.json` (from the `{arch}.*` metadata), `model.safetensors` (every tensor
dequantised by the `gguf` package, llama.cpp's own library), `tokenizer.json` and
`tokenizer_config.json` (see `gguf_tokenizer.py`; the chat template comes from
`tokenizer.chat_template`) and `generation_config.json` (BOS, EOS and end-of-turn ids).

Supported: the llama, mistral, qwen2 and qwen3 architectures; any tensor type the `gguf` package
dequantises (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K..Q6_K, IQ types).
llama.cpp's converter permutes the rows of Q and K for llama and mistral (it interleaves the two
halves that Hugging Face's rotate-half RoPE pairs); `unpermute` undoes it. Qwen files are stored
unpermuted. The runtime loader stays on safetensors: the import runs once.

`keep_quantized=True` (`--keep-quantized`): the decoder projections, the embeddings and the LM
head stored in any quantized type are written as blocks (gguf_blocks.py), under `<name>.qweight` /
`<name>.qscale` with `quantization_config` in config.json, never as floats: Q4_0, Q4_1 and Q4_K as
draftwise's int4 (quantize.py: groups of 32 inputs, a float16 step and minimum per group, the same
nibble order; Q4_0's x = d * (q - 8) is d * q + m with m = -8d, exact in float16; Q4_K's sub-blocks
of 32 have the same form; their integer sub-scales are written instead of `.qscale`, `<name>.qsub`
uint8 [O, N/32, 2] (sc, mn) and `<name>.qsuper` float16 [O, N/256, 2] (d, dmin): the loader derives
the groups' float16 steps and minima from them, and the VNNI kernels run them as super-blocks,
act8.py), Q8_0 and Q5_0 as int8 with a float16 scale per group of 32 (run by
`dw_gemm_q8g`; both exactly), the other types (Q6_K, Q5_K, ...) as int8 groups re-quantised from
their dequantised values, one tensor at a time. The model then runs on the file's own values, not
on values re-quantised from a float import (`load_model` dequantises them only for the float
paths: `fuse=False`, training). F32/F16/BF16 tensors are written as without the option.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from .gguf_blocks import blocks_of, int4_blocks, q4k_subscales, q8_blocks
from .gguf_tokenizer import build_tokenizer, tokenizer_config

# GGUF general.architecture -> (HF architectures[0], model_type, Q/K permuted by llama.cpp)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "mistral": ("MistralForCausalLM", "mistral", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# written as blocks with keep_quantized besides the decoder projections: a 151,936 x 1536 embedding
# is 0.9 GB in float32 (the Qwen2.5 files), more than the int4 decoder it feeds
KEPT_TOP = ("model.embed_tokens.weight", "lm_head.weight")
# metadata arrays read in full (the others, e.g. scores of a byte-level vocabulary, are skipped)
_ARRAYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores",
           "general.languages"}


class GGUFImportError(ValueError):
    """A file that cannot be imported; the message names the file and the field or tensor."""


def read_gguf(path: str | Path):
    """(GGUFReader, metadata dict) or GGUFImportError for a missing, truncated or non-GGUF file."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise GGUFImportError(f"{path}: file not found")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/struct errors on anything malformed
        raise GGUFImportError(f"{path}: not a readable GGUF file ({e})") from None
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or (field.types and field.types[0] == gguf.GGUFValueType.ARRAY and key not in _ARRAYS):
            continue
        meta[key] = field.contents()
    return reader, meta


def hf_config(meta: dict, tensor_names: set[str], vocab_rows: int, source: str) -> dict:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFImportError(
            f"{source}: general.architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    hf_arch, model_type, _ = ARCHITECTURES[arch]

    def get(key, default=None, required=True):
        full = f"{arch}.{key}"
        if full not in meta and required and default is None:
            raise GGUFImportError(f"{source}: metadata field {full!r} is missing")
        return meta.get(full, default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", required=False) or get("rope.dimension_count", required=False)
                   or hidden // heads)
    ctx = int(get("context_length", 2048))
    cfg = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab_rows,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": ctx,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "hidden_act": "silu",
    }
    scaling = get("rope.scaling.type", required=False)
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise GGUFImportError(f"{source}: {arch}.rope.scaling.type {scaling!r} is not supported (supported: linear)")
    for name, key in [("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")]:
        if f"tokenizer.ggml.{key}_token_id" in meta:
            cfg[name] = int(meta[f"tokenizer.ggml.{key}_token_id"])
    return cfg


def llama3_rope_scaling(factors: np.ndarray, cfg: dict, source: str) -> dict:
    """llama.cpp stores Llama 3.1's rope scaling as per-frequency divisors (`rope_freqs`); recover
    the `llama3` parameters, checking them against the stored divisors."""
    d, theta = cfg["head_dim"], cfg["rope_theta"]
    freqs = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    factor = float(factors.max())
    for old, lo, hi in [(8192, 1.0, 4.0), (cfg["max_position_embeddings"], 1.0, 4.0)]:
        want = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            if wavelen < old / hi:
                want.append(1.0)
            elif wavelen > old / lo:
                want.append(factor)
            else:
                smooth = (old / wavelen - lo) / (hi - lo)
                want.append(1 / ((1 - smooth) / factor + smooth))
        if np.allclose(want, factors, rtol=1e-3):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": lo, "high_freq_factor": hi,
                    "original_max_position_embeddings": int(old)}
    raise GGUFImportError(f"{source}: tensor 'rope_freqs.weight' does not match llama3 rope scaling (unsupported)")


def hf_name(name: str) -> str | None:
    """GGUF tensor name -> Hugging Face parameter name (None: not a parameter, e.g. rope_freqs)."""
    stem, _, kind = name.rpartition(".")
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{kind}"
    return None


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, rows (r0, r1) pairs -> (first half, second half)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize(t, source: str) -> np.ndarray:
    """One reader tensor -> float32 in Hugging Face layout (`[out, in]`: GGUF lists dims reversed)."""
    import gguf

    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise GGUFImportError(
            f"{source}: tensor {t.name!r} has type {t.tensor_type.name}, which the gguf package cannot dequantise"
        ) from None
    return np.array(arr, dtype=np.float32).reshape(tuple(int(n) for n in reversed(t.shape.tolist())))


def keeps(t, name: str, keep_quantized: bool) -> bool:
    """Whether this tensor is written as blocks (gguf_blocks.py): with `keep_quantized`, a quantized
    decoder projection, the input embeddings or the LM head."""
    import gguf

    floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    kept = (name.startswith("model.layers.") and name.endswith("_proj.weight")) or name in KEPT_TOP
    return keep_quantized and t.tensor_type not in floats and kept


def convert_weights(reader, cfg: dict, arch: str, dtype: torch.dtype, source: str,
                    keep_quantized: bool = False) -> dict[str, torch.Tensor]:
    import gguf

    permuted = ARCHITECTURES[arch][2]
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            cfg["rope_scaling"] = llama3_rope_scaling(dequantize(t, source), cfg, source)
            continue
        name = hf_name(t.name)
        if name is None:
            raise GGUFImportError(f"{source}: tensor {t.name!r} has no counterpart in a {cfg['architectures'][0]}")
        blocks = blocks_of(t) if keeps(t, name, keep_quantized) else None
        if blocks is not None:
            _, q, sm = blocks
            heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}.get(name.split(".")[-2])
            if permuted and heads:  # a row permutation: each output's blocks move with it
                q, sm = unpermute(q, heads), unpermute(sm, heads)
            stem = name[: -len(".weight")]
            out[f"{stem}.qweight"] = q.contiguous()
            if t.tensor_type == gguf.GGMLQuantizationType.Q4_K:  # its integer sub-scales (sm follows from them)
                sub, sup = q4k_subscales(t)
                if permuted and heads:
                    sub, sup = unpermute(sub, heads), unpermute(sup, heads)
                out[f"{stem}.qsub"], out[f"{stem}.qsuper"] = sub.contiguous(), sup.contiguous()
            else:
                out[f"{stem}.qscale"] = sm.contiguous()
            continue
        w = torch.from_numpy(dequantize(t, source))
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute(w, cfg["num_attention_heads"])
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute(w, cfg["num_key_value_heads"])
        out[name] = w.to(dtype).contiguous()
    return out


def generation_config(meta: dict) -> dict:
    """EOS ids: the file's EOS plus its end-of-turn / end-of-message tokens (llama.cpp stops on all)."""
    eos = [meta[f"tokenizer.ggml.{k}_token_id"] for k in ("eos", "eot", "eom") if f"tokenizer.ggml.{k}_token_id" in meta]
    gen = {"eos_token_id": list(dict.fromkeys(int(e) for e in eos))}
    if "tokenizer.ggml.bos_token_id" in meta:
        gen["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    if "tokenizer.ggml.padding_token_id" in meta:
        gen["pad_token_id"] = int(meta["tokenizer.ggml.padding_token_id"])
    return gen


def import_gguf(path: str | Path, out: str | Path, dtype: str = "float32", keep_quantized: bool = False) -> Path:
    """Write the Hugging Face directory `out`, built aside and then moved in place (a failed import
    leaves nothing); an existing `out` is replaced only when empty or a model directory.
    `keep_quantized`: Q4_0/Q4_1/Q8_0 projections written as their blocks (see the module's doc)."""
    from safetensors.torch import save_file

    from .loader import resolve_dtype

    if dtype not in ("float32", "bfloat16", "float16"):
        raise GGUFImportError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    source = str(path)
    out = Path(out)
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / "config.json").is_file())):
        raise GGUFImportError(f"{out}: exists and is not a model directory (it would be replaced); choose another --out")
    reader, meta = read_gguf(path)
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise GGUFImportError(f"{source}: tensor 'token_embd.weight' is missing")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    cfg = hf_config(meta, names, int(embd.shape[1]), source)
    arch = meta["general.architecture"]
    try:
        tokenizer = build_tokenizer(meta)
    except ValueError as e:
        raise GGUFImportError(f"{source}: {e}") from None
    weights = convert_weights(reader, cfg, arch, resolve_dtype(dtype), source, keep_quantized)
    cfg["torch_dtype"] = dtype
    kept = [w for n, w in weights.items() if n.endswith("_proj.qweight")]  # (the embeddings and head aside)
    if kept:
        from .quantize import GROUP

        int4 = sum(1 for w in kept if w.dtype == torch.uint8)
        cfg["quantization_config"] = {"quant_method": "draftwise", "group_size": GROUP, "kept_tensors": len(kept),
                                      "int4_tensors": int4, "int8_tensors": len(kept) - int4, "source": "gguf"}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        tokenizer.save(str(tmp / "tokenizer.json"))
        tok_cfg = tokenizer_config(meta, cfg["max_position_embeddings"])
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation_config(meta), indent=2) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        for f in [tmp, *tmp.iterdir()]:  # mkdtemp makes the folder private; files as the umask says
            f.chmod((0o777 if f.is_dir() else 0o666) & ~umask)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


__all__ = ["GGUFImportError", "import_gguf", "int4_blocks", "q8_blocks", "read_gguf"]
