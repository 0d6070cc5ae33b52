"""The verification `Policy` protocol and the registry of policies by name.

Each engine step, for every decoding sequence, a policy decides twice:

1. `plan` (before drafting): how many tokens to draft, at most the scheduler's cap (which depends
   on lengths only). 0 = plain decoding for that row this step; a step in which no row drafts
   skips the drafter.
2. `admit` (after drafting): how many of the drafted proposals to verify (a prefix).

**Causal admission.** For a sampled row, whether proposal j is verified may depend on the
committed history, the earlier proposals x_1..x_{j-1} and the draft's distributions q_1..q_j
(e.g. their confidence max_x q_j(x), `DraftBlock.confidence`), never on the realised x_j or
anything after it: the admitted length is then a stopping time of the drafting process, and
rejection sampling over the admitted prefix is exact. A rule that looks at x_j can bias the
output: with p = (3/5, 2/5) and q = (4/5, 1/5), "verify x only if q(x) > 1/2, else sample the
target directly" emits A with probability 4/5 * 3/4 + 1/5 * 3/5 = 18/25, not 3/5. Greedy rows may
use anything (their output is the target's argmax whatever is verified). `causal_lengths` below
is the helper every built-in policy uses: it reads only confidences.

3. `observe` (postprocess): what was verified and accepted, to calibrate; `observe_step`: what
   the step cost (`StepTiming`); `forget` when a request finishes.

Around them, typed hints: `hints` (after `plan`: `StepHints`, e.g. whether the step reads the
drafted blocks' confidences, the price of a verified row that sizes drafted trees) and `plain_next` (the scheduler: the next step drafts nothing, for certain).
`StatelessPolicy` gives every method a default; a policy overrides what it uses.

A new policy is a new file that registers itself with `register_policy`; the package's
`__init__` imports the built-ins.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

from ..proposers.base import DraftBlock, History
from ..registry import Registry
from .cost import CostModel


@dataclass(frozen=True)
class StepHints:
    """What a policy says of the step it has just planned (asked after `plan`)."""

    reads_confidence: bool  # `admit` and `observe` read DraftBlock.confidence (the drafter computes max q_j only then)
    arm: str | None = None  # how the step runs, for statistics and tests (goodput: "spec", "full" or "plain")
    # the expected committed tokens a verified row must add to pay for its marginal seconds at the
    # planned rate (goodput: lambda * dcost/dtoken); a tree drafter sizes its trees by it
    # (proposers/tree_budget.py); 0: no price, the planned lengths
    node_price: float = 0.0


@dataclass(frozen=True)
class StepTiming:
    """One decode step as the engine measured it, given to `observe_step` after every row's `observe`."""

    num_seqs: int  # B: the decoding rows
    num_tokens: int  # T: tokens fed to the target for them (B + the verified proposals)
    context: float  # the rows' mean context
    draft_lengths: Sequence[int]  # [B] tokens drafted per row
    # the decode step's seconds, its prefill chunks' forward left out; None: not timed apart (decode
    # rows and prefill chunks in one forward, a mixed step) or several target steps (multi-step)
    seconds: float | None
    catch_up_seconds: float = 0.0  # of `seconds`: the drafter's long catch-ups (new prompts' prefill in the drafter)
    untimed_seconds: float | None = None  # a multi-step step's time (not the forward modelled)
    # target steps the call ran: above 1, a lone greedy row's plain steps in one call (multi-step:
    # `seconds` None, `untimed_seconds` their time, one committed token each)
    num_steps: int = 1
    # the engine was away longer than this step took (an idle wait, other engines' time slices): a
    # cold start (caches holding other work's data), not what the arms' steps cost
    cold: bool = False
    draft_seconds: float | None = None  # the step's drafting as measured (proposals, and the plan around them)


@dataclass(frozen=True)
class StepPrediction:
    """What a policy's cost model predicted for a timed step (the drafter's long catch-ups left out)."""

    seconds: float  # the policy's cost model (the profile plus what it learned online)
    profile_seconds: float  # the hardware profile alone


@runtime_checkable
class Policy(Protocol):
    """Constructed with keyword context: k (the configured maximum), cost (a CostModel or None),
    has_draft_model (drafting costs a forward the profile times), block_drafter (a drafter on the
    target's features: its drafting, not profiled, is priced a round as measured; passed only when
    true, so a policy written for the first three keywords still loads)."""

    name: str
    needs_cost_model: bool
    needs_confidence: bool  # may read DraftBlock.confidence (else the drafter never computes it)

    def plan(self, seqs: Sequence[History], max_draft: Sequence[int]) -> list[int]:
        """Tokens to draft per sequence, each in [0, max_draft[i]]."""

    def hints(self) -> StepHints:
        """After `plan`: what this step reads (`StepHints`)."""

    def admit(self, seqs: Sequence[History], blocks: Sequence[DraftBlock], draft_seconds: float) -> list[int]:
        """Proposals to verify per sequence, each in [0, len(blocks[i].token_ids)] (causal for sampled rows).
        Not called for a step in which no row drafted and no grammar forces proposals."""

    def observe(self, seq: History, block: DraftBlock, num_verified: int, num_accepted: int) -> None:
        """After verification of `block.token_ids[:num_verified]`, of which num_accepted were kept
        (the engine calls it for rows that drafted or verified something only)."""

    def observe_step(self, timing: StepTiming) -> StepPrediction | None:
        """A decode step's cost; returns what the policy's cost model predicted for it (None: it
        has no cost model, or the step was not timed)."""

    def plain_next(self, num_seqs: int) -> bool:
        """The next step at this batch size drafts for no row, for certain (the scheduler may then
        give a lone greedy row several target steps in one call, and reserves no K/V for
        proposals)."""

    def forget(self, seq_id: int) -> None:
        """The request finished: drop its state."""


POLICIES = Registry("policy")
register_policy = POLICIES.register
available_policies = POLICIES.names
policy_class = POLICIES.get


def causal_lengths(blocks: Sequence[DraftBlock], keep: Callable[[int, int, float | None], bool]) -> list[int]:
    """Admitted length per block: proposal j (0-based) of block i is verified while
    `keep(i, j, confidence_j)` holds for it and every proposal before it. `keep` sees the
    position and the confidence of q_j, never the token: causal by construction."""
    out = []
    for i, b in enumerate(blocks):
        conf = b.confidence or [None] * len(b.token_ids)
        n = 0
        while n < len(b.token_ids) and keep(i, n, conf[n]):
            n += 1
        out.append(n)
    return out


class StatelessPolicy:
    """Defaults for every `Policy` method but `plan` and `admit`: no per-request state, no cost
    model, no hints."""

    needs_cost_model = False
    needs_confidence = False

    def hints(self) -> StepHints:
        return StepHints(reads_confidence=self.needs_confidence)

    def observe(self, seq: History, block: DraftBlock, num_verified: int, num_accepted: int) -> None:
        pass

    def observe_step(self, timing: StepTiming) -> StepPrediction | None:
        return None

    def plain_next(self, num_seqs: int) -> bool:
        return False

    def forget(self, seq_id: int) -> None:
        pass


__all__ = ["Policy", "StatelessPolicy", "StepHints", "StepPrediction", "StepTiming", "CostModel", "register_policy",
           "available_policies", "policy_class", "causal_lengths"]
