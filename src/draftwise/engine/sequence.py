"""A request's state inside the engine: its tokens, cache lengths, stop state and statistics.

Lengths, by convention:
- `num_computed`: positions whose target K/V are valid; in decode this is `len(all_ids) - 1`
  (the last committed token is fed, with the proposals, in the next step);
- `draft_computed`: the same for a draft model's own cache (it may lag further behind).
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from ..sampling import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestStats:
    """Speculation statistics of one request. A round is one verification step after prefill."""

    rounds: int = 0
    proposed_tokens: int = 0
    verified_tokens: int = 0  # proposals sent to the target (<= proposed: the policy admits a prefix)
    accepted_tokens: int = 0
    committed_in_rounds: int = 0  # tokens committed by rounds (accepted + recovered/bonus)
    accepted_per_position: list[int] = field(default_factory=list)
    committed_per_round: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    preemptions: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per round, bonus and recovered included (1.0 without speculation)."""
        return self.committed_in_rounds / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified proposals (= / proposed under the fixed policy)."""
        return self.accepted_tokens / self.verified_tokens if self.verified_tokens else 0.0

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "proposed_tokens": self.proposed_tokens,
            "verified_tokens": self.verified_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_rate": self.acceptance_rate,
            "accepted_per_position": list(self.accepted_per_position),
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "total_seconds": self.total_seconds,
            "preemptions": self.preemptions,
        }


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, k: int = 0):
        """`k`: the engine's maximum proposals per step (sizes the per-position statistics)."""
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.num_computed = 0
        self.draft_computed = 0
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.stats = RequestStats(accepted_per_position=[0] * k)
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(int(params.seed))
        # detokenization / stop-string state
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.error: str | None = None  # set when the engine failed this sequence (finish_reason 'error')
        self.grammar = None  # GrammarState of a structured-output request: follows the committed tokens

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        # more than the last committed token still to feed: a prompt (or a recompute) chunk
        return self.num_tokens - self.num_computed > 1

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
