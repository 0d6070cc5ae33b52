"""Failure isolation: an exception in a batched phase of a step must fail only its culprit.

Per-sequence work (postprocess, and rows `verify` finds unusable) fails its own sequence by
construction. A batched phase (the drafter's or the target's forward, `process_logits`,
`verify`) that raises does not say which sequence caused it. Nothing has been committed yet at
that point, so:

- one sequence in the step: it is the culprit;
- several: they are all requeued by recompute (exactly a preemption: their committed tokens are
  kept and their outputs unchanged) and become *suspects*; the scheduler's `admission_limit`
  then re-admits them one at a time, each joining sequences that already ran a step without
  failing. The suspect whose admission makes a step fail is the culprit;
- a failure that cannot be pinned on one new suspect fails every sequence of the step.

(A seeded sampled request caught in a failed step may not reproduce its seed's output: the step
had already drawn from its generator.)
"""
from __future__ import annotations

from .scheduler import Scheduler
from .sequence import Sequence, Status


class FailureIsolation:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.suspects: list[Sequence] = []  # requeued after a failure, not yet through a step
        self._waiting: set[int] = set()  # seq_ids of suspects waiting when the step began

    @property
    def active(self) -> bool:
        return bool(self.suspects)

    def before_step(self) -> None:
        self._waiting = {s.seq_id for s in self.suspects if s.status is Status.WAITING}

    def on_failure(self, scheduled: list[Sequence]) -> list[Sequence]:
        """The step's batched phase raised: returns the sequences to fail (none if requeued)."""
        probes = [s for s in scheduled if s.seq_id in self._waiting]
        if len(probes) == 1:  # the suspect admitted in this step made it fail
            culprits = probes
        elif not self._waiting and not self.suspects and len(scheduled) > 1:
            in_step = {s.seq_id for s in scheduled}
            order = [s for s in self.scheduler.running if s.seq_id in in_step]
            for s in reversed(order):  # requeued at the front, in their admission order
                self.scheduler.requeue(s)
            self.suspects = order
            culprits = []
        else:
            culprits = list(scheduled)
        self._update_limit(culprits)
        return culprits

    def after_step(self, ran: list[Sequence]) -> None:
        """The step succeeded: suspects that ran in it have passed."""
        if self.suspects:
            done = {s.seq_id for s in ran}
            self.suspects = [s for s in self.suspects if s.seq_id not in done]
            self._update_limit([])

    def _update_limit(self, leaving: list[Sequence]) -> None:
        """Admit one more suspect only when every running sequence has passed a step."""
        gone = {s.seq_id for s in leaving}
        self.suspects = [s for s in self.suspects if s.seq_id not in gone and not s.is_finished]
        sched = self.scheduler
        if not self.suspects:
            sched.admission_limit = None
            return
        untested = any(s.status is Status.RUNNING for s in self.suspects)
        running = len([s for s in sched.running if s.seq_id not in gone])
        sched.admission_limit = max(1, running + (0 if untested else 1))
