"""Load and save Hugging Face-format model directories (no hub access).

A directory holds `config.json`, `model.safetensors` or `model.safetensors.index.json` with its
shards, `tokenizer.json` (loaded with `tokenizers`), optionally `tokenizer_config.json`,
`chat_template.jinja` (read into the tokenizer config's `chat_template`) and
`generation_config.json`. A bare name (`smollm2`) that is not a directory here is looked up under
`models/` (`paths.resolve_model`). Every failure is a `ModelLoadError` naming the file and the field.
"""
from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..paths import models_dir, resolve_model
from . import cpu_kernels
from .act8 import q4k_steps
from .config import ModelConfig, ModelLoadError
from .hybrid import HybridModel
from .llama import LlamaModel, rope_inv_freq
from .packed_weights import QuantizedEmbedding, native_gemm_wanted
from .quantize import GROUP, check_method, dequantize_int4, dequantize_q8_groups, int8_groups, quantize_int4


log = logging.getLogger(__name__)


def model_class(cfg: ModelConfig):
    """The module for a config: the hybrid decoder (Qwen3-Next) or the Llama-family one."""
    return HybridModel if cfg.hybrid is not None else LlamaModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    model: LlamaModel | HybridModel
    tokenizer: object | None  # tokenizers.Tokenizer
    tokenizer_config: dict = field(default_factory=dict)
    generation_config: dict = field(default_factory=dict)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.generation_config.get("eos_token_id", None)
        if eos is None:
            return list(self.config.eos_token_id)
        return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def _weight_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: field 'weight_map' unreadable ({e})") from None
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: shard listed in {index.name} 'weight_map' not found")
        return files
    raise ModelLoadError(f"{path}: no model.safetensors or model.safetensors.index.json found")


def load_model(path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu",
               load_tokenizer: bool = True, fuse: bool = True, quantization: str | None = None) -> LoadedModel:
    """`quantization`: None, "int8" or "int4" (weight-only, quantized from the float weights while the
    model is prepared: see quantize.py); Llama-family models only. A directory holding quantized
    blocks (`import-gguf --keep-quantized`: int4 and int8 groups, gguf_blocks.py) runs on them by
    default (int4 when it has any, else int8); a method asked for re-quantises the other kind's
    blocks one by one (int8 asked of int4 blocks: int8 groups from their values)."""
    quantization = check_method(quantization)
    path = resolve_model(path)
    if not path.is_dir():
        hint = f" (nor {models_dir() / path})" if len(path.parts) == 1 else ""
        raise ModelLoadError(f"{path}: model directory not found{hint}")
    cfg = ModelConfig.from_dir(path)
    if quantization is not None and cfg.hybrid is not None:
        raise ModelLoadError(f"{path}: quantization {quantization!r} supports Llama-family models, not the hybrid "
                             f"architecture {cfg.arch}")
    dt = resolve_dtype(dtype)
    if (dt == torch.bfloat16 and torch.device(device).type == "cpu" and not cpu_kernels.bf16_native()
            and not (fuse and native_gemm_wanted())):  # (with the kernels, dw_gemm_bf16 runs the products)
        log.warning("draftwise: this CPU has no native bfloat16 products (%s): bfloat16 weights run through "
                    "torch's generic matmul, slower than float32 here; consider --dtype float32",
                    torch.backends.cpu.get_cpu_capability())
    model = _build_model(path, cfg, dt, device, fuse, quantization)
    tokenizer = _load_tokenizer(path) if load_tokenizer else None
    tok_cfg = _read_json(path / "tokenizer_config.json")
    jinja = path / "chat_template.jinja"  # transformers 5 writes the template here; it wins, as there
    if jinja.is_file():
        tok_cfg["chat_template"] = jinja.read_text(encoding="utf-8")
    gen_cfg = _read_json(path / "generation_config.json")
    return LoadedModel(path, cfg, model, tokenizer, tok_cfg, gen_cfg)


