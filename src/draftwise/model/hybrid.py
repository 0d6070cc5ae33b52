"""A Qwen3-Next-style hybrid decoder (dense MLP): gated-delta-rule layers interleaved with full
attention layers, in plain PyTorch.

Parameter names mirror Hugging Face's `Qwen3NextForCausalLM` (`num_experts = 0`), so its
checkpoints load without renaming and `save_model` writes directories transformers loads.
Conventions of that architecture, kept here:

- RMSNorm of the residual stream and of q/k heads scales by `(1 + weight)` (weights centred on 0);
  the gated norm after the recurrence scales by `weight` and multiplies by silu(z);
- attention: `q_proj` gives each head's query and an output gate (`[H, 2 D]`: query, then gate);
  q/k RMSNorm per head; RoPE on the first `rotary_dim` dims only (partial rotary); the attention
  output is multiplied by sigmoid(gate) before `o_proj`;
- linear attention (`GatedDeltaNet`): `in_proj_qkvz` grouped by key head ([q, k, v-group,
  z-group] per key head), `in_proj_ba` likewise ([b-group, a-group]); a depthwise causal
  convolution (width K, SiLU) over the q/k/v channels; beta = sigmoid(b),
  g = -exp(A_log) softplus(a + dt_bias); q, k L2-normalised; the rule in model/gated_delta.py.

Entry points as in `LlamaModel`: `forward(input_ids)` (no cache: training and scoring, every
recurrence from a zero state), and `forward(input_ids, positions, kv_cache, meta, max_position,
state)` over the paged K/V of the attention layers (`kv_cache` holds only those layers) and the
recurrent state pool (`state`, a `StateBatch`, see model/recurrent_state.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import AttentionMetadata, paged_attention, sdpa
from .config import ModelConfig
from .gated_delta import causal_conv, chunked_rule, l2norm, recurrent_rule
from .gated_delta_kernel import fused_recurrent_rule
from .llama import MLP, rms_norm
from .packed_weights import PackedLinear
from .recurrent_state import StateBatch

SEQUENTIAL_MAX_TOKENS = 16  # longer blocks without per-position states take the chunked rule


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), computed in float32 and cast back (Qwen3-Next)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        return offset_rms_norm(x, self.weight, self.eps)


def offset_rms_norm(x, weight, eps: float):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x, z, weight, eps: float):
    """Norm of the recurrence's output per value head, then times silu(z): x, z [..., dv]."""
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y * F.silu(z.float())).to(x.dtype)


