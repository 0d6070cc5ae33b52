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

3. `observe` (postprocess): what was verified and accepted, to calibrate; `forget` when a request
   finishes.

A new policy is a new file that registers itself with `register_policy`; the package's
`__init__` imports the built-ins.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

from ..proposers.base import DraftBlock, History
from ..registry import Registry
from .cost import CostModel


class Policy(Protocol):
    """Constructed with keyword context: k (the configured maximum), cost (a CostModel or None),
    has_draft_model (drafting costs a forward)."""

    name: str
    needs_cost_model: bool
    needs_confidence: bool  # reads DraftBlock.confidence (the drafter computes it only then)

    def plan(self, seqs: Sequence[History], max_draft: Sequence[int]) -> list[int]:
        """Tokens to draft per sequence, each in [0, max_draft[i]]."""

    def admit(self, seqs: Sequence[History], blocks: Sequence[DraftBlock], draft_seconds: float) -> list[int]:
        """Proposals to verify per sequence, each in [0, len(blocks[i].token_ids)] (causal for sampled rows).
        Not called for a step in which no row drafted and no grammar forces proposals."""

    def observe(self, seq: History, block: DraftBlock, num_verified: int, num_accepted: int) -> None:
        """After verification of `block.token_ids[:num_verified]`, of which num_accepted were kept
        (the engine calls it for rows that drafted or verified something only)."""

    def forget(self, seq_id: int) -> None:
        """The request finished: drop its state."""

    def observe_step(self, num_seqs: int, num_tokens: int, context: float, draft_lengths: list[int],
                     seconds: float | None, catch_up_seconds: float = 0.0,
                     untimed_seconds: float | None = None) -> tuple[float, float] | None:
        """A decode step took `seconds` (its prefill chunks' forward left out; B rows, T tokens fed,
        mean context, tokens drafted per row), of which `catch_up_seconds` went to the drafter's
        long catch-ups (a new prompt: the drafter's prefill); `seconds` None: the step ran its decode
        rows and prefill chunks in one forward (a mixed step), so its decode part was not timed, or
        it ran several target steps for a lone plain row (multi-step: `untimed_seconds` its time).
        Returns what the policy's cost model predicted for the step without those, and what the
        hardware profile alone predicted (None: it has no cost model, or nothing was timed)."""

    def plain_next(self, num_seqs: int) -> bool:
        """Optional: the next step at this batch size drafts for no row, for certain (the scheduler
        may then give a lone greedy row several target steps in one call, and reserves no K/V for
        proposals). Absent: never."""

    def expect_batch(self, num_seqs: int) -> None:
        """Optional, called before `plan`: the sequences the coming steps will decode together,
        this step's decoding rows plus those prefilling or waiting now (up to max_num_seqs). A
        step whose batch is still filling (requests arriving together) can then be decided for
        the batch its rows will run in, not for the few rows already decoding."""

    def reads_confidence(self) -> bool:
        """Optional, asked after `plan`: this step's `admit` and `observe` read the drafted blocks'
        confidences (the drafter computes them only then: ~3% of a batch-1 step with the draft
        model). Absent: `needs_confidence` decides once for the whole run."""


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


class _Stateless:
    """Defaults for policies without per-request state."""

    needs_cost_model = False
    needs_confidence = False

    def observe(self, seq: History, block: DraftBlock, num_verified: int, num_accepted: int) -> None:
        pass

    def forget(self, seq_id: int) -> None:
        pass

    def observe_step(self, num_seqs, num_tokens, context, draft_lengths, seconds,
                     catch_up_seconds=0.0, untimed_seconds=None) -> tuple[float, float] | None:
        return None


__all__ = ["Policy", "CostModel", "register_policy", "available_policies", "policy_class", "causal_lengths"]
