"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) in plain PyTorch.

Module and parameter names mirror Hugging Face's `LlamaForCausalLM`, so a checkpoint's
state dict loads without renaming. Two entry points share the weights:

- `forward(input_ids, positions, kv_cache, meta)`: inference over a padded batch `[B, T]` that
  reads and writes the paged K/V cache (see `model/attention.py`); returns hidden states. It
  needs a model prepared by `fuse_projections()` (load_model does it): fused q/k/v and gate/up,
  weights packed for the CPU product kernels (`PackedLinear`, packed_weights.py), and each
  layer's projections gathered in a `LayerWeights` that the functional `paged_layer` reads
  without module calls. On the CPU, with the C kernels built, it runs their fused path
  (`NativeForward`, native_forward.py).
- `forward(input_ids)` with no cache: full causal attention through the modules, used by
  training and scoring (prepared or not).

`compute_logits(hidden)` applies the final projection only where the caller needs logits.
References: Touvron et al. 2023 (Llama), Su et al. 2021 (RoPE), HF transformers modeling_llama.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import AttentionMetadata, paged_attention, sdpa
from .config import ModelConfig
from .head_precision import refine_top_logits
from .native_forward import NativeForward
from .packed_weights import PACK_MIN_NUMEL, PackedEmbedding, PackedLinear
from .packed_weights import native_gemm_wanted  # noqa: F401  (imported from here by benchmarks/native_gemm.py)
from .quantize import GROUP, Int4Linear, Int8Linear, check_method, common_blocks, float_weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x, weight, eps: float):  # HF semantics: normalise in float32, cast back, then scale
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # one fused call instead of several
        return torch.rms_norm(x, x.shape[-1:], weight, eps)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if not s:
        return inv
    if s["rope_type"] == "linear":
        return inv / float(s["factor"])
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between
    factor = float(s["factor"])
    lo, hi = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old = float(s.get("original_max_position_embeddings", 8192))
    lo_wavelen, hi_wavelen = old / lo, old / hi
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > lo_wavelen, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < hi_wavelen) & ~(wavelen > lo_wavelen)
    return torch.where(medium, smoothed, scaled)



# --quantization int8 quantizes the projections of at least this many elements (and the LM head):
# smaller ones cost their call, not their bytes (the embedded draft: only its head becomes int8)
QUANT_MIN_NUMEL = PACK_MIN_NUMEL


def apply_rope(x, cos, sin_signed):
    """RoPE on `[..., D]`: `x * cos + rotate_half(x) * sin`, where rotate_half(x) = (-x2, x1) is
    computed as roll(x, D/2) * (-1, +1) with the sign folded into `sin_signed` (bitwise the same)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, Hkv, D, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(h, H * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, Hkv * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, Hkv * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * D, h, bias=cfg.attention_bias and cfg.arch != "qwen2")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.scale = D ** -0.5

    def forward(self, x, cos, sin):  # no cache: training and scoring (inference: `paged_layer`)
        B, T, _ = x.shape
        cfg = self.cfg
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if hasattr(self, "qkv_proj"):  # prepared for inference: one matmul instead of three
            qkv = self.qkv_proj(x).view(B, T, H + 2 * Hkv, D)
            q, k, v = qkv.split([H, Hkv, Hkv], dim=2)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k, v = q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # RoPE on q and k heads together: [B, T, H + Hkv, D] (positions broadcast over heads)
        qk = apply_rope(torch.cat((q, k), dim=2), cos, sin).to(x.dtype)
        q, k, v = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), v.transpose(1, 2)
        mask = None
        if cfg.sliding_window is not None and T > cfg.sliding_window:
            i = torch.arange(T, device=x.device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - cfg.sliding_window)
        y = sdpa(q, k, v, mask, self.scale, is_causal=mask is None)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1).to(x.dtype))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)

    def forward(self, x):
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LayerWeights(NamedTuple):
    """One prepared decoder layer, read directly by `paged_layer` (no module calls: their dispatch
    is a noticeable share of a small model's step). Projections are `PackedLinear.forward`."""

    ln1: torch.Tensor
    qkv: Callable[[torch.Tensor], torch.Tensor]  # [.., hidden] -> [.., (H + 2 Hkv) * D]
    o: Callable[[torch.Tensor], torch.Tensor]
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    ln2: torch.Tensor
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]

    @staticmethod
    def of(layer: "DecoderLayer") -> "LayerWeights":
        a, m = layer.self_attn, layer.mlp
        return LayerWeights(
            layer.input_layernorm.weight, a.qkv_proj.forward, a.o_proj.forward,
            a.q_norm.weight if hasattr(a, "q_norm") else None, a.k_norm.weight if hasattr(a, "k_norm") else None,
            layer.post_attention_layernorm.weight, m.gate_up_proj.forward, m.down_proj.forward,
        )


