"""The size of the paged K/V pools: a budget in bytes turned into blocks.

Each model that keeps a cache (the target, and a draft model or a DSpark drafter) gets a pool of
the same number of blocks; one token costs `layers * 2 * kv_heads * head_dim * element size`
bytes in each. On CPU the pool is allocated zeroed up front, so it is resident memory from the
start: its size is chosen in bytes, as vLLM does (`VLLM_CPU_KVCACHE_SPACE` on CPU,
`--gpu-memory-utilization` on GPUs).

- `kv_cache_memory` given ("2GiB", "512MB", or bytes): exactly that many bytes' worth of blocks,
  and a ValueError when one full context (`max_model_len` + lookahead) does not fit.
- otherwise the default budget: `max(512 MiB, the models' weight bytes)`, at most half the
  memory the machine has available now, and never more than the token rule (`max_num_seqs` full
  contexts, capped at `kv_cache_max_tokens`); at least one full context. E.g. SmolLM2-135M in
  float32 (46 KB of K/V per token, 538 MB of weights): about 11.7K tokens (730 per sequence at
  16 in flight), where the token rule alone would give 131072 tokens (5.6 GiB). The embedded pair
  (8.4 KB per token with its draft) keeps ~62 full 1024-token contexts.
- `num_kv_blocks` given: that many blocks (tests, and callers that count tokens).
"""
from __future__ import annotations

import math
import re

GIB = 1 << 30
DEFAULT_FLOOR = 512 << 20  # the default budget is at least this, or the weights' size
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_memory(value: str | int | float) -> int:
    """`"2GiB"`, `"1.5 GB"`, `"512MiB"`, `1073741824` -> bytes (binary and decimal units)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        n = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"kv_cache_memory: expected a size such as 2GiB, 512MB or a number of bytes, got {value!r}")
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not n > 0:
        raise ValueError(f"kv_cache_memory must be > 0, got {value!r}")
    return int(n)


def format_bytes(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def kv_bytes_per_token(models) -> int:
    """Bytes of K/V one token takes across the given models' pools (LoadedModel each)."""
    total = 0
    for m in models:
        c = m.config
        item = next(m.model.parameters()).element_size()
        hybrid = getattr(c, "hybrid", None)  # (a DSpark drafter's DSparkConfig has none)
        layers = c.num_hidden_layers if hybrid is None else len(hybrid.attention_layers)  # hybrid: attention only
        total += layers * 2 * c.num_key_value_heads * c.head_dim * item
    return total


def weight_bytes(models) -> int:
    """The models' weights in bytes: parameters times their element size, or for a quantized model
    (int8 / int4 weights, kept GGUF blocks) the bytes its tensors hold, which the parameter count
    overstates 3-6x (a 4-bit 1.5B model counted as float32 claimed 6 GB of K/V by default)."""
    from ..model.quantize import quantization_of

    total = 0
    for m in models:
        # quantized, or a DSpark drafter (its parameters are its own weights: the target's are shared)
        if hasattr(m.model, "modules") and (quantization_of(m.model) or not hasattr(m.config, "num_parameters")):
            total += sum(t.numel() * t.element_size() for t in (*m.model.parameters(), *m.model.buffers()))
        else:
            total += m.config.num_parameters() * next(m.model.parameters()).element_size()
    return total


def available_memory() -> int | None:
    """`MemAvailable` from /proc/meminfo (Linux), else None (no cap from free memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def default_kv_memory(models) -> int:
    budget = max(DEFAULT_FLOOR, weight_bytes(models))
    free = available_memory()
    return min(budget, free // 2) if free else budget


def num_kv_blocks(config, context: int, models) -> int:
    """Blocks per pool for an EngineConfig `config`; `context` = max_model_len + lookahead tokens;
    `models` = the LoadedModels that keep a pool."""
    bs = config.block_size
    min_blocks = -(-context // bs)
    if config.num_kv_blocks is not None:
        if config.num_kv_blocks < min_blocks:
            raise ValueError(f"num_kv_blocks must be >= {min_blocks} to hold one full context, got {config.num_kv_blocks}")
        return config.num_kv_blocks
    per_block = kv_bytes_per_token(models) * bs
    if config.kv_cache_memory is not None:
        budget = parse_memory(config.kv_cache_memory)
        if budget // per_block < min_blocks:
            raise ValueError(
                f"kv_cache_memory {format_bytes(budget)} is too small: one full context ({context} tokens at "
                f"{per_block // bs} bytes each) needs {format_bytes(min_blocks * per_block)}; raise "
                f"--kv-cache-memory or lower the maximum model length (max_model_len)"
            )
        return budget // per_block
    tokens = min(config.max_num_seqs * context, max(config.kv_cache_max_tokens, context))
    blocks = min(math.ceil(tokens / bs), default_kv_memory(models) // per_block)
    return max(blocks, min_blocks)
