"""Model shapes of the shipped pair and the HF-style config dicts built from them (Llama; and the
Qwen3-Next-style hybrid target, `--arch hybrid`: gated-delta-rule layers with one attention layer
in four, as in Qwen3-Next)."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..model.config import ModelConfig
from ..model.llama import LlamaModel
from ..model.loader import model_class

# ~20M parameters: the small end of 20-40M, because training is compute-bound on 2 CPU cores.
TARGET = dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
              head_dim=64, intermediate_size=1152, tie_word_embeddings=False)
# ~2.5M parameters (<= 1/8 of the target): shallow and narrow, tied embeddings, so a draft step
# costs a small fraction of a target step.
DRAFT = dict(hidden_size=160, num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=1,
             head_dim=32, intermediate_size=480, tie_word_embeddings=True)
# ~16M parameters for a large-vocabulary chat target (SmolLM2-135M: 49152 tokens): the tied
# 49152 x 256 embedding is most of it; a step costs ~12% of SmolLM2's.
DRAFT_WIDE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, intermediate_size=768, tie_word_embeddings=True)
TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, intermediate_size=64, tie_word_embeddings=True)
PRESETS = {"target": TARGET, "draft": DRAFT, "draft-wide": DRAFT_WIDE, "tiny": TINY}
# The hybrid target: the target's width and depth, layers 4 and 8 full attention (gated, partial
# RoPE), the other six gated delta rule (3 key heads, 6 value heads of 64); ~21.6M parameters.
HYBRID = dict(TARGET, linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=64,
              linear_value_head_dim=64, linear_conv_kernel_dim=4,
              layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"])


def llama_config(shape: dict, vocab_size: int, eos_token_id: int, bos_token_id: int | None = None,
                 max_position_embeddings: int = 1024) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": eos_token_id if bos_token_id is None else bos_token_id,
        "eos_token_id": eos_token_id,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        **shape,
    }


def hybrid_config(shape: dict, vocab_size: int, eos_token_id: int, max_position_embeddings: int = 1024) -> dict:
    """A `Qwen3NextForCausalLM` config (dense MLP: num_experts 0) for `shape` (e.g. HYBRID)."""
    cfg = llama_config(shape, vocab_size, eos_token_id, max_position_embeddings=max_position_embeddings)
    cfg.update(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", num_experts=0, mlp_only_layers=[],
               rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.25})
    del cfg["rope_theta"], cfg["mlp_bias"]
    return cfg


def build_model(cfg_dict: dict, seed: int = 0, std: float = 0.02) -> nn.Module:
    """A freshly initialised model (normal(0, std) weights, unit norms), seeded. Hybrid models keep
    PyTorch's default init for the short convolution and draw their decay rates A from U(1, 16)."""
    cfg = ModelConfig.from_dict(cfg_dict)
    torch.manual_seed(seed)
    model = model_class(cfg)(cfg)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.data.copy_(torch.empty_like(p).uniform_(1.0, 16.0).log())
        if p.dim() >= 2 and "conv1d" not in name:
            nn.init.normal_(p, 0.0, std)
            if name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
                p.data.mul_(1.0 / (2 * cfg.num_hidden_layers) ** 0.5)
    return model


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