def paged_layer(x, w: LayerWeights, cfg: ModelConfig, cos, sin, layer_cache, meta: AttentionMetadata):
    """One decoder layer over the paged K/V cache (inference): the same computation as
    `DecoderLayer.forward`, with K/V written to and read from `layer_cache`."""
    B, T, _ = x.shape
    H, Hkv, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    qkv = w.qkv(rms_norm(x, w.ln1, eps)).view(B, T, H + 2 * Hkv, D)
    qk, v = qkv[:, :, : H + Hkv], qkv[:, :, H + Hkv :]  # q and k heads are adjacent
    if w.q_norm is not None:
        qk = torch.cat((rms_norm(qk[:, :, :H], w.q_norm, eps), rms_norm(qk[:, :, H:], w.k_norm, eps)), dim=2)
    qk = apply_rope(qk, cos, sin).to(x.dtype)
    y = paged_attention(qk[:, :, :H].transpose(1, 2), qk[:, :, H:], v, layer_cache, meta, D ** -0.5)
    x = x + w.o(y.transpose(1, 2).reshape(B, T, -1).to(x.dtype))
    gate, up = w.gate_up(rms_norm(x, w.ln2, eps)).chunk(2, dim=-1)
    return x + w.down(F.silu(gate) * up)


class LlamaModel(NativeForward, nn.Module):
    """The causal LM: backbone, LM head and RoPE tables; its fused CPU path is `NativeForward`'s."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.plan: list[LayerWeights] | None = None  # set by fuse_projections (inference)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # see rope()
        self._decoder_plan = None  # see _layer_pointers
        self._io = None  # see _native_io
        self._fit: tuple | None = None  # (kv cache key, _kernels_fit's answer for it)
        self.head_rows: torch.Tensor | None = None  # the head's weight once packed (refine_top_logits)
        self.refine_head = True  # bfloat16 heads: the top logits recomputed in float32 (head_precision.py)

    def rope(self, positions: torch.Tensor, max_position: int | None = None):
        """positions [B, T] -> cos, sin_signed [B, T, 1, D] (float32; see `apply_rope`).

        With `max_position` (an upper bound the caller knows, e.g. the longest sequence) the rows
        come from a table of positions 0..n-1 grown by doubling: two lookups instead of nine ops
        per forward (the same formula; vectorised sin/cos may round the last bit differently)."""
        if max_position is None:
            return self._rope_rows(positions)
        cos, sin = self.rope_table(max_position, positions.device)
        return cos[positions][:, :, None], sin[positions][:, :, None]

    def rope_table(self, max_position: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed for positions 0..n-1 (n > max_position), float32 `[n, D]`, contiguous."""
        if self._rope_table is None or self._rope_table[0].shape[0] <= max_position:
            n = 1 << max(6, max_position.bit_length())
            cos, sin = self._rope_rows(torch.arange(n, device=device)[None])
            self._rope_table = (cos[0, :, 0].contiguous(), sin[0, :, 0].contiguous())
        return self._rope_table

    def _rope_rows(self, positions: torch.Tensor):
        freqs = positions.float()[..., None] * self.inv_freq.float()  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return emb.cos()[:, :, None], sin[:, :, None]

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor | None = None,  # [B, T]
        kv_cache: torch.Tensor | None = None,  # [layers, 2, num_slots, Hkv, D]
        meta: AttentionMetadata | None = None,
        max_position: int | None = None,  # an upper bound of `positions`, if known (see rope)
        feature_layers: tuple[int, ...] = (),  # layers whose outputs a feature-reading drafter needs
    ):  # hidden [B, T, hidden]; with feature_layers (hidden, features [B, T, len(feature_layers) * hidden])
        """`feature_layers`: also return the residual stream after each listed decoder layer (0-based;
        Hugging Face's `hidden_states[i + 1]`), concatenated: the features a DSpark drafter reads
        (model/dspark.py). Empty (the default) costs nothing."""
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        if (kv_cache is not None and self.plan is not None and input_ids.device.type == "cpu"
                and self._fusable(*input_ids.shape, kv_cache, meta)):
            return self._fused_forward(input_ids, positions, kv_cache, meta, max_position, feature_layers)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, max_position)
        taps = []
        if kv_cache is None:
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin)
                if i in feature_layers:
                    taps.append(x)
            return self.model.norm(x) if not feature_layers else (self.model.norm(x), torch.cat(taps, -1))
        if self.plan is None:
            raise RuntimeError("a forward over the paged K/V cache needs a model prepared for inference "
                               "(fuse_projections(); load_model does it)")
        for i, w in enumerate(self.plan):
            x = paged_layer(x, w, self.cfg, cos, sin, kv_cache[i], meta)
            if i in feature_layers:
                taps.append(x)
        h = rms_norm(x, self.model.norm.weight, self.cfg.rms_norm_eps)
        return h if not feature_layers else (h, torch.cat(taps, -1))

    @torch.no_grad()
    def fuse_projections(self, quantization: str | None = None) -> "LlamaModel":
        """Prepare for inference: q/k/v and gate/up become one matmul each (fewer calls per
        layer), and every projection and the output layer become a `PackedLinear`, or with
        `quantization="int8"` an `Int8Linear` (quantize.py; the head's logits then stay float32;
        projections below QUANT_MIN_NUMEL stay float); with "int4" the projections an `Int4Linear`
        and the head int8.

        The result keeps its outputs but not Hugging Face parameter names: save unprepared models.
        """
        quantization = check_method(quantization)
        make, head = PackedLinear.of, PackedLinear.of
        if quantization is not None:
            def make(*lins):  # smaller weights stay float: see QUANT_MIN_NUMEL
                big = sum(lin.weight.numel() for lin in lins) >= QUANT_MIN_NUMEL
                biases = [lin.bias.detach() for lin in lins] if lins[0].bias is not None else None
                if not big:
                    return PackedLinear([float_weight(lin) for lin in lins], biases)
                stored = common_blocks(lins)  # a GGUF's blocks, kept (loader.py)
                if stored is not None:
                    kind, blocks = stored
                    if kind == "int8":
                        return Int8Linear([], biases, blocks=blocks)
                    subscales = [getattr(lin, "q4k_subscales", None) for lin in lins]  # Q4_K's (loader.py)
                    return Int4Linear([], biases, blocks=blocks,
                                      subscales=subscales if all(s is not None for s in subscales) else None)
                if quantization == "int4" and lins[0].weight.shape[1] % GROUP == 0:
                    return Int4Linear.of(*lins)
                return Int8Linear.of(*lins)  # (int4: inputs not in whole groups stay int8)

            head = lambda lin: Int8Linear.of(lin, float_out=True)  # noqa: E731
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            a.qkv_proj = make(a.q_proj, a.k_proj, a.v_proj)
            del a.q_proj, a.k_proj, a.v_proj
            a.o_proj = make(a.o_proj)
            m.gate_up_proj = make(m.gate_proj, m.up_proj)
            del m.gate_proj, m.up_proj
            m.down_proj = make(m.down_proj)
        # the head's rows for refine_top_logits (the embeddings when tied: no copy); none for an
        # int8 head, whose logits are float32 already
        self.head_rows = self.lm_head.weight.detach() if quantization is None else None
        tied = self.lm_head.weight is getattr(self.model.embed_tokens, "weight", None)
        self.lm_head = head(self.lm_head)  # a copy when tied to the embeddings
        if tied and getattr(self.lm_head, "native", None) is not None and self.lm_head.native.dtype == torch.float32:
            # float32 (the only dtype dw_gemm_f32 packs): no refine_top_logits, and the input
            # embedding reads the head's packed copy: one copy of the matrix instead of two
            self.model.embed_tokens, self.head_rows = PackedEmbedding(self.lm_head.native), None
        self.plan = [LayerWeights.of(layer) for layer in self.model.layers]
        self._decoder_plan = self._io = None  # the kernels' pointers: found again on first use
        return self

    def _apply(self, fn, *args, **kwargs):
        if self.plan is not None:  # packed weights are not parameters: they would not follow
            raise RuntimeError("move or cast a model before fuse_projections(), not after")
        return super()._apply(fn, *args, **kwargs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V] float32
        if hidden.dtype == torch.bfloat16 and self.refine_head:
            # a bfloat16 head in dw_gemm_bf16's packing: every logit a float32 sum, not rounded to
            # bfloat16 (what refine_top_logits recomputes for the top ones, for all of them)
            exact = getattr(self.lm_head, "float_logits", None)
            logits = exact(hidden) if exact is not None else None
            if logits is not None:
                return logits
        logits = self.lm_head(hidden).float()
        if hidden.dtype == torch.bfloat16 and self.refine_head and self.head_rows is not None:
            flat = refine_top_logits(logits.view(-1, logits.shape[-1]), hidden.reshape(-1, hidden.shape[-1]),
                                     self.head_rows)
            logits = flat.view(logits.shape)
        return logits

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full causal forward without cache: `[B, T] -> [B, T, vocab]` (training, scoring)."""
        return self.compute_logits(self.forward(input_ids))
