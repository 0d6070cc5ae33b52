"""The size of the paged K/V pools: a budget in bytes turned into blocks, and the context length
that fits them.

Each model that keeps a cache (the target, and a draft model or a DSpark drafter) gets a pool of
the same number of blocks, except the cross-vocabulary draft's, `factor` times as many (its
context re-encoded in draft tokens is longer: proposers/cross_vocab.py); one token costs
`layers * 2 * kv_heads * head_dim * element size` bytes in each pool, and the budget counts every
pool. On CPU the pools are allocated zeroed up front, so they are resident memory from the start
and `draftwise serve` prints their size: the budget is chosen in bytes, as vLLM does
(`VLLM_CPU_KVCACHE_SPACE` on CPU, `--gpu-memory-utilization` on GPUs), and the pools are not
committed lazily as blocks are used, because the prefix cache keeps freed blocks and takes fresh
ones first (kv/block_pool.py): under varied traffic every block is written within minutes, so a
lazy pool would only postpone the same resident size.

- `kv_cache_memory` given ("2GiB", "512MB", or bytes): that many bytes' worth of blocks.
- otherwise the default budget: `max(512 MiB, half the models' weight bytes)`, at most half the
  memory the machine has available now, and never more than the token rule (`max_num_seqs` full
  contexts, capped at `kv_cache_max_tokens`). E.g. SmolLM2-135M in float32 (46 KB of K/V per
  token): 512 MiB, about 11.6K tokens; the Qwen2.5-Coder pair kept quantized (1.83 GiB of weights,
  68 KB of K/V per token: the target's float32, the draft's bfloat16): 0.91 GiB, about 14K tokens.
- `num_kv_blocks` given: that many blocks (tests, and callers that count tokens).

The context: when no `max_model_len` was asked for and the pools cannot hold one full context of
the model's own length (32768 tokens for Qwen2.5-Coder, 2.1 GiB of K/V for the pair), the
context becomes what the pools hold, as llama.cpp fits its context to memory, but not below
`MIN_CONTEXT` tokens (the default budget grows to hold that; a stated one that cannot is an
error). An asked-for `max_model_len` is kept: the default budget grows to hold one full context,
a stated budget or block count that cannot is a one-line error.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

GIB = 1 << 30
DEFAULT_FLOOR = 512 << 20  # the default budget is at least this
WEIGHTS_SHARE = 0.5  # ... or this share of the weights' bytes (the Qwen pair then serves within 4 GB)
MIN_CONTEXT = 4096  # a context fitted to the pools is at least this long (llama.cpp's default context)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


@dataclass(frozen=True)
class KVPlan:
    """What `plan_kv` chose: blocks per pool (the cross-vocabulary draft's: times its factor), the
    context length they hold, and why."""

    num_blocks: int
    block_size: int
    max_model_len: int
    bytes_per_token: int  # across every pool
    source: str  # "default", "kv_cache_memory" or "num_kv_blocks"
    model_len: int  # the context the models (or max_model_len) allow, before fitting

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token

    def describe(self) -> str:
        """One line for a server's start: the memory, the tokens, the context."""
        tokens = self.num_blocks * self.block_size
        why = {"default": "default budget: see --kv-cache-memory", "kv_cache_memory": "--kv-cache-memory",
               "num_kv_blocks": "--num-kv-blocks"}[self.source]
        fitted = (f" (the model's {self.model_len} does not fit; raise --kv-cache-memory or set --max-model-len)"
                  if self.max_model_len < self.model_len else "")
        return (f"K/V cache {format_bytes(self.nbytes)} ({why}): {tokens} tokens at {self.bytes_per_token} bytes "
                f"each; max model length {self.max_model_len}{fitted}")


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
    budget = max(DEFAULT_FLOOR, int(weight_bytes(models) * WEIGHTS_SHARE))
    free = available_memory()
    return min(budget, free // 2) if free else budget


def plan_kv(config, model_len: int, lookahead: int, pools) -> KVPlan:
    """The pools for an EngineConfig `config`. `model_len`: the longest context the models allow
    (and `config.max_model_len`, if given); `lookahead`: the tokens a step may add beyond it;
    `pools`: (LoadedModel, factor) for each model that keeps a pool, factor = its blocks per
    block of the target's."""
    bs = config.block_size
    per_token = sum(kv_bytes_per_token([m]) * factor for m, factor in pools)
    floor = model_len if config.max_model_len is not None else min(model_len, MIN_CONTEXT)
    need = -(-(floor + lookahead) // bs)  # blocks for one context of the shortest length allowed
    if config.num_kv_blocks is not None:
        blocks, source = config.num_kv_blocks, "num_kv_blocks"
        if blocks < need:
            raise ValueError(f"num_kv_blocks must be >= {need} to hold one full context, got {blocks}")
    elif config.kv_cache_memory is not None:
        budget, source = parse_memory(config.kv_cache_memory), "kv_cache_memory"
        blocks = budget // (per_token * bs)
        if blocks < need:
            raise ValueError(
                f"kv_cache_memory {format_bytes(budget)} is too small: one full context ({floor + lookahead} tokens "
                f"at {per_token} bytes each) needs {format_bytes(need * bs * per_token)}; raise "
                f"--kv-cache-memory or lower the maximum model length (max_model_len)"
            )
    else:
        context = model_len + lookahead
        tokens = min(config.max_num_seqs * context, max(config.kv_cache_max_tokens, context))
        budget_blocks = default_kv_memory([m for m, _ in pools]) // (per_token * bs)
        blocks, source = max(min(math.ceil(tokens / bs), budget_blocks), need), "default"
    return KVPlan(blocks, bs, min(model_len, blocks * bs - lookahead), per_token, source, model_len)
