"""The speculative half of an engine step, and what it learns afterwards.

propose: the verification `Policy` plans how many tokens each decoding row drafts (0 = plain
decoding this step), the `Proposer` drafts them (a `DraftBlock` each), and the policy admits a
prefix of each block for verification (causally: never by looking at the proposal itself); a
constrained row's block is followed by the tokens its grammar forces next (free proposals, up to
the K/V the scheduler reserved). After verification, postprocess tells both what each row
accepted (`observe`) and the policy what the step cost (`observe_step`).
"""
from __future__ import annotations

import sys
import time

import torch

from ..model import act8
from ..model.loader import LoadedModel
from ..policies import CostModel, StepTiming, policy_class
from ..policies.cost import OnlineCost
from ..proposers import DraftBlock, proposer_class, proposer_for
from ..proposers.lookup_first import LookupFirst
from ..proposers.base import StepCosted
from ..proposers.tree_budget import SizedTrees, TreeBudget
from ..sampling.grammar import forced_tail
from .config import EngineConfig, SpecConfig
from .scheduler import ScheduledSeq
from .sequence import Sequence
from .stats import EngineStats

NO_DRAFT = DraftBlock([], None)


def cost_model(spec: SpecConfig, config: EngineConfig, target: LoadedModel, draft: LoadedModel | None) -> CostModel:
    """The cost model a policy optimises against: given, from --profile, or the cached hardware
    profile of this model pair (measured on first use)."""
    if spec.cost_model is not None:
        return spec.cost_model
    from ..policies.profile import load_or_measure

    draft_dtype = str(next(draft.model.parameters()).dtype).replace("torch.", "") if draft is not None else None
    profile = load_or_measure(
        target, draft, dtype=config.dtype, draft_dtype=draft_dtype, device=config.device,
        threads=torch.get_num_threads(), max_num_seqs=config.max_num_seqs, k=spec.k, path=spec.profile,
        log=lambda msg: print(msg, file=sys.stderr),
    )
    return profile.grid_cost()