def _build_model(path: Path, cfg: ModelConfig, dt: torch.dtype, device: str, fuse: bool, quantization: str | None):
    """The model of `cfg` holding the directory's weights in `dt` on `device`, prepared for
    inference when `fuse` (quantized as `load_model` describes).

    Stored blocks that the prepared model runs as they are (`_kept_blocks`) are never dequantised:
    their weights stay unmaterialised (meta) until `fuse_projections` replaces them, and the float
    tensors are adopted as read, not copied into a freshly initialised model; the peak memory is
    then about the prepared model's, not a float32 copy of it (6 GB for a 1.5B model)."""
    with torch.device("meta"), _no_init():
        model = model_class(cfg)(cfg)
    expected = dict(model.state_dict())
    loaded, stored = _read_weights(path, cfg, expected, dt)
    subscales = {name: _stored_subscales(path, name, parts, tuple(expected[name].shape))
                 for name, parts in stored.items()}
    blocks = {name: _stored_blocks(path, name, parts, tuple(expected[name].shape), subscales[name])
              for name, parts in stored.items()}
    projections = {kind for name, (kind, _, _) in blocks.items() if name.endswith("_proj.weight")}
    as_stored = quantization is None
    if projections and as_stored:  # stored quantized: runs on its own blocks (fuse_projections)
        quantization = "int4" if "int4" in projections else "int8"
    kept = _kept_blocks(blocks, fuse and torch.device(device).type == "cpu" and cfg.hybrid is None,
                        as_stored, quantization)
    for name, (kind, q, sc) in blocks.items():  # the float paths (fuse=False, training) read their values
        if name not in kept:
            loaded[name] = (dequantize_int4(q, sc) if kind == "int4" else dequantize_q8_groups(q, sc)).to(dt)
    if cfg.tie_word_embeddings:
        loaded.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = [n for n in expected if n not in loaded and n not in kept]
    if missing:
        raise ModelLoadError(f"{path}: weights missing from the safetensors files: {', '.join(missing[:5])}")
    if cfg.hybrid is not None:  # (its buffers are computed in __init__: built for real)
        model = model_class(cfg)(cfg).to(dtype=dt)
        model.load_state_dict(loaded, strict=False)
    else:
        model.load_state_dict(loaded, strict=False, assign=True)
        if cfg.tie_word_embeddings:  # assign replaced the embedding's parameter: tie the head to it again
            model.lm_head.weight = model.model.embed_tokens.weight
        model.inv_freq = rope_inv_freq(cfg)
    model.inv_freq = model.inv_freq.float()
    if torch.device(device).type != "cpu":
        model.to(device)
    model.eval().requires_grad_(False)
    _attach_blocks(model, kept, dt)
    for name, sc in subscales.items():  # a Q4_K projection run as stored: its super-blocks too (act8.py)
        if sc is not None and name.endswith("_proj.weight") and name in kept and kept[name][2] is blocks[name][2]:
            model.get_submodule(name[: -len(".weight")]).q4k_subscales = sc
    del loaded, stored, blocks, kept, subscales  # the modules hold them now: fuse_projections frees each as it packs it
    if fuse:
        model.fuse_projections(quantization) if quantization else model.fuse_projections()
    return model


