"""The DSpark drafter (arXiv 2607.05147): a parallel backbone on the target's own features, a Markov
head, a confidence head.

- **Parallel stage.** The target's residual streams after a low, a middle and a high layer
  (`DSparkConfig.target_feature_layers`) of each committed context position are concatenated and
  projected to one feature per position (`fuse`: fc then RMSNorm, as DFlash and EAGLE-3 do); each
  backbone layer turns them into context K/V (`context_kv`, what an engine caches per committed
  position). One forward over the block [anchor, mask x (gamma-1)] at positions a .. a+gamma-1,
  whose rows attend the context before the anchor and the whole block (bidirectionally), gives
  the hidden states h_1..h_gamma and the base logits U_k through the target's LM head; the anchor's
  embedding is the target's. Both are shared and frozen: they are not the drafter's parameters.
  With `causal_block` a row attends the block's rows up to its own only: the mask rows after it
  carry nothing but their positions, and its value then does not depend on the block's length, so
  training can add rows at position 1 alone at many more anchors (train/dspark_blocks.py).
  With `anchor_feature` (EAGLE's input) each row's input is fc_in([f_{a-1} ; its embedding]), f_{a-1}
  the fused feature of the last position before the anchor: row 1 then predicts x_{a+1} from the
  target's features of a-1 and the token x_a, as an EAGLE head does.
- **Sequential stage.** A head (model/dspark_heads.py: vanilla, gated, rnn or mlp) adds a low-rank
  bias to U_k (mlp also moves h_k ahead of the LM head), drawn left to right: q_k = softmax(U_k + B_k) depends on the tokens actually drafted
  before it (the vanilla Markov head: B(x_{k-1}, .) = W1[x_{k-1}] W2; x_0 = the anchor), so a block
  is a left-to-right distribution q(x_1..x_gamma) = prod_k q_k(x_k | x_<k) and verification
  against it stays exact.
- **Confidence head.** c_k = sigmoid((w . [h_k ; W1[x_{k-1}]] + b) / T_k), trained to the acceptance
  probability 1 - TV(q_k, p_k) of position k (train/dspark.py) with T_k = 1; the temperatures T_k
  (`confidence_temperatures`, Sequential Temperature Scaling: train/dspark_calibration.py) are
  fitted afterwards and apply wherever a confidence is read (`draw`).

p is the target, q the draft. Shapes: B rows, N blocks per row, gamma positions per block, S
context positions, H the target's width, V its vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import sdpa
from .drafter_io import load_drafter_weights, save_drafter
from .drafter_rope import RopeTable
from .dspark_heads import make_head
from .dspark_config import DSparkConfig
from .llama import RMSNorm, apply_rope
from .packed_weights import PackedLinear

# a context position that no anchor sees: padding of ragged rows
HIDDEN_POSITION = 1 << 40


class BlockLayer(nn.Module):
    """A decoder layer whose queries are the block's rows and whose keys are the context's fused
    features (projected by this layer's k/v) followed by the block's own rows."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        h, H, Hkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.H, self.Hkv, self.D = H, Hkv, D
        self.q_proj = nn.Linear(h, H * D, bias=False)
        self.k_proj = nn.Linear(h, Hkv * D, bias=False)
        self.v_proj = nn.Linear(h, Hkv * D, bias=False)
        self.o_proj = nn.Linear(H * D, h, bias=False)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.packed: dict[str, PackedLinear] = {}  # `prepare` (a plain dict: not in the state dict)

    def prepare(self, native: bool = False) -> None:
        """Inference: q/k/v, k/v and gate/up one product each, every projection a `PackedLinear`
        (the CPU kernels' small-row products: a block is a few rows; `native`: every one packed for
        dw_gemm, which takes any rows, where the kernels run)."""
        of = lambda *linears: PackedLinear.of(*linears, native=native)  # noqa: E731
        self.packed = {"qkv": of(self.q_proj, self.k_proj, self.v_proj), "kv": of(self.k_proj, self.v_proj),
                       "o": of(self.o_proj), "gate_up": of(self.gate_proj, self.up_proj), "down": of(self.down_proj)}

    def _qkv(self, h: torch.Tensor, with_q: bool):  # h [B, L, h] -> ([q], k, v) unrotated, flat heads
        if self.packed:
            out = self.packed["qkv" if with_q else "kv"](h)
            return out.split([self.H * self.D] * with_q + [self.Hkv * self.D] * 2, dim=-1)
        return [self.q_proj(h)] * with_q + [self.k_proj(h), self.v_proj(h)]

    def kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, L, h] -> k (rotated), v: [B, L, Hkv, D]."""
        return self.rotate_kv(*self._qkv(x, with_q=False), cos, sin)

    def rotate_kv(self, k: torch.Tensor, v: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """`kv`'s second half: the projections k, v [B, L, Hkv * D] (`_qkv`, a function of each row
        alone: rows of many sequences project in one product) -> k rotated at their positions, v."""
        B, L, _ = k.shape
        return (apply_rope(k.reshape(B, L, self.Hkv, self.D), cos, sin).to(k.dtype),
                v.reshape(B, L, self.Hkv, self.D))

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask):
        """x [B, Q, h]; k_ctx, v_ctx [B, S, Hkv, D]; mask [B, 1, Q, S + Q] (True: attend) -> [B, Q, h]."""
        return self.forward_kv(x, cos, sin, k_ctx, v_ctx, mask)[0]

    def forward_kv(self, x, cos, sin, k_ctx, v_ctx, mask):
        """`forward`, also returning the rows' own k (rotated), v [B, Q, Hkv, D] (what a drafter whose
        later steps attend its earlier ones keeps: EAGLE-3)."""
        B, Q, _ = x.shape
        h = self.input_layernorm(x)
        q, k_blk, v_blk = self._qkv(h, with_q=True)
        q = apply_rope(q.reshape(B, Q, self.H, self.D), cos, sin).to(x.dtype)
        k_blk = apply_rope(k_blk.reshape(B, Q, self.Hkv, self.D), cos, sin).to(x.dtype)
        v_blk = v_blk.reshape(B, Q, self.Hkv, self.D)
        k = torch.cat((k_ctx.to(x.dtype), k_blk), dim=1).transpose(1, 2)  # [B, Hkv, S + Q, D]
        v = torch.cat((v_ctx.to(x.dtype), v_blk), dim=1).transpose(1, 2)
        y = sdpa(q.transpose(1, 2), k, v, mask, self.D ** -0.5).transpose(1, 2).reshape(B, Q, -1)  # [B, Q, H*D]
        x = x + (self.packed["o"](y) if self.packed else self.o_proj(y))
        h = self.post_attention_layernorm(x)
        if self.packed:
            gate, up = self.packed["gate_up"](h).chunk(2, dim=-1)
            return x + self.packed["down"](F.silu(gate) * up), k_blk, v_blk
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)), k_blk, v_blk


@dataclass
class DraftedBlock:
    """One left-to-right draw from the block distribution (`DSparkDrafter.draw`)."""

    tokens: torch.Tensor  # [B, gamma] x_1..x_gamma
    logits: torch.Tensor  # [B, gamma, V] float32: U_k + B(x_{k-1}), the drafted x_{k-1}
    confidence: torch.Tensor  # [B, gamma] c_k in (0, 1)


class DSparkDrafter(nn.Module):
    """The drafter's own weights; the target's embeddings and LM head come from `share(target)`."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_feature_layers) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(h))
        # [fused feature of a-1 ; row embedding] -> row input, starting as their sum
        self.fc_in = nn.Linear(2 * h, h, bias=False) if cfg.anchor_feature else None
        if self.fc_in is not None:
            with torch.no_grad():
                self.fc_in.weight.copy_(torch.eye(h).repeat(1, 2))
        self.layers = nn.ModuleList(BlockLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.markov = (make_head(cfg.markov_head_type, cfg.vocab_size, cfg.markov_rank, h)
                       if cfg.markov_rank > 0 else None)
        self.confidence = nn.Linear(h + cfg.markov_rank, 1)
        if cfg.draft_vocab:  # the tokens it was trained to draft over (train dspark --draft-vocab), saved with it
            self.register_buffer("draft_vocab_ids", torch.zeros(cfg.draft_vocab, dtype=torch.long))
        self._target: list = []  # the target (a list: not a submodule, its weights stay out of ours)
        self._head: list = []  # `set_head`'s head (a list: not a submodule), else the target's
        self.packed: dict[str, PackedLinear] = {}  # `prepare` (a plain dict: not in the state dict)
        self._rope = RopeTable(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)

    def prepare(self) -> "DSparkDrafter":
        """Inference on a CPU: the projections packed for the kernels (`BlockLayer.prepare`); the
        parameters stay (saving and training read them), so change none afterwards."""
        for layer in self.layers:
            layer.prepare(native=True)
        if self.markov is not None:
            self.markov.prepare()
        self.packed = {"fc": PackedLinear.of(self.fc, native=True)}
        if self.fc_in is not None:
            self.packed["fc_in"] = PackedLinear.of(self.fc_in, native=True)
        return self

    def share(self, target) -> "DSparkDrafter":
        """Read `target`'s embeddings and LM head (a LlamaModel, prepared or not); they stay frozen."""
        self._target = [target]
        return self

    def set_head(self, head) -> "DSparkDrafter":
        """Draft with `head` (a `PrunedHead` over some of the target's head rows, eagle3_vocab.py:
        `--draft-vocab N`) instead of the target's whole LM head; the Markov head's bias is then
        needed over the same tokens only (`MarkovHead.keep`, for the kernels). Training sets heads
        without `kept` (train/feature_data.py's float rows)."""
        self._head = [head]
        kept = getattr(head, "kept", None)
        if self.markov is not None and kept is not None:
            self.markov.keep(kept)
        return self

    @property
    def kept_head(self):
        """`set_head`'s head, or None (the target's)."""
        return self._head[0] if self._head else None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._target[0].model.embed_tokens(ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V] float32
        return self._head[0](hidden) if self._head else self._target[0].compute_logits(hidden)

    def rope(self, positions: torch.Tensor):
        """positions [B, L] -> cos, sin_signed [B, L, 1, D] (`RopeTable`)."""
        return self._rope(positions)

    # -- the parallel stage -------------------------------------------------------------------
    def fuse(self, features: torch.Tensor) -> torch.Tensor:  # [B, S, F*H] -> [B, S, H]
        x = features.to(self.fc.weight.dtype)
        return self.hidden_norm(self.packed.get("fc", self.fc)(x.contiguous()))

    def context_kv(self, fused: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K/V [B, S, Hkv, D] of the fused context features at `positions` [B, S]:
        a function of one position's features, so a cache of them grows with the committed tokens."""
        cos, sin = self.rope(positions)
        projected = self.context_projections(fused)
        return [layer.rotate_kv(k, v, cos, sin) for layer, (k, v) in zip(self.layers, projected)]

    def context_projections(self, fused: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`context_kv` before RoPE: each layer's k, v [B, S, Hkv * D] of fused [B, S, H], a function of
        each row alone (rows of many sequences project in one product; `BlockLayer.rotate_kv` then
        places them)."""
        return [layer._qkv(fused, with_q=False) for layer in self.layers]

    def block_hidden(self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, ctx_kv, ctx_pos: torch.Tensor,
                     last: torch.Tensor | None = None, rows: int | None = None):
        """anchor_ids, anchor_pos [B, N]; ctx_kv from `context_kv`; ctx_pos [B, S] (HIDDEN_POSITION:
        padding); last [B, N, H] the fused feature of position anchor - 1 (`cfg.anchor_feature` only)
        -> h [B, N, gamma, H]. Block n's rows see the context before its anchor and block n (with
        `causal_block`, the rows of block n up to their own). `rows` < gamma: the first rows of each
        block only, the same values as in a whole block (a causal block's rows do not read later ones)."""
        B, N = anchor_ids.shape
        g = self.cfg.block_size if rows is None else rows
        if g != self.cfg.block_size and not (self.cfg.causal_block and 1 <= g < self.cfg.block_size):
            raise ValueError(f"rows={g}: a block's first rows alone need a causal block (gamma {self.cfg.block_size})")
        x = self.mask_embedding.expand(B, N, g, -1).clone()
        x[:, :, 0] = self.embed(anchor_ids).to(x.dtype)
        if self.fc_in is not None:
            if last is None:
                raise ValueError("this drafter's block rows read the fused feature before the anchor: pass `last`")
            x = torch.cat((last.to(x.dtype)[:, :, None].expand(-1, -1, g, -1), x), -1)  # [B, N, g, 2H]
            x = self.packed.get("fc_in", self.fc_in)(x)
        x = x.reshape(B, N * g, -1)
        offs = torch.arange(g, device=anchor_pos.device)
        cos, sin = self.rope((anchor_pos[..., None] + offs).view(B, N * g))
        blk = torch.arange(N, device=anchor_pos.device).repeat_interleave(g)  # [N*g] block of each row
        sees_ctx = ctx_pos[:, None, :] < anchor_pos.repeat_interleave(g, dim=1)[:, :, None]  # [B, N*g, S]
        sees_blk = blk[:, None] == blk[None, :]  # [N*g, N*g]
        if self.cfg.causal_block:
            sees_blk = sees_blk & (offs.repeat(N)[:, None] >= offs.repeat(N)[None, :])
        sees_blk = sees_blk.expand(B, -1, -1)  # [B, N*g, N*g]
        mask = torch.cat((sees_ctx, sees_blk), dim=2)[:, None]  # [B, 1, N*g, S + N*g]
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x).view(B, N, g, -1)

    # -- the sequential stage -----------------------------------------------------------------
    def confidence_logit(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:  # [...]
        feats = hidden if self.markov is None else torch.cat((hidden, self.markov.prev(prev_ids).to(hidden.dtype)), -1)
        return self.confidence(feats).squeeze(-1).float()

    def confidence_temperature(self, k: int) -> float:
        """T_k of block position k (0-based): 1 until Sequential Temperature Scaling sets them."""
        temps = self.cfg.confidence_temperatures
        return float(temps[k]) if temps else 1.0

    def teacher_forced(self, hidden: torch.Tensor, prev_ids: torch.Tensor):
        """Training: hidden [B, N, gamma, H], prev_ids [B, N, gamma] (the anchor, then the true
        tokens) -> logits [B, N, gamma, V] float32, confidence logits [B, N, gamma] (before T_k)."""
        if self.markov is not None and self.markov.adjusts_hidden:
            hidden = self.markov.adjust(hidden, self.embed(prev_ids))
        logits = self.head(hidden)
        if self.markov is not None:
            logits = logits + self.markov.block(prev_ids, hidden)
        return logits, self.confidence_logit(hidden, prev_ids)

    def draw(self, hidden: torch.Tensor, anchor_ids: torch.Tensor,
             choose: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
             base: torch.Tensor | None = None) -> DraftedBlock:
        """Draft left to right: hidden [B, gamma, H], anchor_ids [B]. `choose(k, logits [B, V])` picks
        x_k (default: the argmax); position k+1's head bias and confidence read that choice. `base`:
        the block's base logits U_k [B, gamma, V] where the caller has them (the block kernel)."""
        per_step = self.markov is not None and self.markov.adjusts_hidden  # the head reads h'_k, one call a position
        if not per_step and base is None:
            base = self.head(hidden)  # [B, gamma, V]: one head call for the block
        choose = choose or (lambda k, logits: logits.argmax(-1))
        prev, tokens, logits, conf = anchor_ids, [], [], []
        state = self.markov.init_state(anchor_ids) if self.markov is not None else None
        for k in range(hidden.shape[1]):
            h = self.markov.adjust(hidden[:, k], self.embed(prev)) if per_step else hidden[:, k]
            step = self.head(h) if per_step else base[:, k]
            if self.markov is not None:
                state, bias = self.markov.step(state, prev, h)
                step = step + bias
            conf.append(torch.sigmoid(self.confidence_logit(h, prev) / self.confidence_temperature(k)))
            prev = choose(k, step)
            tokens.append(prev)
            logits.append(step)
        return DraftedBlock(torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(conf, 1))

    def propose(self, features: torch.Tensor, anchor_ids: torch.Tensor, choose=None) -> DraftedBlock:
        """One block per row after its whole context: features [B, S, F*H] of positions 0..S-1,
        anchor_ids [B] at position S (no cache: tests and evaluation)."""
        B, S, _ = features.shape
        pos = torch.arange(S, device=features.device).expand(B, S)
        fused = self.fuse(features)  # [B, S, H]
        kv = self.context_kv(fused, pos)
        anchor_pos = torch.full((B, 1), S, dtype=torch.long, device=features.device)
        hidden = self.block_hidden(anchor_ids[:, None], anchor_pos, kv, pos, fused[:, -1:])[:, 0]
        return self.draw(hidden, anchor_ids, choose)


def save_dspark(drafter: DSparkDrafter, out: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """config.json + model.safetensors (the drafter's own weights only)."""
    save_drafter(drafter, drafter.cfg.to_dict(), out, dtype)


def load_dspark(path: str | Path, target, dtype: torch.dtype = torch.float32) -> DSparkDrafter:
    """A drafter directory, checked against and sharing `target` (a LlamaModel)."""
    cfg = DSparkConfig.from_dir(path).check(target.cfg)
    drafter = load_drafter_weights(DSparkDrafter(cfg), path)
    return drafter.to(dtype).eval().requires_grad_(False).share(target)
