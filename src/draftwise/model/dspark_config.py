"""DSparkConfig: the `config.json` of a DSpark drafter directory (model/dspark.py).

A drafter directory sits beside its target and names it: `target` (a path, relative to the
drafter's directory when it is), the target layers whose outputs it reads (`target_feature_layers`,
0-based decoder layers; the residual stream after that layer, Hugging Face's `hidden_states[i + 1]`),
the block size gamma (one forward drafts gamma tokens), the Markov head's rank and the backbone's
shape. The width is the target's: the drafter reads the target's embeddings and LM head.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .config import ModelConfig, ModelLoadError
from .dspark_heads import HEAD_TYPES

ARCHITECTURE = "DSparkDrafter"


def default_feature_layers(num_layers: int) -> list[int]:
    """A low, a middle and a high layer (DSpark reads 5 of Qwen3-4B's 36, the last 3 before the
    top) and the last one (EAGLE's feature: what the target's head reads): 1, L/2, L-2, L-1 where
    the target is deep enough, fewer distinct ones below 4 layers. L-2 is kept for
    `init_from_target_layer` (the layer after it is the drafter's first)."""
    low = 1 if num_layers > 2 else 0
    return sorted({low, num_layers // 2, max(num_layers - 2, 0), num_layers - 1})


def config_from_dict(cls, architecture: str, d):
    """A feature drafter's config (DSparkConfig, Eagle3Config: dataclasses with `extra` and `check`)
    from config.json's object: its architecture checked, the required fields present, unknown
    fields kept in `extra`; else a ModelLoadError naming what is wrong."""
    if not isinstance(d, dict) or d.get("architectures") != [architecture]:
        got = d.get("architectures") if isinstance(d, dict) else d
        raise ModelLoadError(f"config.json 'architectures': expected [{architecture!r}], got {got!r}")
    known = set(cls.__dataclass_fields__) - {"extra"}
    missing = [k for k in ("vocab_size", "hidden_size", "target_feature_layers") if k not in d]
    if missing:
        raise ModelLoadError(f"config.json: field {missing[0]!r} missing")
    args = {k: v for k, v in d.items() if k in known}
    extra = {k: v for k, v in d.items() if k not in known and k not in ("architectures", "model_type")}
    return cls(**args, extra=extra).check()


def config_from_dir(cls, path: str | Path):
    """`config_from_dict` of DIR/config.json; an unreadable file is a ModelLoadError."""
    f = Path(path) / "config.json"
    try:
        return cls.from_dict(json.loads(f.read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{f}: unreadable ({e})") from None


def check_fits_target(vocab_size: int, hidden_size: int, layers: list[int], tcfg: ModelConfig) -> None:
    """A drafter on a target's features (DSpark, EAGLE-3) shares its vocabulary and width and reads
    layers it has: else a ModelLoadError naming the difference."""
    if (tcfg.vocab_size, tcfg.hidden_size) != (vocab_size, hidden_size):
        raise ModelLoadError(f"drafter vocab/hidden {vocab_size}/{hidden_size} differ from the "
                             f"target's {tcfg.vocab_size}/{tcfg.hidden_size}")
    if layers[-1] >= tcfg.num_hidden_layers:
        raise ModelLoadError(f"config.json 'target_feature_layers' {layers}: the target has "
                             f"{tcfg.num_hidden_layers} layers")


def default_markov_rank(hidden_size: int) -> int:
    """DSpark's rank is 256 for 2560-4096-wide targets; a narrow target gets hidden/4 (the toy: 96)."""
    return min(256, max(8, hidden_size // 4))


@dataclass
class DSparkConfig:
    vocab_size: int
    hidden_size: int  # = the target's (shared embeddings and head)
    target_feature_layers: list[int]
    block_size: int = 5  # gamma: tokens drafted by one forward
    markov_rank: int = 96
    markov_head_type: str = "vanilla"  # the sequential stage: vanilla, gated, rnn or mlp (model/dspark_heads.py)
    num_hidden_layers: int = 1
    # each block row's input is fc_in([fused feature of position a-1 ; the row's embedding]) (EAGLE's
    # input), not its embedding alone; False: directories written before this field
    anchor_feature: bool = False
    # a block row attends the block's rows up to its own (not the whole block): row 1 alone equals row 1
    # of a block, so training may add rows at block position 1 alone; False: directories written before
    causal_block: bool = False
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    target: str = ""  # the target's directory (informational; the caller loads the pair)
    draft_vocab: int = 0  # trained to draft over these many of the target's tokens (0: all); ids in the weights
    # Sequential Temperature Scaling (train/dspark_calibration.py): c_k = sigmoid(logit_k / T_k); empty: 1
    confidence_temperatures: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # unknown keys, kept on a round trip

    @staticmethod
    def for_target(tcfg: ModelConfig, block_size: int = 5, markov_rank: int | None = None,
                   feature_layers: list[int] | None = None, num_layers: int = 1, target: str = "",
                   anchor_feature: bool = True, markov_head_type: str = "vanilla",
                   causal_block: bool = False) -> "DSparkConfig":
        """A drafter shaped after one of the target's layers (its heads, its MLP width)."""
        return DSparkConfig(
            vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size,
            target_feature_layers=list(feature_layers or default_feature_layers(tcfg.num_hidden_layers)),
            block_size=block_size, markov_rank=markov_rank or default_markov_rank(tcfg.hidden_size),
            markov_head_type=markov_head_type, causal_block=causal_block,
            num_hidden_layers=num_layers, anchor_feature=anchor_feature, num_attention_heads=tcfg.num_attention_heads,
            num_key_value_heads=tcfg.num_key_value_heads, head_dim=tcfg.head_dim,
            intermediate_size=tcfg.intermediate_size, rms_norm_eps=tcfg.rms_norm_eps, rope_theta=tcfg.rope_theta,
            max_position_embeddings=tcfg.max_position_embeddings, target=target)

    def check(self, tcfg: ModelConfig | None = None) -> "DSparkConfig":
        layers = self.target_feature_layers
        if not layers or layers != sorted(set(layers)) or layers[0] < 0:
            raise ModelLoadError(f"config.json 'target_feature_layers': strictly increasing layer ids >= 0, "
                                 f"got {layers}")
        if self.block_size < 1 or self.markov_rank < 0 or self.num_hidden_layers < 1:
            raise ModelLoadError("config.json: 'block_size' and 'num_hidden_layers' must be >= 1, "
                                 "'markov_rank' >= 0")
        if self.markov_head_type not in HEAD_TYPES:
            raise ModelLoadError(f"config.json 'markov_head_type': one of {', '.join(HEAD_TYPES)}, "
                                 f"got {self.markov_head_type!r}")
        for name in ("anchor_feature", "causal_block"):
            if not isinstance(getattr(self, name), bool):
                raise ModelLoadError(f"config.json {name!r}: true or false, got {getattr(self, name)!r}")
        dv = self.draft_vocab
        if not isinstance(dv, int) or isinstance(dv, bool) or dv < 0 or (dv and dv > self.vocab_size):
            raise ModelLoadError(f"config.json 'draft_vocab': an integer from 0 (the whole vocabulary) to "
                                 f"vocab_size {self.vocab_size}, got {dv!r}")
        temps = self.confidence_temperatures
        if temps and (len(temps) != self.block_size or not all(t > 0 for t in temps)):
            raise ModelLoadError(f"config.json 'confidence_temperatures': {self.block_size} positive numbers "
                                 f"(one per block position) or none, got {temps}")
        if tcfg is not None:
            check_fits_target(self.vocab_size, self.hidden_size, layers, tcfg)
        return self

    def to_dict(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        return {"architectures": [ARCHITECTURE], "model_type": "dspark", **d, **extra}

    @staticmethod
    def from_dict(d: dict) -> "DSparkConfig":
        return config_from_dict(DSparkConfig, ARCHITECTURE, d)

    @staticmethod
    def from_dir(path: str | Path) -> "DSparkConfig":
        return config_from_dir(DSparkConfig, path)
