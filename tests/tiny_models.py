"""Tiny random Llama-family checkpoints for tests, written in Hugging Face format."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from draftwise.model import LlamaModel, ModelConfig, save_model

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i)\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n",
] * 20


def make_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"]
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def llama_config(vocab_size=320, hidden=64, layers=2, heads=4, kv_heads=2, inter=128, max_pos=256, **extra) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": 0,
        "bos_token_id": None,
        "hidden_act": "silu",
    }
    cfg.update(extra)
    return cfg


def make_model_dir(path: Path, seed: int = 0, tokenizer=None, init_std: float = 0.5, perturb: float = 0.0,
                   **cfg_kwargs) -> Path:
    """`perturb` > 0: the seed's weights plus that fraction of noise (a drafter that agrees with the
    same seed's target often, not always)."""
    path = Path(path)
    tokenizer = tokenizer or make_tokenizer()
    cfg_kwargs.setdefault("vocab_size", tokenizer.get_vocab_size())
    torch.manual_seed(seed)
    cfg = ModelConfig.from_dict(llama_config(**cfg_kwargs))
    model = LlamaModel(cfg)
    with torch.no_grad():  # spread the logits so greedy near-ties are rare
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, init_std / p.shape[1] ** 0.5)
        noise = torch.Generator().manual_seed(seed + 1000)
        for name, p in model.named_parameters():
            if perturb and p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=noise) * perturb * init_std / p.shape[1] ** 0.5)
    save_model(model, path, dtype=torch.float32)
    tok = tokenizer
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    return path


def runner_with_prompts(model, rows: int, prompt_len: int = 20):
    """A ModelRunner (64 blocks of 16) whose sequences 0..rows-1 have each prefilled a prompt of
    `prompt_len` copies of token 5 + b, with room for 20 more tokens: where greedy-step tests start."""
    from draftwise.model.runner import ModelRunner

    r = ModelRunner(model, 64, 16)
    for b in range(rows):
        r.kv.reserve(b, prompt_len + 20)
        r.run([b], [[5 + b] * prompt_len], [0], [1])
    return r