@contextlib.contextmanager
def _no_init():
    """torch.nn.init's initialisers as no-ops: every weight of a model built to be loaded is replaced,
    and initialising meta tensors imports torch's reference ops (seconds) for nothing."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "zeros_", "ones_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def _kept_blocks(blocks: dict, runs_blocks: bool, as_stored: bool, quantization: str | None) -> dict:
    """The stored blocks the prepared model runs without a float copy: none unless `runs_blocks`
    (prepared for the CPU kernels) and the model is quantized; the embeddings' as stored (a lookup
    dequantises its rows), the head's (int8, see _attach_head), a projection's in the kind asked for:
    int4 blocks asked as int8 become int8 groups (a finer grid: near their values), int8 ones asked
    as int4 are re-quantised to int4 from their values."""
    if not runs_blocks or quantization is None:
        return {}
    kept = {}
    for name, (kind, q, sc) in blocks.items():
        if name.endswith("_proj.weight") and not as_stored and kind != quantization:
            w = dequantize_int4(q, sc) if kind == "int4" else dequantize_q8_groups(q, sc)
            kind, (q, sc) = quantization, (int8_groups(w) if quantization == "int8" else quantize_int4(w))
        kept[name] = (kind, q, sc)
    return kept


def _attach_blocks(model, kept: dict, dt: torch.dtype) -> None:
    """Kept blocks onto their modules: `int4_blocks` / `int8_blocks` on a linear (read by
    fuse_projections; an int8 head from int4 blocks re-quantised into int8 groups), a
    `QuantizedEmbedding` in place of the embedding (a tied head takes its blocks)."""
    for name, (kind, q, sc) in kept.items():
        module = name[: -len(".weight")]
        if module == "model.embed_tokens":
            if model.lm_head.weight is model.model.embed_tokens.weight and "lm_head.weight" not in kept:
                _attach_head(model.lm_head, kind, q, sc)
            model.model.embed_tokens = QuantizedEmbedding(kind, q, sc, dt)
        elif module == "lm_head":
            _attach_head(model.lm_head, kind, q, sc)
        else:
            setattr(model.get_submodule(module), f"{kind}_blocks", (q, sc))


def _attach_head(head, kind: str, q: torch.Tensor, sc: torch.Tensor) -> None:
    """The LM head runs int8 (float32 logits): int4 blocks become int8 groups from their values."""
    head.int8_blocks = (q, sc) if kind == "int8" else int8_groups(dequantize_int4(q, sc))


# a weight stored quantized: its blocks, and a Q4_K one's integer sub-scales (gguf_import.py)
STORED_PARTS = ("qweight", "qscale", "qsub", "qsuper")


def _read_weights(path: Path, cfg: ModelConfig, expected: dict[str, torch.Tensor], dt: torch.dtype):
    """(float tensors by name, in `dt`; quantized blocks as stored: weight name -> its parts of
    STORED_PARTS) from the directory's safetensors files, each checked against `expected`'s names
    and shapes."""
    loaded: dict[str, torch.Tensor] = {}
    stored: dict[str, dict[str, torch.Tensor]] = {}  # weight name -> its quantized blocks as stored
    for f in _weight_files(path):
        try:
            sf = safe_open(str(f), framework="pt")
        except SafetensorError as e:  # empty, truncated, not safetensors at all
            size = f.stat().st_size
            raise ModelLoadError(f"{f}: not a readable safetensors file ({size} bytes; {e}): "
                                 "truncated or corrupt? re-copy or re-export it") from None
        with sf:
            read = _tensor_reader(f)
            for name in sf.keys():
                stem, _, part = name.rpartition(".")
                if part in STORED_PARTS and f"{stem}.weight" in expected:  # stored quantized (gguf_import)
                    stored.setdefault(f"{stem}.weight", {})[part] = read(name)
                    continue
                if name not in expected:
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    raise ModelLoadError(f"{f}: unexpected tensor '{name}' for architecture {cfg.arch}")
                t = read(name)
                want = tuple(expected[name].shape)
                if tuple(t.shape) != want:
                    raise ModelLoadError(
                        f"{f}: tensor '{name}' has shape {tuple(t.shape)}, config.json implies {want}"
                    )
                loaded[name] = t.to(dt)
    return loaded, stored


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8,
                       "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}


def _tensor_reader(f: Path):
    """name -> the tensor read from `f` into memory of its own (safetensors' format: a little-endian
    u64 header size, a JSON header of dtypes, shapes and byte ranges, then the data). Why not
    `get_tensor`: it copies out of a memory map whose touched pages count in the resident set
    until the file is closed, so a model's load peaked at twice its size."""
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    base = 8 + n

    def read(name: str) -> torch.Tensor:
        info = header[name]
        begin, end = info["data_offsets"]
        raw = np.fromfile(f, dtype=np.uint8, count=end - begin, offset=base + begin)
        return torch.from_numpy(raw).view(_SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])

    return read


def _load_tokenizer(path: Path):
    """The directory's `tokenizer.json` as a `tokenizers.Tokenizer`."""
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise ModelLoadError(f"{tok_file}: file not found (draftwise reads tokenizers' tokenizer.json)")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(tok_file))
    except Exception as e:  # tokenizers raises a bare Exception
        raise ModelLoadError(f"{tok_file}: cannot be parsed ({e})") from None


