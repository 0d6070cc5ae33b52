"""Engine-wide counters: what a serving dashboard and the lab read (the server exports them)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    steps: int = 0
    propose_seconds: float = 0.0
    verify_seconds: float = 0.0
    other_seconds: float = 0.0  # scheduling, bookkeeping, detokenization
    rounds: int = 0  # verification rounds of decoding sequences (prefill excluded)
    proposed_tokens: int = 0  # tokens the drafter proposed (snapshot key: draft_tokens, kept for old readers)
    verified_tokens: int = 0  # proposals sent to the target (the policy admits a prefix of each block)
    accepted_tokens: int = 0
    committed_tokens: int = 0  # tokens committed by rounds
    accepted_per_position: list[int] = field(default_factory=list)
    committed_per_round: dict[int, int] = field(default_factory=dict)  # histogram: tokens -> rounds
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> count

    def snapshot(self) -> dict:
        return {
            "steps": self.steps,
            "propose_seconds": self.propose_seconds,
            "verify_seconds": self.verify_seconds,
            "other_seconds": self.other_seconds,
            "rounds": self.rounds,
            "draft_tokens": self.proposed_tokens,
            "proposed_tokens": self.proposed_tokens,
            "verified_tokens": self.verified_tokens,
            "accepted_tokens": self.accepted_tokens,
            "committed_tokens": self.committed_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "committed_per_round": dict(self.committed_per_round),
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "preemptions": self.preemptions,
            "finished": dict(self.finished),
        }
