"""Eagle3Config: the `config.json` of an EAGLE-3 drafter directory (model/eagle3.py).

Like a DSpark directory it sits beside its target and names it (`target`, informational), the
target layers whose outputs it reads (`target_feature_layers`, 0-based decoder layers: the residual
stream after that layer) and the shape of its one decoder layer; `steps` is how many autoregressive
draft steps training-time test unrolled (inference may draft more: each further step feeds the
drafter's own output again). The width is the target's: the drafter reads the target's embeddings,
final norm and LM head.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from .config import ModelConfig, ModelLoadError
from .dspark_config import check_fits_target, config_from_dict, config_from_dir, default_feature_layers

ARCHITECTURE = "Eagle3Drafter"


@dataclass
class Eagle3Config:
    vocab_size: int
    hidden_size: int  # = the target's (shared embeddings, final norm and head)
    target_feature_layers: list[int]
    steps: int = 5  # draft steps unrolled in training (training-time test)
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    target: str = ""  # the target's directory (informational; the caller loads the pair)
    draft_vocab: int = 0  # trained to draft over these many of the target's tokens (0: all); ids in the weights
    extra: dict = field(default_factory=dict)  # unknown keys, kept on a round trip

    @property
    def num_hidden_layers(self) -> int:
        """The drafter's decoder layers (EAGLE-3's one): what a K/V pool sizes by."""
        return 1

    @staticmethod
    def for_target(tcfg: ModelConfig, steps: int = 5, feature_layers: list[int] | None = None,
                   target: str = "") -> "Eagle3Config":
        """A drafter shaped after one of the target's layers (its heads, its MLP width)."""
        return Eagle3Config(
            vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size,
            target_feature_layers=list(feature_layers or default_feature_layers(tcfg.num_hidden_layers)),
            steps=steps, num_attention_heads=tcfg.num_attention_heads, num_key_value_heads=tcfg.num_key_value_heads,
            head_dim=tcfg.head_dim, intermediate_size=tcfg.intermediate_size, rms_norm_eps=tcfg.rms_norm_eps,
            rope_theta=tcfg.rope_theta, max_position_embeddings=tcfg.max_position_embeddings, target=target)

    def check(self, tcfg: ModelConfig | None = None) -> "Eagle3Config":
        layers = self.target_feature_layers
        if (not isinstance(layers, list) or not layers or not all(isinstance(i, int) for i in layers)
                or layers != sorted(set(layers)) or layers[0] < 0):
            raise ModelLoadError(f"config.json 'target_feature_layers': strictly increasing layer ids >= 0, "
                                 f"got {layers}")
        for name in ("steps", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ModelLoadError(f"config.json {name!r}: an integer >= 1, got {v!r}")
        dv = self.draft_vocab
        if not isinstance(dv, int) or isinstance(dv, bool) or dv < 0 or (dv and dv > self.vocab_size):
            raise ModelLoadError(f"config.json 'draft_vocab': an integer from 0 (the whole vocabulary) to "
                                 f"vocab_size {self.vocab_size}, got {dv!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(f"config.json: num_attention_heads {self.num_attention_heads} is not a multiple "
                                 f"of num_key_value_heads {self.num_key_value_heads}")
        if tcfg is not None:
            check_fits_target(self.vocab_size, self.hidden_size, layers, tcfg)
        return self

    def to_dict(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        return {"architectures": [ARCHITECTURE], "model_type": "eagle3", **d, **extra}

    @staticmethod
    def from_dict(d: dict) -> "Eagle3Config":
        return config_from_dict(Eagle3Config, ARCHITECTURE, d)

    @staticmethod
    def from_dir(path: str | Path) -> "Eagle3Config":
        return config_from_dir(Eagle3Config, path)