def stored_quantization(path: str | Path) -> str | None:
    """The quantization a directory written by `import-gguf --keep-quantized` runs by default ("int4"
    when it holds Q4 blocks, else "int8"), or None (float weights; also for a missing directory)."""
    qc = _read_json(resolve_model(path) / "config.json").get("quantization_config") or {}
    if qc.get("quant_method") != "draftwise":
        return None
    return "int4" if qc.get("int4_tensors") else "int8" if qc.get("int8_tensors") else None


def _stored_blocks(path: Path, name: str, parts: dict[str, torch.Tensor], shape: tuple[int, ...], subscales=None):
    """A weight stored quantized by `import-gguf --keep-quantized`: ("int4", q, sm) for Q4 blocks
    (`.qweight` uint8 [O, N/2], `.qscale` float16 [O, N/32, 2]; a Q4_K weight stores its sub-scales
    instead, `subscales`, from which sm follows) or ("int8", q, d) for Q8_0 blocks (`.qweight` int8
    [O, N], `.qscale` float16 [O, N/32]), checked against the shape config.json implies."""
    stem = name[: -len(".weight")]
    if "qscale" not in parts and subscales is not None:
        parts = {**parts, "qscale": q4k_steps(*subscales)}
    if not {"qweight", "qscale"} <= set(parts):
        missing = ({"qweight", "qscale"} - set(parts)).pop()
        raise ModelLoadError(f"{path}: tensor '{stem}.{missing}' missing (quantized weights need both qweight and "
                             "qscale, or a Q4_K weight's qweight, qsub and qsuper)")
    q, sc = parts["qweight"], parts["qscale"]
    o, n = shape
    int4 = q.dtype == torch.uint8
    want_q, want_sc = ((o, n // 2), (o, n // GROUP, 2)) if int4 else ((o, n), (o, n // GROUP))
    if (n % GROUP or q.dtype not in (torch.uint8, torch.int8) or sc.dtype != torch.float16
            or tuple(q.shape) != want_q or tuple(sc.shape) != want_sc):
        raise ModelLoadError(f"{path}: quantized tensors '{stem}.qweight' {tuple(q.shape)} {q.dtype} / '{stem}.qscale' "
                             f"{tuple(sc.shape)} {sc.dtype} do not hold a {o}x{n} weight (want int4 {(o, n // 2)} "
                             f"uint8 / {(o, n // GROUP, 2)} float16, or int8 {(o, n)} / {(o, n // GROUP)} float16)")
    return ("int4" if int4 else "int8"), q.contiguous(), sc.contiguous()


def _stored_subscales(path: Path, name: str, parts: dict[str, torch.Tensor], shape: tuple[int, ...]):
    """A Q4_K weight's integer sub-scales as `import-gguf --keep-quantized` stores them with its
    4-bit values (`.qsub` uint8 [O, N/32, 2], `.qsuper` float16 [O, N/256, 2]), or None where it
    stores none; checked against the weight's shape."""
    stem = name[: -len(".weight")]
    have = {"qsub", "qsuper"} & set(parts)
    if not have or "qweight" not in parts:  # (a missing qweight: _stored_blocks says so)
        return None
    o, n = shape
    sub, sup = parts.get("qsub"), parts.get("qsuper")
    if (have != {"qsub", "qsuper"} or n % 256 or sub.dtype != torch.uint8 or sup.dtype != torch.float16
            or tuple(sub.shape) != (o, n // GROUP, 2) or tuple(sup.shape) != (o, n // 256, 2)
            or parts["qweight"].dtype != torch.uint8):
        raise ModelLoadError(f"{path}: Q4_K sub-scales '{stem}.qsub' / '{stem}.qsuper' do not hold a {o}x{n} int4 "
                             f"weight's (want both, uint8 {(o, n // GROUP, 2)} / float16 {(o, n // 256, 2)})")
    return sub.contiguous(), sup.contiguous()


def _read_json(f: Path) -> dict:
    if not f.is_file():
        return {}
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{f}: not valid JSON ({e})") from None


def save_model(model: LlamaModel, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write `config.json` and `model.safetensors` (tokenizer files are the caller's)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    raw = dict(model.cfg.raw)
    raw["torch_dtype"] = {torch.bfloat16: "bfloat16", torch.float32: "float32"}.get(dtype, "float32")
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
