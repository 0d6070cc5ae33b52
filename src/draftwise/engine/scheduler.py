"""Continuous batching: a waiting queue, a running set, a per-step token budget.

`schedule()` decides, for one engine step, how many tokens each sequence feeds and how many
proposals it may verify, and reserves K/V slots for them (target and drafter) before anything
runs. Running sequences go first, in admission order; when a pool runs dry the most recently
admitted sequence is preempted by recompute (its blocks freed, its committed tokens kept, and it
is requeued at the front). Waiting requests are then admitted while blocks, the budget and
`max_num_seqs` (and `admission_limit`, which failure isolation lowers) allow; a long prompt is
prefilled in chunks (of at most `mixed_chunk` tokens while other sequences decode, when set: the
engine then runs decode rows and prefill chunks in one forward). The scheduler only reserves
capacity: committed tokens and lengths change in the engine's postprocess.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..kv import KVManager
from .sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens fed from all_ids[num_computed:]
    num_draft: int  # proposals this sequence may verify (0 while prefilling; without speculation:
    # further tokens it may commit this step, multi-step decoding)
    num_forced: int = 0  # grammar-forced proposals it may verify on top (structured output; K/V reserved)
    plain: bool = False  # it would draft, but the policy runs this step plain for certain (`plain_next`):
    # no K/V reserved for drafted proposals (num_draft 0; its `plan` sees 0), none for the drafter

    @property
    def samples(self) -> bool:
        """Does this step end at the sequence's last token (so a token is committed)?"""
        return self.seq.num_computed + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        target_kv: KVManager,
        draft_kv: KVManager | None,
        max_model_len: int,
        k: int,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 1024,
        max_forced: int = 0,
        mixed_chunk: int | None = None,
        multi_step: int = 1,
        draft_follows_target: bool = False,
    ):
        self.target_kv = target_kv
        self.draft_kv = draft_kv
        # the drafter's rows live at the target's slots (proposers/base.py's TargetSlotted): a
        # prefix-cache hit of the target holds them too, so its drafter starts at the matched length
        self.draft_follows_target = draft_follows_target
        self.max_model_len = max_model_len
        self.k = k
        self.max_forced = max_forced
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # the longest prefill chunk of a step that also decodes (None: the token budget): the engine
        # runs such a step as one forward, which takes chunks up to this many tokens
        self.mixed_chunk = mixed_chunk
        # without speculation (k = 0), or when `plain_next` says the step runs plain for certain: a
        # lone decoding sequence with nothing waiting may commit up to this many tokens a step (its
        # K/V reserved; the engine's multi-step path uses them)
        self.multi_step = multi_step
        self.plain_next: Callable[[int], bool] | None = None  # the policy's: num_seqs -> no row drafts next step
        self.admission_limit: int | None = None  # a lower cap on running sequences, when set
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def draft_cap(self, seq: Sequence) -> int:
        """The most proposals `seq` may verify per step: k, or less when its request asks
        (`SamplingParams.max_draft`; 0: it never speculates)."""
        cap = seq.params.max_draft
        return self.k if cap is None else min(self.k, cap)

    def num_draft_for(self, seq: Sequence, cap: int | None = None) -> int:
        """Proposals to verify (at most `cap`, default `draft_cap`): never past max_tokens nor past
        the context (depends on lengths only)."""
        left = seq.params.max_tokens - len(seq.output_ids) - 1
        room = self.max_model_len - seq.num_tokens
        return max(0, min(self.draft_cap(seq) if cap is None else cap, left, room))

    def num_forced_for(self, seq: Sequence, k: int, budget: int) -> int:
        """Forced proposals a constrained sequence may verify after its k drafted ones: the same
        limits (max_tokens, context, the step's token budget), only while it speculates."""
        if not k or seq.grammar is None:
            return 0
        left = seq.params.max_tokens - len(seq.output_ids) - 1 - k
        room = self.max_model_len - seq.num_tokens - k
        return max(0, min(self.max_forced, left, room, budget))

    def _reserve_ok(self, seq: Sequence, target_tokens: int, draft_tokens: int) -> bool:
        ok = self.target_kv.can_reserve(seq.seq_id, target_tokens)
        if ok and self.draft_kv is not None and draft_tokens:
            ok = self.draft_kv.can_reserve(seq.seq_id, draft_tokens)
        return ok

    def _reserve(self, seq: Sequence, target_tokens: int, draft_tokens: int) -> None:
        self.target_kv.reserve(seq.seq_id, target_tokens)
        if self.draft_kv is not None and draft_tokens:
            self.draft_kv.reserve(seq.seq_id, draft_tokens)

    def free(self, seq: Sequence) -> None:
        self.target_kv.free(seq.seq_id)
        if self.draft_kv is not None:
            self.draft_kv.free(seq.seq_id)

    def requeue(self, seq: Sequence) -> None:
        """Preempt a running sequence by recompute: its blocks are freed, its committed tokens
        kept, and it waits at the front of the queue (ahead of sequences requeued before it)."""
        self.running.remove(seq)
        self.free(seq)
        seq.num_computed = 0
        seq.draft_computed = 0
        seq.status = Status.WAITING
        seq.stats.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        chunk = budget
        if self.mixed_chunk and any(s.num_tokens - s.num_computed <= 1 for s in self.running):
            chunk = self.mixed_chunk  # decoding rows ride along: chunks the one forward can take
        # the policy is sure that no row drafts this step (a coasting lease of plain decoding, for
        # the rows that would draft: `plan`'s batch): no K/V for proposals nor for the drafter
        plain = False
        drafts = None  # num_draft_for each running sequence, worked out once (0 while prefilling)
        if self.k and self.plain_next is not None:
            drafts = [self.num_draft_for(s) if s.num_tokens - s.num_computed <= 1 else 0 for s in self.running]
            rows = len(drafts) - drafts.count(0)
            plain = rows > 0 and self.plain_next(rows)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            todo = seq.num_tokens - seq.num_computed
            held = False
            if todo > 1:  # prefill chunk
                n, k = min(todo, budget, chunk), 0
            else:
                n, k = 1, min(self.num_draft_for(seq) if drafts is None else drafts[i], budget - 1)
                if self.multi_step > 1 and len(self.running) == 1 and not self.waiting and (not self.k or plain):
                    k = min(self.num_draft_for(seq, self.multi_step - 1), budget - 1)  # tokens after the first
                else:
                    held = plain and k > 0
            f = self.num_forced_for(seq, k, budget - 1 - k)  # (forced proposals are verified in plain steps too)
            if held:
                k = 0
            # the drafter feeds forced tokens too (at most k + f - 1 proposals past the committed ones)
            draft_tokens = seq.num_tokens + k + f - 1 if k else 0
            # the drafter's first blocks for this sequence: its cached prefix (prefix caching; a
            # prompt the drafter's cache holds is not fed to the drafter again)
            if draft_tokens and self.draft_kv is not None and seq.draft_computed == 0:
                seq.draft_computed = self.draft_kv.match_prefix(seq.seq_id, seq.all_ids)
            while not self._reserve_ok(seq, seq.num_computed + n + k + f, draft_tokens):
                victim = self.running[-1]
                self.requeue(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is Status.WAITING:  # preempted itself: nothing after it runs either
                break
            self._reserve(seq, seq.num_computed + n + k + f, draft_tokens)
            out.scheduled.append(ScheduledSeq(seq, n, k, f, plain=held))
            budget -= n + k + f
            i += 1
        if out.preempted:
            return out
        limit = self.max_num_seqs if self.admission_limit is None else min(self.max_num_seqs, self.admission_limit)
        while self.waiting and budget > 0 and len(self.running) < limit:
            seq = self.waiting[0]
            if seq.num_computed == 0:  # a cached prefix needs no prefill (prefix caching)
                seq.num_computed = self.target_kv.match_prefix(seq.seq_id, seq.all_ids)
                if self.draft_follows_target:
                    seq.draft_computed = seq.num_computed
            n = min(seq.num_tokens - seq.num_computed, budget, chunk)
            if not self._reserve_ok(seq, seq.num_computed + n, 0):
                self.target_kv.free(seq.seq_id)  # the shared blocks go back; matched again next time
                seq.num_computed = seq.draft_computed = 0
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._reserve(seq, seq.num_computed + n, 0)
            out.scheduled.append(ScheduledSeq(seq, n, 0))
            budget -= n
        return out

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.free(seq)
        seq.status = Status.FINISHED
