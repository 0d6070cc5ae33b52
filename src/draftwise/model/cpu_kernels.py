"""Fused CPU kernels (the C files of `kernels/`) for the decoder layers, loaded with ctypes.

The C files (`kernels/*.c`, one op family each, sharing `kernels/kernels.h`) are compiled
together once per machine with the system C compiler (`cc -O3 -march=native`) into one library in
a cache folder (`$DRAFTWISE_CACHE`, default `~/.cache/draftwise`), keyed by every source and header,
the flags and the CPU's feature flags: a change to any part builds a new library. Without a
compiler, or with `DRAFTWISE_KERNELS=0`, `kernels()` returns None and the model runs its plain
PyTorch path (same results up to float rounding: tests compare the two).

`LlamaModel` calls them on its fused CPU path (native_forward.py) and from its prepared weights
(packed_weights.py). `DecoderArgs` and `NativeIO` mirror the C structs that the whole-model calls
(`dw_decoder`, `dw_forward`, the drafters' greedy steps) take by pointer; `Eagle3IO` the EAGLE-3
drafter's own part of its steps (`dw_eagle3_greedy`), `DSparkIO` a DSpark drafter's
(`dw_dspark_block`).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).with_name("kernels")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
# the products split their outputs across an OpenMP team (libgomp, which torch has loaded already:
# one thread pool); a compiler without OpenMP builds the same kernels single-threaded
OPENMP = ["-fopenmp"]
_LIB: "Kernels | None | bool" = False  # False: not tried yet


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _vendor_flags() -> list[str]:
    """Defines for this CPU's vendor: Intel's prefetchnta left the products' weight streams
    starved (kernels/gemm.c, GEMM_PREFETCH_LOCALITY), prefetcht2 there."""
    try:
        intel = "GenuineIntel" in Path("/proc/cpuinfo").read_text()
    except OSError:
        intel = False
    return ["-DGEMM_PREFETCH_LOCALITY=1"] if intel else []


def _parts(source: Path) -> tuple[list[Path], list[Path]]:
    """(the C files to compile, every file the build reads) for a C file or a folder of them."""
    if source.is_dir():
        sources = sorted(source.glob("*.c"))
        return sources, sorted([*sources, *source.glob("*.h")])
    return [source], [source]


def source_bytes(source: Path = KERNEL_DIR) -> bytes:
    """Every file the build of `source` reads, each as its name and bytes in name order: a changed,
    added or removed part changes them (the build cache's key, and the hardware profile's)."""
    return b"".join(part.name.encode() + b"\0" + part.read_bytes() + b"\0" for part in _parts(source)[1])



def _build(source: Path = KERNEL_DIR) -> Path:
    """Compile `source` once per machine: the folder `kernels/` (all its C files into one library),
    or one C file of model/ (gated_delta.c)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler found (cc, gcc or clang)")
    sources = _parts(source)[0]
    flags = FLAGS + _vendor_flags()
    key = hashlib.sha256(source_bytes(source) + " ".join(flags + OPENMP).encode() + _cpu_flags().encode()
                         + platform.machine().encode())
    cache = Path(os.environ.get("DRAFTWISE_CACHE") or Path.home() / ".cache" / "draftwise")
    lib = cache / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        try:
            subprocess.run([cc, *flags, *OPENMP, "-o", tmp, *map(str, sources), "-lm"], check=True,
                           capture_output=True, timeout=120)
        except subprocess.CalledProcessError:
            subprocess.run([cc, *flags, "-o", tmp, *map(str, sources), "-lm"], check=True, capture_output=True,
                           timeout=120)
        os.replace(tmp, lib)  # atomic: concurrent builders each install a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


