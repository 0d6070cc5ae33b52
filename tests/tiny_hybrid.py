"""Tiny random Qwen3-Next-style hybrid checkpoints (gated delta rule + attention, dense MLP) for
tests, written in Hugging Face format by draftwise's own module (transformers loads them too)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from draftwise.model import ModelConfig, save_model
from draftwise.model.hybrid import HybridModel
from tiny_models import make_tokenizer


def hybrid_config(vocab_size=320, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, inter=128, max_pos=512,
                  layer_types=("linear_attention", "linear_attention", "full_attention", "linear_attention"),
                  **extra) -> dict:
    cfg = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False,
        "eos_token_id": 0,
        "hidden_act": "silu",
        "layer_types": list(layer_types),
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 0,
        "mlp_only_layers": [],
    }
    cfg.update(extra)
    return cfg


def make_hybrid_dir(path: Path, seed: int = 0, tokenizer=None, init_std: float = 0.5, **cfg_kwargs) -> Path:
    path = Path(path)
    tokenizer = tokenizer or make_tokenizer()
    cfg_kwargs.setdefault("vocab_size", tokenizer.get_vocab_size())
    torch.manual_seed(seed)
    cfg = ModelConfig.from_dict(hybrid_config(**cfg_kwargs))
    model = HybridModel(cfg)
    with torch.no_grad():  # spread the logits (greedy near-ties are rare) and move every parameter off its init
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "conv1d" not in name:
                p.normal_(0.0, init_std / p.shape[1] ** 0.5)
            elif "conv1d" in name:
                p.normal_(0.0, 0.5)
            elif name.endswith("A_log"):
                p.uniform_(-2.0, 0.5)  # decays exp(g) spread over (0, 1)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    save_model(model, path, dtype=torch.float32)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    return path
