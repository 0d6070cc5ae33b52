"""The EAGLE-3 drafter (Li et al., arXiv 2503.01840): one autoregressive decoder layer on the
target's fused low/mid/high features.

- **Input.** The target's residual streams after a few layers (`Eagle3Config.target_feature_layers`)
  of position t are concatenated and projected to g_t = fc(features_t) (`fuse`). The layer's input
  row at position t is fc_in([norm(g_t) ; norm(emb(x_{t+1}))]) (`row_input`), its output a_t (the
  residual stream, before any norm) goes through the target's final norm and LM head (shared and
  frozen: not the drafter's parameters) and predicts x_{t+2} (`logits`); or, with `set_head`, a head
  over the target's most frequent tokens (the others at FLOOR, eagle3_vocab.py).
- **Drafting is autoregressive** (`draft`). With the committed context x_0..x_L (features of
  positions 0..L-1: the last token x_L has none yet), step 1 is the row of position L-1 (g_{L-1},
  x_L) and predicts x_{L+1}; step j > 1 is the row fc_in([norm(a) ; norm(emb(drafted token))]) at
  position L+j-2, a the drafter's own output of step j-1 standing in for the target's feature.
  Every step attends the context's K/V (rows built from the target's features, positions < L-1:
  what an engine caches per committed position, `kv`) and the K/V of the round's earlier steps and
  its own (step 1's row is position L-1's context row itself).
- **Training-time test** (`unroll`): training runs the same steps for every position of a window
  at once; step j's row t attends the context rows 0..t and its own steps 2..j (a causal block
  beside diagonal ones), which is exactly what `draft` attends from t = L-1. Tokens are the
  window's (teacher-forced), features the drafter's own from step 2 on.

p is the target, q the draft. Shapes: B rows, T window positions, S context positions, H the
target's width, V its vocabulary, F the number of feature layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from .drafter_io import load_drafter_weights, save_drafter
from .drafter_rope import RopeTable
from .dspark import BlockLayer
from .eagle3_config import Eagle3Config
from .llama import RMSNorm
from .packed_weights import PackedLinear


@dataclass
class DraftedSteps:
    """k autoregressive steps of `Eagle3Drafter.draft`."""

    tokens: torch.Tensor  # [B, k] the drafted x_{L+1}..x_{L+k}
    logits: torch.Tensor  # [B, k, V] float32: step j's logits (before any processing)


class Eagle3Drafter(nn.Module):
    """The drafter's own weights; the target's embeddings, final norm and LM head come from
    `share(target)`."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_feature_layers) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)  # on g_t, or the drafter's own a
        self.embed_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.fc_in = nn.Linear(2 * h, h, bias=False)  # [feature ; embedding] -> row, starting as their sum
        with torch.no_grad():
            self.fc_in.weight.copy_(torch.eye(h).repeat(1, 2))
        self.layer = BlockLayer(cfg)  # EAGLE-3's one decoder layer
        if cfg.draft_vocab:  # the tokens it was trained to draft over (train eagle3 --draft-vocab), saved with it
            self.register_buffer("draft_vocab_ids", torch.zeros(cfg.draft_vocab, dtype=torch.long))
        self._target: list = []  # the target (a list: not a submodule, its weights stay out of ours)
        self._head: list = []  # `set_head`'s head over some tokens (a list: not saved with our weights)
        self.packed: dict[str, PackedLinear] = {}  # `prepare` (a plain dict: not in the state dict)
        self._rope = RopeTable(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)

    def prepare(self) -> "Eagle3Drafter":
        """Inference on a CPU: the projections packed for the kernels; change no parameter afterwards."""
        self.layer.prepare()
        self.packed = {"fc": PackedLinear.of(self.fc), "fc_in": PackedLinear.of(self.fc_in)}
        return self

    def share(self, target) -> "Eagle3Drafter":
        """Read `target`'s embeddings, final norm and LM head (a LlamaModel); they stay frozen."""
        self._target = [target]
        return self

    def set_head(self, head) -> "Eagle3Drafter":
        """Draft with `head` (a `PrunedHead` over some of the target's head rows, eagle3_vocab.py)
        instead of the target's whole LM head."""
        self._head = [head]
        return self

    @property
    def head(self):
        """`set_head`'s head, or None (the target's)."""
        return self._head[0] if self._head else None

    def rope(self, positions: torch.Tensor):  # [B, L] -> cos, sin_signed [B, L, 1, D]
        return self._rope(positions)

    # -- the pieces -----------------------------------------------------------------------------
    def fuse(self, features: torch.Tensor) -> torch.Tensor:  # [..., F*H] -> g [..., H]
        x = features.to(self.fc.weight.dtype)
        return self.packed.get("fc", self.fc)(x.contiguous())

    def row_input(self, g: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """g [B, L, H] (a fused feature or the drafter's own output), ids [B, L] the next tokens -> [B, L, H]."""
        emb = self._target[0].model.embed_tokens(ids).to(g.dtype)
        x = torch.cat((self.hidden_norm(g), self.embed_norm(emb)), -1)
        return self.packed.get("fc_in", self.fc_in)(x)

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context rows x [B, S, H] at positions [B, S] -> k (rotated), v [B, S, Hkv, D]: a function of
        one position's row, so a cache of them grows with the committed tokens."""
        cos, sin = self.rope(positions)
        return self.layer.kv(self.layer.input_layernorm(x), cos, sin)  # (the layer's own rows' K/V: normed first)

    def logits(self, a: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V] float32
        t = self._target[0]
        h = t.model.norm(a.to(t.model.norm.weight.dtype))
        return self._head[0](h) if self._head else t.compute_logits(h)

    # -- drafting -------------------------------------------------------------------------------
    def draft(self, first: torch.Tensor, start: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
              sees: torch.Tensor, steps: int, choose: Callable[[int, torch.Tensor], torch.Tensor] | None = None
              ) -> DraftedSteps:
        """`steps` autoregressive steps: first [B, H] step 1's row (the context row of position
        start [B], the last committed one); k_ctx, v_ctx [B, S, Hkv, D] the context's K/V and
        sees [B, S] which of them every step attends (positions < start; not padding).
        `choose(j, logits [B, V]) -> [B]` picks step j's token (default: the argmax); step j + 1
        reads it."""
        B = first.shape[0]
        choose = choose or (lambda j, logits: logits.argmax(-1))
        x = first[:, None]  # [B, 1, H]
        ks, vs, tokens, logits = [k_ctx], [v_ctx], [], []
        for j in range(steps):
            cos, sin = self.rope((start + j)[:, None])
            mask = torch.cat((sees, sees.new_ones(B, j + 1)), 1)[:, None, None]  # [B, 1, 1, S + j + 1]
            a, k, v = self.layer.forward_kv(x, cos, sin, torch.cat(ks, 1), torch.cat(vs, 1), mask)
            step = self.logits(a[:, 0])  # [B, V]
            tok = choose(j, step)
            tokens.append(tok)
            logits.append(step)
            if j + 1 < steps:
                ks.append(k)
                vs.append(v)
                x = self.row_input(a, tok[:, None])
        return DraftedSteps(torch.stack(tokens, 1), torch.stack(logits, 1))

    def propose(self, features: torch.Tensor, ids: torch.Tensor, steps: int, choose=None) -> DraftedSteps:
        """Without a cache (tests, evaluation): features [B, S, F*H] of positions 0..S-1, ids [B, S + 1]
        the committed tokens x_0..x_S -> `steps` tokens after x_S."""
        B, S, _ = features.shape
        pos = torch.arange(S, device=features.device).expand(B, S)
        rows = self.row_input(self.fuse(features), ids[:, 1:S + 1])  # [B, S, H]
        k, v = self.kv(rows, pos)
        start = torch.full((B,), S - 1, dtype=torch.long, device=features.device)
        return self.draft(rows[:, -1], start, k, v, pos < S - 1, steps, choose)

    # -- training-time test ---------------------------------------------------------------------
    def unroll(self, features: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """features [B, T, F*H], ids [B, T] (a window) -> step j's logits [B, T-1, V] for j = 1..steps:
        row t of step j predicts x_{t+j+1} (compare with the target's distribution after row t+j;
        rows with t+j > T-1 read clamped tokens and are the caller's to ignore)."""
        B, T, _ = features.shape
        Q = T - 1
        t = torch.arange(Q, device=ids.device)
        x = self.row_input(self.fuse(features[:, :Q]), ids[:, 1:])  # step 1: the context rows
        causal = t[:, None] >= t[None, :]  # [Q, Q]
        diag = t[:, None] == t[None, :]
        empty = x.new_zeros(B, 0, self.cfg.num_key_value_heads, self.cfg.head_dim)
        ks, vs, out = [empty], [empty], []
        for j in range(steps):
            cos, sin = self.rope((t + j).expand(B, Q))
            mask = torch.cat([causal] + [diag] * j, 1)[None, None].expand(B, 1, Q, Q * (j + 1))
            a, k, v = self.layer.forward_kv(x, cos, sin, torch.cat(ks, 1), torch.cat(vs, 1), mask)
            out.append(self.logits(a))
            if j + 1 < steps:
                ks.append(k)
                vs.append(v)
                x = self.row_input(a, ids.gather(1, (t + j + 2).clamp(max=T - 1).expand(B, Q)))
        return out


def save_eagle3(drafter: Eagle3Drafter, out: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """config.json + model.safetensors (the drafter's own weights only)."""
    save_drafter(drafter, drafter.cfg.to_dict(), out, dtype)


def load_eagle3(path: str | Path, target, dtype: torch.dtype = torch.float32) -> Eagle3Drafter:
    """A drafter directory, checked against and sharing `target` (a LlamaModel)."""
    cfg = Eagle3Config.from_dir(path).check(target.cfg)
    drafter = load_drafter_weights(Eagle3Drafter(cfg), path)
    return drafter.to(dtype).eval().requires_grad_(False).share(target)
