"""Model shapes of the shipped pair and the HF-style Llama config dicts built from them."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..model.config import ModelConfig
from ..model.llama import LlamaModel

# ~20M parameters: the small end of 20-40M, because training is compute-bound on 2 CPU cores.
TARGET = dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
              head_dim=64, intermediate_size=1152, tie_word_embeddings=False)
# ~2.5M parameters (<= 1/8 of the target): shallow and narrow, tied embeddings, so a draft step
# costs a small fraction of a target step.
DRAFT = dict(hidden_size=160, num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=1,
             head_dim=32, intermediate_size=480, tie_word_embeddings=True)
TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, intermediate_size=64, tie_word_embeddings=True)
PRESETS = {"target": TARGET, "draft": DRAFT, "tiny": TINY}


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


def build_model(cfg_dict: dict, seed: int = 0, std: float = 0.02) -> LlamaModel:
    """A freshly initialised model (normal(0, std) weights, unit norms), seeded."""
    cfg = ModelConfig.from_dict(cfg_dict)
    torch.manual_seed(seed)
    model = LlamaModel(cfg)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            nn.init.normal_(p, 0.0, std)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.data.mul_(1.0 / (2 * cfg.num_hidden_layers) ** 0.5)
    return model


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
