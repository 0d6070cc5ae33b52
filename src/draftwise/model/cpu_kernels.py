"""Fused CPU kernels (`kernels.c`) for the decoder layer of one sequence, loaded with ctypes.

The C file is compiled once per machine with the system C compiler (`cc -O3 -march=native`) into
a cache folder (`$DRAFTWISE_CACHE`, default `~/.cache/draftwise`), keyed by the source, the flags
and the CPU's feature flags; a compile takes about a second. Without a compiler, or with
`DRAFTWISE_KERNELS=0`, `kernels()` returns None and the model runs its plain PyTorch path (same
results up to float rounding: tests compare the two).

`LlamaModel.forward` uses them when one sequence's tokens sit on consecutive cache slots (batch-1
decoding, a drafter's steps, verification of a lone sequence); see `fused_layer` in llama.py.
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

SOURCE = Path(__file__).with_name("kernels.c")
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
    starved (kernels.c, GEMM_PREFETCH_LOCALITY), prefetcht2 there."""
    try:
        intel = "GenuineIntel" in Path("/proc/cpuinfo").read_text()
    except OSError:
        intel = False
    return ["-DGEMM_PREFETCH_LOCALITY=1"] if intel else []


def _build(source: Path = SOURCE) -> Path:
    """Compile `source` (kernels.c, or another C file of model/, e.g. gated_delta.c) once per machine."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler found (cc, gcc or clang)")
    src = source.read_bytes()
    flags = FLAGS + _vendor_flags()
    key = hashlib.sha256(src + " ".join(flags + OPENMP).encode() + _cpu_flags().encode() + platform.machine().encode())
    cache = Path(os.environ.get("DRAFTWISE_CACHE") or Path.home() / ".cache" / "draftwise")
    lib = cache / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        try:
            subprocess.run([cc, *flags, *OPENMP, "-o", tmp, str(source), "-lm"], check=True, capture_output=True,
                           timeout=120)
        except subprocess.CalledProcessError:
            subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], check=True, capture_output=True, timeout=120)
        os.replace(tmp, lib)  # atomic: concurrent builders each install a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


# 0, or -1: no scratch memory
INT_RESULT = ("dw_decoder", "dw_forward", "dw_attend", "dw_attend_batch", "dw_draft_greedy", "dw_draft_greedy_rows")


class Kernels:
    """Typed entry points of the shared library. Arguments are tensors (contiguous, on the CPU)."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        p, i, f = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
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
            "dw_gemm_f32": [p, p, p, p, i, i, i, ctypes.c_int],
            "dw_gemm_bf16": [p, p, p, p, i, i, i, ctypes.c_int],
            "dw_gemm_bf16_f32out": [p, p, p, p, i, i, i, ctypes.c_int],
            "dw_pack": [p, p, i, i, i],
            "dw_argmax_conf": [p, i, i, p, p, ctypes.c_int],
            "dw_attend_batch": [p, i, i, i, i, i, p, p, p, i, p, p, p, i, f, p, ctypes.c_int, ctypes.c_int],
            "dw_decoder": [p, p, i, i, i, i, i, i, i, i, ctypes.POINTER(p), ctypes.POINTER(ctypes.c_int), p, f, p,
                           p, p, p, i, i, i, i, p, i, p, p, p, i, f, ctypes.c_int, ctypes.c_int],
            "dw_forward": [p, ctypes.c_int, p, p, ctypes.c_int, i, p, i, p, i, i, i, i, i, i, i, i,
                           ctypes.POINTER(p), ctypes.POINTER(ctypes.c_int), p, f, p, p, p, p, i, i, i, i, p, i, p, p,
                           p, i, f, ctypes.c_int, ctypes.c_int],
            "dw_draft_greedy": [p, ctypes.c_int, p, i, i, i, i, i, i, i, i, i, ctypes.POINTER(p),
                                ctypes.POINTER(ctypes.c_int), p, f, p, p, p, i, i, i, p, i, i, f, ctypes.c_int,
                                ctypes.c_int, p, ctypes.c_int, i, p, p],
            "dw_draft_greedy_rows": [p, ctypes.c_int, p, p, p, p, i, i, i, i, i, i, i, ctypes.POINTER(p),
                                     ctypes.POINTER(ctypes.c_int), p, f, p, p, p, i, i, p, i, i, f, ctypes.c_int,
                                     ctypes.c_int, p, ctypes.c_int, i, i, p, p],
        }
        for name, args in sig.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, (ctypes.c_int if name in INT_RESULT else None)
            setattr(self, name[3:], fn)
        self.path = path


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
    and may sum in another order (`llama._native_pack` then takes dw_gemm_f32 unchecked)."""
    return "avx512f" in _cpu_flags().split()


def bf16_native() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 / AVX-512BW+VL+DQ, AMX or
    AVX-NE-CONVERT, as oneDNN asks). oneDNN's packed bfloat16 weights need it; without it torch's
    bfloat16 matmul falls back to a generic loop (measured on an AVX2-only EPYC, 2 threads: a
    4096x384 by 384x1152 product 457 ms in bfloat16 against 66 ms in float32), so bfloat16
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
    torch's max and logsumexp. A drafter's confidence each step: torch's took 0.17 ms for 4 rows
    of 8192 logits on 2 threads (0.26 ms for 8), the kernel's a few microseconds a row; the same
    values within float32 rounding, NaN for a row holding a NaN or whose maximum is infinite."""
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
