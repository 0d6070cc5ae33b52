"""Engine-wide counters: what a serving dashboard and the lab read (the server exports them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sequence import RequestStats


CONFIDENCE_BINS = 20  # equal-width bins of the drafter's per-position confidence (reliability, ECE)


@dataclass
class EngineStats:
    steps: int = 0
    propose_seconds: float = 0.0
    verify_seconds: float = 0.0
    other_seconds: float = 0.0  # scheduling, bookkeeping, detokenization
    rollback_seconds: float = 0.0  # hybrid targets: recurrent-state commits in postprocess (snapshot copy / replay)
    grammar_seconds: float = 0.0  # structured output's grammar work (inside propose and verify)
    rounds: int = 0  # verification rounds of decoding sequences (prefill excluded)
    proposed_tokens: int = 0  # tokens the drafter proposed (snapshot key: draft_tokens, kept for old readers)
    verified_tokens: int = 0  # proposals sent to the target (an admitted prefix of each block + forced tokens)
    accepted_tokens: int = 0
    forced_tokens: int = 0  # verified proposals beyond the planned draft length: grammar-forced, free
    # a lookup before the drafter (--lookup): rounds whose block was the lookup's, and their accepted tokens
    lookup_rounds: int = 0
    lookup_accepted_tokens: int = 0
    committed_tokens: int = 0  # tokens committed by rounds
    accepted_per_position: list[int] = field(default_factory=list)
    # chain rounds only: position j reached (verified, every proposal before it accepted), and accepted there
    reached_per_position: list[int] = field(default_factory=list)
    passed_per_position: list[int] = field(default_factory=list)
    # the drafter's confidence at each reached position (chain rounds that carried confidences), in
    # CONFIDENCE_BINS equal bins: positions, accepted ones, and the confidences' sum per bin
    confidence_reached: dict[int, int] = field(default_factory=dict)
    confidence_passed: dict[int, int] = field(default_factory=dict)
    confidence_sum: dict[int, float] = field(default_factory=dict)
    committed_per_round: dict[int, int] = field(default_factory=dict)  # histogram: tokens -> rounds
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> count
    # the verification policy at work
    verified_per_round: dict[int, int] = field(default_factory=dict)  # histogram: verified proposals -> rounds
    decode_steps: int = 0  # steps with a sequence that could draft
    speculative_steps: int = 0  # ... in which some sequence verified a proposal
    # the cost model against the clock, over steps without prefill (goodput policy)
    predicted_seconds: float = 0.0
    measured_seconds: float = 0.0
    step_time_ratio: dict[int, int] = field(default_factory=dict)  # round(50 * measured / predicted) -> steps
    step_time_ratio_profile: dict[int, int] = field(default_factory=dict)  # ... predicted by the profile alone
    # prefix caching: prompt (and recompute) tokens looked up at admission, and those found cached
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    # ... and in the drafter's own pool: tokens looked up when a sequence first drafts, those found
    draft_prefix_cache_queried_tokens: int = 0
    draft_prefix_cache_hit_tokens: int = 0

    def snapshot(self) -> dict:
        return {
            "steps": self.steps,
            "propose_seconds": self.propose_seconds,
            "verify_seconds": self.verify_seconds,
            "other_seconds": self.other_seconds,
            "grammar_seconds": self.grammar_seconds,
            "rollback_seconds": self.rollback_seconds,
            "rounds": self.rounds,
            "draft_tokens": self.proposed_tokens,
            "proposed_tokens": self.proposed_tokens,
            "verified_tokens": self.verified_tokens,
            "accepted_tokens": self.accepted_tokens,
            "forced_tokens": self.forced_tokens,
            "lookup_rounds": self.lookup_rounds,
            "lookup_accepted_tokens": self.lookup_accepted_tokens,
            "committed_tokens": self.committed_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "reached_per_position": list(self.reached_per_position),
            "passed_per_position": list(self.passed_per_position),
            "confidence_reached": dict(self.confidence_reached),
            "confidence_passed": dict(self.confidence_passed),
            "confidence_sum": dict(self.confidence_sum),
            "committed_per_round": dict(self.committed_per_round),
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "preemptions": self.preemptions,
            "finished": dict(self.finished),
            "verified_per_round": dict(self.verified_per_round),
            "decode_steps": self.decode_steps,
            "speculative_steps": self.speculative_steps,
            "predicted_seconds": self.predicted_seconds,
            "measured_seconds": self.measured_seconds,
            "step_time_ratio": dict(self.step_time_ratio),
            "step_time_ratio_profile": dict(self.step_time_ratio_profile),
            "prefix_cache_queried_tokens": self.prefix_cache_queried_tokens,
            "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens,
            "draft_prefix_cache_queried_tokens": self.draft_prefix_cache_queried_tokens,
            "draft_prefix_cache_hit_tokens": self.draft_prefix_cache_hit_tokens,
        }

    def count_round(self, req: "RequestStats", num_proposed: int, num_verified: int, a: int, propose_s: float,
                    confidence: list[float] | None = None, chain: bool = True) -> None:
        """One request's round that proposed num_proposed tokens, verified num_verified of them
        and accepted a (committing a + 1), counted in its statistics and the engine's; a chain's
        reached positions (with the drafter's confidence at each, where it gave them) counted for
        the conditional acceptance by position and the confidences' reliability."""
        if chain:
            self._count_reached(min(a + 1, num_verified), a, confidence)
        for per_pos in (req.accepted_per_position, self.accepted_per_position):
            per_pos.extend([0] * (a - len(per_pos)))  # forced proposals reach past k
        req.rounds += 1
        req.proposed_tokens += num_proposed
        req.verified_tokens += num_verified
        req.accepted_tokens += a
        req.committed_in_rounds += a + 1
        req.committed_per_round.append(a + 1)
        req.draft_seconds += propose_s if num_proposed else 0.0
        for j in range(a):
            req.accepted_per_position[j] += 1
            self.accepted_per_position[j] += 1
        self.rounds += 1
        self.proposed_tokens += num_proposed
        self.verified_tokens += num_verified
        self.accepted_tokens += a
        self.committed_tokens += a + 1
        self.committed_per_round[a + 1] = self.committed_per_round.get(a + 1, 0) + 1
        self.verified_per_round[num_verified] = self.verified_per_round.get(num_verified, 0) + 1

    def _count_reached(self, reached: int, a: int, confidence: list[float] | None) -> None:
        for per_pos in (self.reached_per_position, self.passed_per_position):
            per_pos.extend([0] * (reached - len(per_pos)))
        for j in range(reached):
            self.reached_per_position[j] += 1
            self.passed_per_position[j] += j < a
            if confidence is not None and j < len(confidence) and confidence[j] is not None:
                c = min(max(float(confidence[j]), 0.0), 1.0)
                b = min(int(c * CONFIDENCE_BINS), CONFIDENCE_BINS - 1)
                self.confidence_reached[b] = self.confidence_reached.get(b, 0) + 1
                self.confidence_passed[b] = self.confidence_passed.get(b, 0) + (j < a)
                self.confidence_sum[b] = self.confidence_sum.get(b, 0.0) + c

    def record_prediction(self, predicted: float, profile_only: float, measured: float) -> None:
        """A decode step's time: the policy's prediction (profile + online residual), the hardware
        profile's alone, and the clock."""
        self.predicted_seconds += predicted
        self.measured_seconds += measured
        for hist, pred in ((self.step_time_ratio, predicted), (self.step_time_ratio_profile, profile_only)):
            key = round(50 * measured / pred) if pred > 0 else 0
            hist[key] = hist.get(key, 0) + 1


def median_ratio(hist: dict) -> float | None:
    """The median measured / predicted step time from a `step_time_ratio` histogram (2% bins)."""
    items = sorted((int(k), v) for k, v in hist.items() if v > 0)
    total = sum(v for _, v in items)
    if not total:
        return None
    seen = 0
    for k, v in items:
        seen += v
        if 2 * seen >= total:
            return k / 50
