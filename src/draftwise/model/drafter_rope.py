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

    def tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed of positions 0..max_position, [max_position + 1, D] float32, contiguous
        (what the kernels read: kernels/eagle3.c)."""
        device = torch.device(device)
        table = self._tables.get(device)
        if table is None:
            P, D = self.max_position, self.head_dim
            inv_freq = 1.0 / self.theta ** (torch.arange(0, D, 2, device=device).float() / D)
            emb = torch.arange(P + 1, device=device).float()[:, None] * inv_freq
            emb = torch.cat((emb, emb), dim=-1)  # [P + 1, D]
            sin = emb.sin()
            half = D // 2
            table = self._tables[device] = (emb.cos(), torch.cat((-sin[:, :half], sin[:, half:]), -1).contiguous())
        return table

    def __call__(self, positions: torch.Tensor):
        """positions [B, L] -> cos, sin_signed [B, L, 1, D] (positions past the table: its last row)."""
        cos, sin = self.tables(positions.device)
        idx = positions.clamp(max=self.max_position)
        return cos[idx][:, :, None], sin[idx][:, :, None]