class DecoderArgs(ctypes.Structure):
    """`struct dw_decoder_args` (kernels/kernels.h), field for field: the rows of one decoder call
    and the model they run through. Pointers are addresses (ints; 0 for NULL)."""

    _fields_ = [(name, ctypes.c_long) for name in ("B", "T", "layers", "hid", "H", "Hkv", "D", "I")] + [
        ("w", ctypes.c_void_p),  # 14 pointers per layer
        ("kinds", ctypes.c_void_p),  # int [layers, 4]: the projections' kernels
        ("final_norm", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("pos", ctypes.c_void_p),  # int64 [rows]
        ("cos", ctypes.c_void_p),  # float32 [positions, D]
        ("sin", ctypes.c_void_p),
        ("cache", ctypes.c_void_p),
        ("layer_stride", ctypes.c_long),
        ("kv_stride", ctypes.c_long),
        ("slot0", ctypes.c_long),
        ("L", ctypes.c_long),
        ("slots", ctypes.c_void_p),  # int64 [B, Lmax], or NULL: consecutive slots from slot0
        ("Lmax", ctypes.c_long),
        ("lens", ctypes.c_void_p),  # int64 [B]
        ("news", ctypes.c_void_p),  # int64 [B]
        ("offs", ctypes.c_void_p),  # int64 [B + 1] (packed rows), or NULL
        ("window", ctypes.c_long),
        ("scale", ctypes.c_float),
        ("bf", ctypes.c_int),
        ("threads", ctypes.c_int),
        ("tree", ctypes.c_void_p),  # int64: sequences whose rows form a tree (`tree_attention.kernel_trees`), or NULL
        ("feat", ctypes.c_void_p),  # [rows, nfeat * hid] in the dtype: the listed layers' outputs, or NULL
        ("feat_layers", ctypes.c_void_p),  # int64 [nfeat], ascending
        ("nfeat", ctypes.c_long),
        ("block", ctypes.c_long),  # 1: each sequence's T rows see each other (DSpark's block); 0: causal
    ]


class NativeIO(ctypes.Structure):
    """`struct dw_io` (kernels/kernels.h): the input embedding and the LM head run in the kernels."""

    _fields_ = [("emb", ctypes.c_void_p), ("emb_packed", ctypes.c_int), ("head_w", ctypes.c_void_p),
                ("head_kind", ctypes.c_int), ("V", ctypes.c_long), ("emb_scale", ctypes.c_void_p),
                ("head_scale", ctypes.c_void_p), ("head_ids", ctypes.c_void_p), ("head_floor", ctypes.c_float)]


class Eagle3IO(ctypes.Structure):
    """`struct dw_eagle3` (kernels/kernels.h): an EAGLE-3 drafter's norms and fc_in for its greedy
    steps (`dw_eagle3_greedy`), its fc for its cache writes (`dw_eagle3_commit`)."""

    _fields_ = [("hidden_norm", ctypes.c_void_p), ("embed_norm", ctypes.c_void_p), ("fc_in", ctypes.c_void_p),
                ("fc_in_bias", ctypes.c_void_p), ("fc_in_scale", ctypes.c_void_p), ("fc_in_kind", ctypes.c_int),
                ("fc", ctypes.c_void_p), ("fc_bias", ctypes.c_void_p), ("fc_scale", ctypes.c_void_p),
                ("fc_kind", ctypes.c_int), ("nfeat", ctypes.c_long)]


class DSparkIO(ctypes.Structure):
    """`struct dw_dspark` (kernels/kernels.h): a DSpark drafter's pieces besides its layers, for its
    block drafting (`dw_dspark_block`) and cache writes (`dw_dspark_commit`)."""

    _fields_ = [("fc", ctypes.c_void_p), ("fc_bias", ctypes.c_void_p), ("fc_scale", ctypes.c_void_p),
                ("fc_kind", ctypes.c_int), ("hidden_norm", ctypes.c_void_p), ("fc_in", ctypes.c_void_p),
                ("fc_in_bias", ctypes.c_void_p), ("fc_in_scale", ctypes.c_void_p), ("fc_in_kind", ctypes.c_int),
                ("mask_emb", ctypes.c_void_p), ("kv", ctypes.c_void_p), ("kv_kinds", ctypes.c_void_p),
                ("w1", ctypes.c_void_p), ("rank", ctypes.c_long), ("w2", ctypes.c_void_p), ("w2_bias", ctypes.c_void_p),
                ("w2_scale", ctypes.c_void_p), ("w2_kind", ctypes.c_int), ("conf_w", ctypes.c_void_p),
                ("conf_b", ctypes.c_float), ("temps", ctypes.c_void_p), ("nfeat", ctypes.c_long)]


class DSparkTree(ctypes.Structure):
    """`struct dw_dspark_tree` (kernels/kernels.h): greedy rows' trees grown in `dw_dspark_block`."""

    _fields_ = [("nodes", ctypes.c_void_p), ("width", ctypes.c_long), ("bins", ctypes.c_long),
                ("max_nodes", ctypes.c_long), ("ratio", ctypes.c_void_p), ("floor", ctypes.c_float),
                ("confidence", ctypes.c_int), ("out_n", ctypes.c_void_p), ("out_tok", ctypes.c_void_p),
                ("out_parent", ctypes.c_void_p), ("out_conf", ctypes.c_void_p), ("out_q", ctypes.c_void_p),
                ("out_first", ctypes.c_void_p)]


# 0, or -1: no scratch memory
INT_RESULT = ("dw_vnni", "dw_amx_enable", "dw_decoder", "dw_forward", "dw_attend", "dw_attend_batch", "dw_draft_greedy", "dw_draft_greedy_rows",
              "dw_eagle3_greedy", "dw_eagle3_step", "dw_eagle3_commit", "dw_dspark_block", "dw_dspark_commit")


class Kernels:
    """Typed entry points of the shared library. Arguments are tensors (contiguous, on the CPU)."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        p, i, f = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
        args, io = ctypes.POINTER(DecoderArgs), ctypes.POINTER(NativeIO)
        sig = {
            "dw_rms_norm": [p, p, p, i, i, f, ctypes.c_int],
            "dw_add_rms_norm": [p, p, p, p, i, i, f, ctypes.c_int],
            "dw_rope": [p, i, i, i, i, p, p, p, ctypes.c_int],
            "dw_attend": [p, i, i, i, i, p, p, i, i, i, f, p, ctypes.c_int, ctypes.c_int],
            "dw_silu_mul": [p, p, i, i, ctypes.c_int],
            "dw_linear": [p, p, p, p, i, i, i, ctypes.c_int],
            "dw_linear_q4": [p, p, p, p, p, i, i, i, ctypes.c_int, ctypes.c_int, ctypes.c_int],
            "dw_gemm_q8": [p, p, p, p, p, i, i, i, ctypes.c_int, ctypes.c_int, ctypes.c_int],
            "dw_gemm_q8g": [p, p, p, p, p, i, i, i, ctypes.c_int, ctypes.c_int, ctypes.c_int],
            "dw_gemm_q8g_a8": [p, p, p, p, p, i, i, i, ctypes.c_int, ctypes.c_int, ctypes.c_int],
            "dw_linear_q4_a8": [p, p, p, p, p, i, i, i, ctypes.c_int, ctypes.c_int, ctypes.c_int],
            "dw_linear_q4k_a8": [p, p, p, p, p, i, i, i, ctypes.c_int, ctypes.c_int, ctypes.c_int],
            "dw_vnni": [],
            "dw_amx_enable": [ctypes.c_int],
            "dw_gemm_f32": [p, p, p, p, i, i, i, ctypes.c_int],
            "dw_gemm_bf16": [p, p, p, p, i, i, i, ctypes.c_int],
            "dw_gemm_bf16_f32out": [p, p, p, p, i, i, i, ctypes.c_int],
            "dw_pack": [p, p, i, i, i],
            "dw_argmax_conf": [p, i, i, p, p, ctypes.c_int],
            "dw_attend_batch": [p, i, i, i, i, i, p, p, p, i, p, p, p, i, f, p, ctypes.c_int, ctypes.c_int, p],
            "dw_decoder": [p, p, args],
            "dw_forward": [io, p, p, i, p, args],
            "dw_draft_greedy": [io, args, p, i, i, i, p, p, p, p],
            "dw_draft_greedy_rows": [io, args, p, p, p, p, i, i, p, p, p, p],
            "dw_eagle3_greedy": [io, args, ctypes.POINTER(Eagle3IO), p, p, p, i, i, p, p, p],
            "dw_eagle3_step": [io, args, ctypes.POINTER(Eagle3IO), p, p, p, i, i, p, p],
            "dw_eagle3_commit": [io, args, ctypes.POINTER(Eagle3IO), p, p, p, p, i, p],
            "dw_dspark_block": [io, args, ctypes.POINTER(DSparkIO), p, p, p, p, p, i, p, p, p, p, p, p],
            "dw_dspark_commit": [args, ctypes.POINTER(DSparkIO), p, p, p, i, p],
        }
        for name, args in sig.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, (ctypes.c_int if name in INT_RESULT else None)
            setattr(self, name[3:], fn)
        self.path = path
        rows = amx_min_rows()
        self.amx_rows = rows if self.amx_enable(rows) else 0  # products of this many rows and more use tiles


# Products of at least this many rows run on AMX tiles where the CPU has them (kernels/amx.c); a
# row's result is bitwise the same either way. DRAFTWISE_AMX=0 keeps them on VPDPBUSD. One row
# stays there: a 1-row step is bound by reading the weights, and int8 groups' 1-row products ran
# slower on tiles (the 1.5B with int8 groups everywhere: 78 against 65 ms a step).
AMX_MIN_ROWS = 2


def amx_min_rows() -> int:
    """AMX_MIN_ROWS; DRAFTWISE_AMX=0 none, DRAFTWISE_AMX=N from N rows."""
    v = os.environ.get("DRAFTWISE_AMX", "").strip()
    if v and not v.isdigit():
        log.warning("draftwise: DRAFTWISE_AMX=%r is not a row count (0: no AMX tiles); using %d", v, AMX_MIN_ROWS)
    return int(v) if v.isdigit() else AMX_MIN_ROWS


def set_amx(min_rows: int) -> bool:
    """Run products of `min_rows` rows or more on AMX tiles from now on (0: none); whether this
    build and CPU have them (tests compare both paths)."""
    k = kernels()
    if k is None:
        return False
    granted = bool(k.amx_enable(min_rows))
    k.amx_rows = min_rows if granted else 0
    return granted


AMX_TILE_ROWS = 16  # rows of one block of tiles (kernels/amx.c): a product of more takes another pass over the weights


def amx_rows() -> int:
    """From how many rows products run on AMX tiles now (0: none; a hardware profile's cache
    key: the tiles change what a verification block costs)."""
    k = kernels()
    return k.amx_rows if k is not None else 0


def kernels() -> Kernels | None:
    """The loaded kernels, or None where they cannot be used (built on first call)."""
    global _LIB
    if _LIB is False:
        _LIB = None
        if os.environ.get("DRAFTWISE_KERNELS", "1") != "0":
            try:
                _LIB = Kernels(_build())
            except Exception as e:  # no compiler, a failed build: the PyTorch path still works
                log.warning("draftwise: fused CPU kernels unavailable (%s); using the PyTorch path", e)
    return _LIB


def set_enabled(enabled: bool) -> None:
    """Switch the kernels on or off for models run from now on (tests compare both paths)."""
    global _LIB
    _LIB = False
    os.environ["DRAFTWISE_KERNELS"] = "1" if enabled else "0"


def avx512() -> bool:
    """Whether the CPU has AVX-512 (F): oneDNN's float32 kernels there are wider than dw_gemm_f32's
    and may sum in another order (`packed_weights._native_pack` then takes dw_gemm_f32 unchecked)."""
    return "avx512f" in _cpu_flags().split()


def vnni() -> bool:
    """Whether the kernels were built with AVX-512 VNNI (kernels/vnni.c's int8-activation products):
    the layouts quantize.py packs GGUF blocks into depend on it. DRAFTWISE_ACT8=0 keeps the
    float-activation products."""
    k = kernels()
    return k is not None and os.environ.get("DRAFTWISE_ACT8", "1") != "0" and bool(k.vnni())


def bf16_native() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 / AVX-512BW+VL+DQ, AMX or
    AVX-NE-CONVERT, as oneDNN asks). oneDNN's packed bfloat16 weights need it; without it torch's
    bfloat16 matmul falls back to a generic loop (several times slower than float32), so bfloat16
    autocast in training is left off there."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def usable(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.bfloat16) and kernels() is not None


def argmax_confidence(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Each row's first maximum and its max softmax probability exp(max - logsumexp) ([N, V]
    float32 logits): `dw_argmax_conf` (1 / sum exp(l - max) on 8 lanes) where the kernels run, else
    torch's max and logsumexp. A drafter's confidence each step: a few microseconds a row in the
    kernel against a tenth of a millisecond or more for torch's calls; the same values within
    float32 rounding, NaN for a row holding a NaN or whose maximum is infinite."""
    lib = kernels()
    if lib is None or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2:
        top, am = logits.float().max(dim=-1)
        return am.tolist(), torch.exp(top - torch.logsumexp(logits.float(), dim=-1)).tolist()
    x = logits.contiguous()
    n, v = x.shape
    tok = np.empty(n, dtype=np.int64)  # (numpy's buffers: a few microseconds less than torch's)
    conf = np.empty(n, dtype=np.float32)
    lib.argmax_conf(x.data_ptr(), n, v, tok.ctypes.data, conf.ctypes.data, torch.get_num_threads())
    return tok.tolist(), conf.tolist()
