"""The hybrid part of a Qwen3-Next `config.json` (`Qwen3NextForCausalLM`, dense MLP only).

Qwen3-Next interleaves gated-delta-rule layers ("linear_attention": a recurrent state per
sequence, no K/V) with full attention layers ("full_attention": paged K/V, as in Llama). This is
what `ModelConfig.hybrid` holds for such a model; the attention fields (heads, head_dim, rope)
stay in `ModelConfig`. Mixture-of-experts checkpoints (`num_experts > 0`) are refused.
"""
from __future__ import annotations

from dataclasses import dataclass


class HybridConfigError(ValueError):
    """A hybrid config field that cannot be used; the message names it."""


@dataclass(frozen=True)
class HybridSpec:
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention", one per layer
    conv_kernel: int  # the short causal convolution's width K (the state keeps K - 1 inputs)
    num_k_heads: int  # query/key heads of the recurrence
    num_v_heads: int  # value heads (a multiple of num_k_heads; each k head serves a group)
    k_head_dim: int
    v_head_dim: int
    rotary_dim: int  # RoPE on the first rotary_dim dims of each attention head (partial rotary)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:  # channels of the convolution: q, k and v
        return 2 * self.key_dim + self.value_dim

    @property
    def recurrent_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    def state_numel(self) -> tuple[int, int]:
        """Elements of one sequence's state per recurrent layer: (matrix, conv window)."""
        return self.num_v_heads * self.k_head_dim * self.v_head_dim, (self.conv_kernel - 1) * self.conv_dim

    @classmethod
    def from_dict(cls, cfg: dict, num_layers: int, head_dim: int, source: str) -> "HybridSpec":
        if int(cfg.get("num_experts", 0) or 0) > 0:
            raise HybridConfigError(f"{source}: field 'num_experts' is {cfg['num_experts']}: mixture-of-experts "
                                    "Qwen3-Next checkpoints are not supported (dense MLP only: num_experts 0)")
        types = cfg.get("layer_types")
        if types is None:
            interval = int(cfg.get("full_attention_interval", 4))
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
        types = tuple(types)
        if len(types) != num_layers or set(types) - {"linear_attention", "full_attention"}:
            raise HybridConfigError(f"{source}: field 'layer_types' must list 'linear_attention' or "
                                    f"'full_attention' for each of the {num_layers} layers")
        if cfg.get("hidden_act", "silu") != "silu":
            raise HybridConfigError(f"{source}: field 'hidden_act' {cfg['hidden_act']!r} is not supported (silu)")
        rope = cfg.get("rope_parameters") or {}
        factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
        k_heads = int(cfg.get("linear_num_key_heads", 16))
        v_heads = int(cfg.get("linear_num_value_heads", 32))
        if v_heads % k_heads:
            raise HybridConfigError(f"{source}: 'linear_num_value_heads' ({v_heads}) must be a multiple of "
                                    f"'linear_num_key_heads' ({k_heads})")
        return cls(types, int(cfg.get("linear_conv_kernel_dim", 4)), k_heads, v_heads,
                   int(cfg.get("linear_key_head_dim", 128)), int(cfg.get("linear_value_head_dim", 128)),
                   int(head_dim * factor))