def partial_rope(x, cos, sin):
    """RoPE on the first rotary_dim dims of `[..., D]` (cos / sin `[..., rotary_dim]`)."""
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    rot = torch.cat((-xr[..., r // 2 :], xr[..., : r // 2]), dim=-1)
    return torch.cat(((xr * cos + rot * sin).to(x.dtype), xp), dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, Hkv, D, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        b = cfg.attention_bias
        self.q_proj = nn.Linear(h, H * D * 2, bias=b)
        self.k_proj = nn.Linear(h, Hkv * D, bias=b)
        self.v_proj = nn.Linear(h, Hkv * D, bias=b)
        self.o_proj = nn.Linear(H * D, h, bias=b)
        self.q_norm = OffsetRMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(D, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv=None, meta: AttentionMetadata | None = None):
        """x [B, T, hidden]; cos / sin [B, T, 1, rotary_dim]; kv: this layer's `[2, slots, Hkv, D]`
        (None: causal attention over x alone)."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, Hkv, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        if hasattr(self, "qkv_proj"):
            qg, k, v = self.qkv_proj(x).split([2 * H * D, Hkv * D, Hkv * D], dim=-1)
        else:
            qg, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, gate = qg.view(B, T, H, 2 * D).chunk(2, dim=-1)  # [B, T, H, D] each
        q = partial_rope(offset_rms_norm(q, self.q_norm.weight, eps), cos, sin)
        k = partial_rope(offset_rms_norm(k.view(B, T, Hkv, D), self.k_norm.weight, eps), cos, sin)
        v = v.view(B, T, Hkv, D)
        if kv is None:
            y = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, D ** -0.5, is_causal=True)
        else:
            y = paged_attention(q.transpose(1, 2), k, v, kv, meta, D ** -0.5)
        y = y.transpose(1, 2).reshape(B, T, H * D).to(x.dtype)
        return self.o_proj(y * torch.sigmoid(gate.reshape(B, T, H * D)))


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hs = cfg.hybrid
        self.cfg, self.hs = cfg, hs
        h = cfg.hidden_size
        self.conv1d = nn.Conv1d(hs.conv_dim, hs.conv_dim, hs.conv_kernel, groups=hs.conv_dim, bias=False,
                                padding=hs.conv_kernel - 1)
        self.in_proj_qkvz = nn.Linear(h, 2 * hs.key_dim + 2 * hs.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(h, 2 * hs.num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(hs.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(hs.num_v_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(hs.v_head_dim))
        self.out_proj = nn.Linear(hs.value_dim, h, bias=False)

    def project(self, x):
        """x [B, T, hidden] -> conv inputs [B, T, C] (q, k, v channels), z [B, T, Hv, dv], b, a [B, T, Hv]."""
        hs = self.hs
        B, T, _ = x.shape
        Hk, dk, dv, grp = hs.num_k_heads, hs.k_head_dim, hs.v_head_dim, hs.num_v_heads // hs.num_k_heads
        if hasattr(self, "in_proj"):  # prepared: qkvz and ba in one product
            qkvz, ba = self.in_proj(x).split([2 * hs.key_dim + 2 * hs.value_dim, 2 * hs.num_v_heads], dim=-1)
        else:
            qkvz, ba = self.in_proj_qkvz(x), self.in_proj_ba(x)
        q, k, v, z = qkvz.view(B, T, Hk, 2 * dk + 2 * grp * dv).split([dk, dk, grp * dv, grp * dv], dim=-1)
        b, a = ba.view(B, T, Hk, 2 * grp).split([grp, grp], dim=-1)
        mixed = torch.cat((q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)), dim=-1)
        return mixed, z.reshape(B, T, hs.num_v_heads, dv), b.reshape(B, T, -1), a.reshape(B, T, -1)

    def forward(self, x, state: StateBatch | None = None, r: int = 0):
        """x [B, T, hidden]. With `state`: start from recurrent layer r's checkpoints and record the
        results (see StateBatch.record); without: from zeros, nothing kept."""
        hs = self.hs
        B, T, _ = x.shape
        Hk, Hv, dk, dv = hs.num_k_heads, hs.num_v_heads, hs.k_head_dim, hs.v_head_dim
        mixed, z, b, a = self.project(x)
        if state is None:
            window = x.new_zeros(B, hs.conv_kernel - 1, hs.conv_dim)
            S = torch.zeros(B, Hv, dk, dv, dtype=torch.float32, device=x.device)
        else:
            window, S = state.read(r)
        conv, cat = causal_conv(window, mixed, self.conv1d.weight.squeeze(1))  # [B, T, C]
        q, k, v = conv.float().split([hs.key_dim, hs.key_dim, hs.value_dim], dim=-1)
        q = _per_value_head(l2norm(q.view(B, T, Hk, dk)) * dk ** -0.5, Hv)  # [B, T, Hv, dk]
        k = _per_value_head(l2norm(k.view(B, T, Hk, dk)), Hv)
        v = v.reshape(B, T, Hv, dv)
        beta = b.float().sigmoid()  # [B, T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        if state is not None and min(state.lens) < T:  # padding rows leave the state unchanged
            valid = state.valid(T, x.device)[..., None]
            beta, g = beta * valid, g * valid
        states = None  # snapshot with provisional rows: the state after every position, into scratch
        if state is not None and state.keeps_states:
            states = state.scratch("states", r, (B, T, Hv, dk, dv), torch.float32)
        if states is not None or T <= SEQUENTIAL_MAX_TOKENS:  # the C loop where it runs, else PyTorch's
            o, S_final = (fused_recurrent_rule(q, k, v, g, beta, S, states_out=states)
                          or recurrent_rule(q, k, v, g, beta, S, states_out=states))
        else:
            o, S_final = chunked_rule(q, k, v, g, beta, S)
        if state is not None:
            state.record(r, cat, k, v, g, beta, S_final)
        y = gated_rms_norm(o.to(x.dtype), z, self.norm.weight, self.cfg.rms_norm_eps)  # [B, T, Hv, dv]
        return self.out_proj(y.reshape(B, T, hs.value_dim))


def _per_value_head(x, Hv: int):
    """[B, T, Hk, d] -> [B, T, Hv, d]: each key head serves Hv / Hk consecutive value heads."""
    B, T, Hk, d = x.shape
    if Hk == Hv:
        return x
    return x[:, :, :, None].expand(B, T, Hk, Hv // Hk, d).reshape(B, T, Hv, d)


class HybridLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str):
        super().__init__()
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class HybridBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(cfg, kind) for kind in cfg.hybrid.layer_types)
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class HybridModel(nn.Module):
    is_hybrid = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.hybrid is None:
            raise ValueError(f"HybridModel needs a hybrid config (architecture {cfg.arch})")
        self.cfg = cfg
        self.model = HybridBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        r = cfg.hybrid.rotary_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.prepared = False
        # index of each layer among its kind: the K/V cache holds attention layers only
        self.kind_index = [sum(1 for t in cfg.hybrid.layer_types[:i] if t == kind)
                           for i, kind in enumerate(cfg.hybrid.layer_types)]

    @property
    def num_kv_layers(self) -> int:
        return len(self.cfg.hybrid.attention_layers)

    def rope(self, positions: torch.Tensor):  # [B, T] -> cos, sin [B, T, 1, rotary_dim] (float32)
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, :, None], emb.sin()[:, :, None]

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor | None = None,  # [B, T]
        kv_cache: torch.Tensor | None = None,  # [attention layers, 2, num_slots, Hkv, D]
        meta: AttentionMetadata | None = None,
        max_position: int | None = None,  # unused (the Llama runner's RoPE table hint)
        state: StateBatch | None = None,
    ) -> torch.Tensor:  # hidden [B, T, hidden]
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        if kv_cache is not None and state is None:
            raise RuntimeError("a cached forward of a hybrid model needs its recurrent state (StateBatch)")
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions)
        eps = self.cfg.rms_norm_eps
        for layer, i in zip(self.model.layers, self.kind_index):
            h = offset_rms_norm(x, layer.input_layernorm.weight, eps)
            if hasattr(layer, "linear_attn"):
                x = x + layer.linear_attn(h, state, i)
            else:
                x = x + layer.self_attn(h, cos, sin, None if kv_cache is None else kv_cache[i], meta)
            x = x + layer.mlp(offset_rms_norm(x, layer.post_attention_layernorm.weight, eps))
        return offset_rms_norm(x, self.model.norm.weight, eps)

    @torch.no_grad()
    def fuse_projections(self) -> "HybridModel":
        """Prepare for inference: fused products (q/gate+k+v, qkvz+ba, gate+up) as `PackedLinear`."""
        for layer in self.model.layers:
            if hasattr(layer, "linear_attn"):
                la = layer.linear_attn
                la.in_proj = PackedLinear.of(la.in_proj_qkvz, la.in_proj_ba)
                del la.in_proj_qkvz, la.in_proj_ba
                la.out_proj = PackedLinear.of(la.out_proj)
            else:
                a = layer.self_attn
                a.qkv_proj = PackedLinear.of(a.q_proj, a.k_proj, a.v_proj)
                del a.q_proj, a.k_proj, a.v_proj
                a.o_proj = PackedLinear.of(a.o_proj)
            m = layer.mlp
            m.gate_up_proj = PackedLinear.of(m.gate_proj, m.up_proj)
            del m.gate_proj, m.up_proj
            m.down_proj = PackedLinear.of(m.down_proj)
        self.lm_head = PackedLinear.of(self.lm_head)
        self.prepared = True
        return self

    def _apply(self, fn, *args, **kwargs):
        if self.prepared:
            raise RuntimeError("move or cast a model before fuse_projections(), not after")
        return super()._apply(fn, *args, **kwargs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full causal forward without cache: `[B, T] -> [B, T, vocab]` (training, scoring)."""
        return self.compute_logits(self.forward(input_ids))
