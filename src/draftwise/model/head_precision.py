"""bfloat16 LM heads: the top logits of each row recomputed in float32.

A bfloat16 product accumulates in float32 but rounds its outputs to bfloat16: 8 significant bits,
a step of 0.125 at logits of 16-32. Over a 49152-token vocabulary (SmolLM2) the top two logits
then tie exactly at ~2% of greedy positions, and greedy decoding breaks
the tie by index, not by the model. The ties come from the rounding of the outputs, not from the
bfloat16 weights: the same weights and hidden states in a float32 product give no ties.

`refine_top_logits` keeps the bfloat16 head (one read of its weights) and recomputes only each
row's `REFINE_TOP` largest logits as float32 dot products of the same bfloat16 weight rows and
hidden state: a few rows of the head, a few microseconds. Greedy decoding then picks the float32
product's argmax whenever fewer than REFINE_TOP logits lie within a bfloat16 step of the row's
maximum (the true argmax's rounded logit is at least max - one step). Each row is refined on its
own, so a row's logits still do not depend on the other rows of the batch (plain and speculative
decoding see the same values).
"""
from __future__ import annotations

import torch

REFINE_TOP = 8


def refine_top_logits(
    logits: torch.Tensor,  # [N, V] float32, the bfloat16 head's outputs
    hidden: torch.Tensor,  # [N, H] the head's input (bfloat16)
    weight: torch.Tensor,  # [V, H] the head's weight (bfloat16)
    top: int = REFINE_TOP,
) -> torch.Tensor:  # [N, V], the same tensor, its top entries per row recomputed in float32
    if logits.numel() == 0 or top <= 0:
        return logits
    idx = logits.topk(min(top, logits.shape[-1]), dim=-1).indices  # [N, top]
    rows = weight[idx.reshape(-1)].float().view(*idx.shape, -1)  # [N, top, H]
    # a product and a sum over H, not bmm: the sum's order does not depend on N (bmm's kernel does)
    exact = (rows * hidden.float().unsqueeze(1)).sum(-1)  # [N, top]
    return logits.scatter_(-1, idx, exact)
