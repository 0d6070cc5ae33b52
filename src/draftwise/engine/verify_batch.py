"""VerifyBatch: the flat metadata of one verification over a ragged batch of proposals.

Sequence b verifies `num_draft[b]` proposals (0 = plain decoding), so it contributes
`1 + num_draft[b]` target logits rows; `cu_num_logits` are their cumulative offsets in the flat
logits. The rejection sampler takes the padded views `[B, K]` and `[B, K+1, V]`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..proposers.base import DraftBlock


@dataclass
class VerifyBatch:
    """Flat description of one verification over a ragged batch (buildable by hand in tests).

    Sequence b feeds `1 + num_draft[b]` tokens; its target logits are rows
    `cu_num_logits[b] : cu_num_logits[b+1]` of the flat logits; the last of them is the bonus row.
    """

    num_draft: list[int]  # [B]
    cu_num_logits: list[int]  # [B+1] cumulative (1 + num_draft)
    draft_token_ids: torch.Tensor  # [B, K] padded with 0
    max_k: int

    @staticmethod
    def offsets(blocks: list[DraftBlock]) -> list[int]:
        """`cu_num_logits` of these blocks: sequence b's logits rows are `cu[b] : cu[b+1]`."""
        cu = [0]
        for b in blocks:
            cu.append(cu[-1] + len(b.token_ids) + 1)
        return cu

    @staticmethod
    def build(blocks: list[DraftBlock]) -> "VerifyBatch":
        num_draft = [len(b.token_ids) for b in blocks]
        K = max(num_draft, default=0)
        cu = VerifyBatch.offsets(blocks)
        toks = torch.zeros(len(blocks), K, dtype=torch.long)
        for i, b in enumerate(blocks):
            if b.token_ids:
                toks[i, : len(b.token_ids)] = torch.tensor(b.token_ids)
        return VerifyBatch(num_draft, cu, toks, K)

    def pad_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """`[sum(1+num_draft), V]` -> `[B, K+1, V]`, padding rows repeat the bonus row."""
        B, V = len(self.num_draft), flat.shape[-1]
        out = flat.new_zeros(B, self.max_k + 1, V)
        for b in range(B):
            n = self.num_draft[b] + 1
            out[b, :n] = flat[self.cu_num_logits[b] : self.cu_num_logits[b + 1]]
            if n < self.max_k + 1:
                out[b, n:] = out[b, n - 1]
        return out
