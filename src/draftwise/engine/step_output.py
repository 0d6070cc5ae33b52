"""What one engine step produces: `StepOutput` per sequence (for streaming) and the typed
`Verification` that `LLMEngine.verify` hands to postprocess."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sampling.verify import VerifyMetadata, VerifyResult
from .sequence import Sequence, TokenLogprob


@dataclass
class StepOutput:
    """What one step did to one sequence (for streaming): new tokens, finished or not."""

    seq: Sequence
    new_token_ids: list[int]
    finished: bool


@dataclass
class Committed:
    """What verification decided for one row: the tokens postprocess commits (stop checks aside)."""

    tokens: list[int]  # accepted proposals, then the recovered or bonus token
    num_accepted: int  # proposals accepted
    logits: torch.Tensor | None  # [num_accepted + 1, V] p's logits rows at those positions (None: a multi-step row)
    path: list[int] | None = None  # a tree row: the accepted nodes (tree_verify.py); None: a chain
    logprobs: list[float] | None = None  # a multi-step row: each token's log-probability under p

    def token_logprobs(self, top_n: int) -> list[TokenLogprob]:
        """Each token's log-probability under p, with the top_n most likely tokens: from p's rows
        (one log_softmax for them all), or a multi-step row's values (top_n is 0 there)."""
        toks = self.tokens
        if self.logits is None:
            return [TokenLogprob(t, v, []) for t, v in zip(toks, self.logprobs)]
        lp = torch.log_softmax(self.logits[: len(toks)], dim=-1)  # [n, V]
        chosen = lp.gather(1, torch.tensor(toks, dtype=torch.long).unsqueeze(1)).squeeze(1).tolist()  # [n]
        if not top_n:
            return [TokenLogprob(t, v, []) for t, v in zip(toks, chosen)]
        vals, idx = torch.topk(lp, top_n, dim=-1)  # [n, top_n]
        return [TokenLogprob(t, v, list(zip(i, w))) for t, v, i, w in zip(toks, chosen, idx.tolist(), vals.tolist())]


@dataclass
class Verification:
    """What verification decided for the sequences that commit tokens this step, as lists."""

    rows: dict[int, int]  # seq_id -> row b of the batch
    tokens: list[list[int]]  # [B] committed tokens (accepted proposals, then recovered or bonus)
    accepted: list[int]  # [B] proposals accepted
    valid: list[bool]  # [B] False: unusable distribution, nothing committed
    starts: list[int]  # [B] row b's first row in p_logits
    p_logits: torch.Tensor | None  # [N, V] processed target logits (log-probabilities)
    paths: dict[int, list[int]] = field(default_factory=dict)  # row b -> accepted tree nodes (tree rows)
    logprobs: dict[int, list[float]] = field(default_factory=dict)  # row b -> its tokens' logprobs (multi-step rows)

    @staticmethod
    def from_result(rows: dict[int, int], meta: VerifyMetadata, result: VerifyResult,
                    p_logits: torch.Tensor) -> "Verification":
        valid = result.valid.tolist()
        committed = result.committed.tolist()
        accepted = result.num_accepted.tolist()
        tokens = [c[: a + 1] if v else [] for c, a, v in zip(committed, accepted, valid)]
        return Verification(rows, tokens, accepted, valid, meta.cu_num_logits.tolist()[:-1], p_logits)

    def committed(self, b: int) -> Committed:
        """Row b's committed tokens, number accepted, and p's logits rows at those positions."""
        a, start = self.accepted[b], self.starts[b]
        return Committed(self.tokens[b], a, None if self.p_logits is None else self.p_logits[start : start + a + 1],
                         self.paths.get(b), self.logprobs.get(b))
