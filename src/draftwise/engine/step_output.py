"""What one engine step produces: `StepOutput` per sequence (for streaming) and the typed
`Verification` that `LLMEngine.verify` hands to postprocess."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling.verify import VerifyMetadata, VerifyResult
from .sequence import Sequence


@dataclass
class StepOutput:
    """What one step did to one sequence (for streaming): new tokens, finished or not."""

    seq: Sequence
    new_token_ids: list[int]
    finished: bool


@dataclass
class Verification:
    """What verification decided for the sequences that commit tokens this step."""

    rows: dict[int, int]  # seq_id -> row b of the batch
    meta: VerifyMetadata | None
    result: VerifyResult | None
    p_logits: torch.Tensor | None  # [N, V] processed target logits (log-probabilities)

    def committed(self, b: int) -> tuple[list[int], int, torch.Tensor]:
        """Row b's committed tokens, number accepted, and p's logits rows at those positions."""
        a = int(self.result.num_accepted[b])
        start = int(self.meta.cu_num_logits[b])
        return self.result.tokens(b), a, self.p_logits[start : start + a + 1]
