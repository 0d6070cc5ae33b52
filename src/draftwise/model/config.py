"""Model configuration: the subset of a Hugging Face `config.json` the Llama-family runner needs.

Supported `architectures`: LlamaForCausalLM (Llama 2/3, incl. rope_scaling `llama3`),
MistralForCausalLM, Qwen2ForCausalLM (q/k/v bias), Qwen3ForCausalLM (q/k RMSNorm).
Both the transformers 4.x keys (`rope_theta`, `rope_scaling`) and the 5.x key
(`rope_parameters`) are understood.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .hybrid_config import HybridConfigError, HybridSpec

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3NextForCausalLM": "qwen3_next",  # hybrid: gated delta rule + attention (model/hybrid.py)
}


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded; the message names the file and the field."""


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    hybrid: HybridSpec | None = None  # Qwen3-Next: recurrent layers beside attention (hybrid_config.py)
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch_name = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch_name is None:
            raise ModelLoadError(
                f"{source}: field 'architectures' is {archs!r}; supported: "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        arch = SUPPORTED_ARCHITECTURES[arch_name]

        def need(key):
            if key not in cfg:
                raise ModelLoadError(f"{source}: required field '{key}' is missing")
            return cfg[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelLoadError(
                f"{source}: 'num_attention_heads' ({heads}) must be a multiple of "
                f"'num_key_value_heads' ({kv_heads})"
            )
        rope = cfg.get("rope_parameters") or {}
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling")
        if not scaling and rope and rope.get("rope_type", "default") != "default":
            scaling = rope
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "linear", "llama3"):
                raise ModelLoadError(
                    f"{source}: field 'rope_scaling' type {kind!r} is not supported "
                    "(supported: default, linear, llama3)"
                )
            scaling = None if kind == "default" else dict(scaling, rope_type=kind)
        eos = cfg.get("eos_token_id")
        eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        sliding = cfg.get("sliding_window")
        if arch in ("qwen2", "qwen3", "qwen3_next") and not cfg.get("use_sliding_window", False):
            sliding = None
        hybrid = None
        if arch == "qwen3_next":
            try:
                hybrid = HybridSpec.from_dict(cfg, int(need("num_hidden_layers")), head_dim, source)
            except HybridConfigError as e:
                raise ModelLoadError(str(e)) from None
        return cls(
            arch=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in ("qwen3", "qwen3_next"),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            hybrid=hybrid,
            raw=cfg,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        f = Path(path) / "config.json"
        if not f.is_file():
            raise ModelLoadError(f"{f}: file not found (a Hugging Face model directory needs config.json)")
        try:
            cfg = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{f}: not valid JSON ({e})") from None
        return cls.from_dict(cfg, source=str(f))

    def num_parameters(self) -> int:
        h, i, L, V = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        return V * h * (1 if self.tie_word_embeddings else 2) + L * per_layer + h
