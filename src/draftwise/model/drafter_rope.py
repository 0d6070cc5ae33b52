"""RoPE for the feature-reading drafters (DSpark, EAGLE-3): cos and sin of any position up to
max_position_embeddings, read from a table built once per device in the target's convention
(`apply_rope`'s signed sin). A drafter's step is a few rows: a sin and a cos call per row per
round would cost more than the lookup."""
from __future__ import annotations

import torch


class RopeTable:
    def __init__(self, head_dim: int, theta: float, max_position: int):
        self.head_dim, self.theta, self.max_position = head_dim, theta, max_position
        self._tables: dict = {}  # device -> (cos, sin_signed) [max_position + 1, D] float32

    def __call__(self, positions: torch.Tensor):
        """positions [B, L] -> cos, sin_signed [B, L, 1, D] (positions past the table: its last row)."""
        P, D = self.max_position, self.head_dim
        table = self._tables.get(positions.device)
        if table is None:
            inv_freq = 1.0 / self.theta ** (torch.arange(0, D, 2, device=positions.device).float() / D)
            emb = torch.arange(P + 1, device=positions.device).float()[:, None] * inv_freq
            emb = torch.cat((emb, emb), dim=-1)  # [P + 1, D]
            sin = emb.sin()
            half = D // 2
            table = self._tables[positions.device] = (emb.cos(), torch.cat((-sin[:, :half], sin[:, half:]), -1))
        idx = positions.clamp(max=P)
        return table[0][idx][:, :, None], table[1][idx][:, :, None]