class Speculation:
    """The proposer and the verification policy of an engine with a speculative method."""

    COLD_GAP = 0.001  # seconds away from decoding past which a step may start cold (and its own time)

    def __init__(self, spec: SpecConfig, config: EngineConfig, target: LoadedModel, draft: LoadedModel | None,
                 num_blocks: int, stats: EngineStats):
        # the draft model's method drafts across vocabularies where the draft's tokenizer differs
        cls, vocab_map = proposer_for(spec.method, target, draft)
        self.spec, self.stats = spec, stats
        self._last_step_end: float | None = None  # the previous decode step's end (perf_counter)
        self.vocab_size = target.config.vocab_size
        context = dict(
            target=target, draft=draft, num_blocks=num_blocks, block_size=config.block_size,
            eos_ids=target.eos_token_ids, ngram_max=spec.ngram_max, ngram_min=spec.ngram_min,
            suffix_depth=spec.suffix_depth, suffix_spec_factor=spec.suffix_spec_factor,
            suffix_min_prob=spec.suffix_min_prob, suffix_cache_tokens=spec.suffix_cache_tokens,
            prefix_caching=config.enable_prefix_caching, vocab_map=vocab_map,
        )
        self.proposer = cls(**context, tree=spec.tree if target.config.hybrid is None else 0)
        # a lookup before the drafter (proposers/lookup_first.py; the lookup drafts chains)
        self.lookup = None
        if spec.lookup:
            self.lookup = LookupFirst(proposer_class(spec.lookup)(**context, tree=0), self.proposer, spec.k,
                                      spec.lookup_min)
            self.proposer = self.lookup
        # a tree's rows attend through a mask and its path's K/V move after verification: not for a
        # hybrid target, whose recurrent state follows one path (a drafter's tree is then verified
        # as its main chain)
        self.trees = target.config.hybrid is None
        pcls = policy_class(spec.policy)
        # a drafter on the target's features (dspark) has no model of its own to profile: the cost
        # model is the target's, the drafting falls in its online residual
        profiled = None if self.proposer.feature_layers else draft
        cost = cost_model(spec, config, target, profiled) if pcls.needs_cost_model else None
        # (block_drafter only where it holds: a policy written for the first three keywords still loads)
        extra = {"block_drafter": True} if self.proposer.feature_layers else {}
        self.policy = pcls(k=spec.max_draft, cost=cost, has_draft_model=profiled is not None, **extra)
        # a proposer that sizes its drafts by a verified row's cost (suffix): the decode steps'
        # measured seconds, fitted in rows and tokens (an OnlineCost over an empty profile: at one
        # row a profile's grid holds single differences of its noise, docs/ARCHITECTURE.md), and in
        # passes over the weights where the kernels serve rows in blocks (AMX tiles: 16)
        self.step_cost = None
        if isinstance(self.proposer, StepCosted):
            self.step_cost = OnlineCost(CostModel((0.0,) * 4, (0.0,) * 3),
                                        row_block=act8.row_block(target.model))
            self.proposer.set_step_cost(self.step_cost)
        if hasattr(self.proposer, "confidence"):  # drafting skips what the policy never reads
            self.proposer.confidence = self.policy.needs_confidence
        # a policy that may read the confidences says after each plan whether this step does
        self._confidence_per_step = bool(getattr(self.proposer, "confidence", False))
        self._sized_trees = spec.tree > 0 and isinstance(self.proposer, SizedTrees)
        self.catch_up_seconds = 0.0  # this step's drafter catch-ups fed on their own (the proposer times them)

    def propose(self, decoding: list[ScheduledSeq]) -> tuple[dict[int, DraftBlock], dict[int, DraftBlock]]:
        """Plan -> draft -> admit -> forced tail. Returns the drafted blocks (what the drafter's
        cache holds) and the verified ones (an admitted prefix, then, for a constrained sequence,
        the tokens its grammar forces next), by seq_id."""
        self.catch_up_seconds = 0.0
        if not decoding:
            return {}, {}
        seqs = [s.seq for s in decoding]
        k = self.spec.max_draft  # (a multi-step row's num_draft is the tokens after its first, up to multi_step - 1)
        caps = [min(s.num_draft, k) for s in decoding]  # the scheduler's (a request's own cap included)
        plan = [max(0, min(n, cap)) for n, cap in zip(self.policy.plan(seqs, caps), caps)]  # whatever the policy
        hints = self.policy.hints()
        if self._confidence_per_step:
            self.proposer.confidence = hints.reads_confidence
        if self._sized_trees:  # a tree's nodes pay the planned step's price of a row, up to the row's cap
            self.proposer.set_tree_budget(TreeBudget(hints.node_price, caps))
        forced = [s.num_forced for s in decoding]
        if not any(plan) and not any(forced):  # no row drafts nor verifies: no drafter, nothing to admit
            none = dict.fromkeys([s.seq_id for s in seqs], NO_DRAFT)  # (a coasting plain step: cold
            return none, none  # Python after the forward, kept short)
        t0 = time.perf_counter()
        if any(plan):
            drafted = self.proposer.propose(seqs, plan, forced)
            self.catch_up_seconds = getattr(self.proposer, "catch_up_seconds", 0.0)
        else:  # no row drafts: the drafter does not run
            drafted = [NO_DRAFT] * len(seqs)
        admitted = self.policy.admit(seqs, drafted, time.perf_counter() - t0)
        blocks = {}
        for s, b, n, m in zip(decoding, drafted, admitted, plan):
            b = b.truncated(n)
            if b.is_tree and (s.seq.grammar is not None or not self.trees):  # verified as its main chain
                b = b.main_chain()
            if s.num_forced and s.seq.grammar is not None:
                if not b.forced_done:  # (the draft model has already appended what the grammar forces)
                    tail = forced_tail(s.seq.grammar, b.token_ids, s.num_draft + s.num_forced - len(b.token_ids))
                    b = b.extended(tail, self.vocab_size)
                self.stats.forced_tokens += max(0, len(b.token_ids) - m)  # free: beyond the planned drafting
            blocks[s.seq.seq_id] = b
        return {s.seq_id: b for s, b in zip(seqs, drafted)}, blocks

    def observe(self, seq: Sequence, drafted: DraftBlock, verified: DraftBlock, num_accepted: int,
                num_tokens_before: int, path: list[int] | None = None) -> None:
        """A row's outcome (postprocess, after its tokens were committed): the proposer's cache
        follows the committed path, the policy calibrates. A drafted tree: the proposer gets its
        accepted path (`path`, or the accepted part of a verified main chain); the policy, whose
        acceptance is per position, the tree's main chain and how much of it was accepted."""
        if drafted.token_ids and self.lookup is not None and self.lookup.drafted_by_lookup(seq):
            self.stats.lookup_rounds += 1
            self.stats.lookup_accepted_tokens += num_accepted
        if not drafted.is_tree:
            self.proposer.postprocess(seq, drafted, num_accepted, num_tokens_before)
            if self.step_cost is not None and drafted.token_ids:
                self.proposer.observe_verified(seq, drafted, len(verified.token_ids), num_accepted)
            self.policy.observe(seq, drafted, len(verified.token_ids), num_accepted)
            return
        nodes = list(path) if path is not None else list(verified.nodes or ())[:num_accepted]
        self.proposer.postprocess(seq, drafted.along(nodes), len(nodes), num_tokens_before)
        if self.step_cost is not None and verified.is_tree:  # (a step-costed drafter drafts chains where
            # trees are verified as their main chain)
            self.proposer.observe_verified(seq, drafted, len(verified.token_ids), len(nodes), path=nodes)
        main = verified.main_chain() if verified.is_tree else verified
        on_main = 0
        while on_main < min(len(nodes), len(main.token_ids)) and nodes[on_main] == main.nodes[on_main]:
            on_main += 1
        self.policy.observe(seq, drafted.main_chain(), len(main.token_ids), on_main)

    def observe_step(self, decoding: list[ScheduledSeq], drafted: dict[int, DraftBlock],
                     blocks: dict[int, DraftBlock], seconds: float, *, timed: bool, several_steps: int,
                     span: tuple[float, float] | None = None, draft_seconds: float | None = None) -> None:
        """Tell the policy what a decode step cost; record its prediction against the clock.
        `timed`: its decode rows ran in a forward of their own (not a mixed step);
        `several_steps`: the target steps a lone row ran in one call (multi-step; 0: one step);
        `span`: the step's (start, end) on the clock: a step that began longer after the previous
        decode step's end than it took is cold (`StepTiming.cold`); `draft_seconds`: its drafting."""
        cold = False
        if span is not None:
            gap = span[0] - self._last_step_end if self._last_step_end is not None else 0.0
            cold = gap > max(self.COLD_GAP, span[1] - span[0])
            self._last_step_end = span[1]
        b = len(decoding)
        ctx = sum(s.seq.num_tokens for s in decoding) / b
        tokens = b + sum(len(blk.token_ids) for blk in blocks.values())
        lengths = [len(blk.token_ids) for blk in drafted.values()]
        catch_up = self.catch_up_seconds
        untimed = None
        if several_steps:  # not the forward modelled: its time, for budgets
            untimed, seconds = seconds, None
        if not timed:  # its decode part was not timed apart from the prefill chunks
            seconds = None
        if self.step_cost is not None and seconds is not None:
            self.step_cost.observe(b, tokens, ctx, [], seconds - catch_up)
        predicted = self.policy.observe_step(StepTiming(b, tokens, ctx, lengths, seconds, catch_up, untimed,
                                                        num_steps=max(1, several_steps), cold=cold,
                                                        draft_seconds=draft_seconds))
        if predicted is not None:  # against the decode step proper (the drafter's long catch-ups left out)
            self.stats.record_prediction(predicted.seconds, predicted.profile_seconds, seconds - catch_up)

    def forget(self, seq: Sequence) -> None:
        """A sequence ended: the proposer and the policy drop what they keep for it."""
        self.proposer.finish(seq)
        self.policy.forget(seq.seq_id)
