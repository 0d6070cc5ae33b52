"""A separate draft model with its own paged K/V cache.

Each round the drafter first catches up on committed tokens it has not seen
(`all_ids[draft_computed:]`: the last committed token, or more after a prefill, a preemption, a
fully accepted round or steps without drafting; more than 32: fed before the round,
`_catch_up_long`), then runs num_draft - 1 more single-token steps.
Each proposal carries its confidence, max_x q_j(x), computed from q_j before x_j is drawn (what
a causal verification policy may read). At every proposed position q is
produced by the same `process_logits` as the target's p, with the proposed tokens before that
position in the history (greedy rows need only its argmax and carry no probs). The drafter never reads the target's K/V. After verification its cache
length is set back to the committed path (`postprocess`), by bookkeeping only; a hybrid drafter's
recurrent state (its steps are `provisional`, one growing block) is committed at that length.

Structured output: a constrained sequence drafts under the same grammar mask as p (a fork of its
matcher walks the proposals; `process_logits` gets the bitmask), so q never puts mass where p
cannot. Where the grammar allows exactly one token, one position after another, those tokens are
appended as proposals with q a point mass and confidence 1, without a draft forward of their own
(they are fed with the next one: forced tokens at the start of a round go in with the catch-up);
they are verified like any proposal (and always accepted). They count against `num_forced[i]`
first, so the drafter still drafts num_draft[i] tokens of its own after them (then against
num_draft[i]: with num_forced 0 they only save draft forwards).

With `tree` = W > 0 an unconstrained row that may verify N >= 2 proposals drafts a tree of at
most N nodes instead (draft_tree.py): a greedy row W children per expanded node (EAGLE-2's
"expand the most probable, keep the best N", candidates as point masses), a sampled row a tree
grown draw by draw where the next draw is worth most (draft_tree_sampled.py, at most W nodes fed
per drafter forward); constrained rows draft chains (their
grammar fork walks one path), and so does a hybrid drafter (its recurrent state is a chain).
A greedy tree's size comes from the step's `TreeBudget` (tree_budget.py, `set_tree_budget`): with a
price, up to the row's node cap, the nodes whose calibrated gain pays it; the calibration learns
from every verified greedy tree.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..model.cpu_kernels import argmax_confidence
from ..model.pair import LoadedDSpark, LoadedEagle3
from ..model.runner import ModelRunner
from ..sampling import process_logits
from ..sampling.rejection import categorical_from_uniform
from ..sampling.processors import changes_logits
from ..sampling.grammar import bitmask_width
from .base import DraftBlock, register_proposer
from .draft_tree import TreeRecord, draft_trees, keep_path, spine_trees
from .draft_tree_sampled import draft_sampled_trees
from .tree_budget import NodeCalibration, TreeBudget, tree_rows


@dataclass
class _Round:
    """One `propose` call's state, per row (an index into its seqs)."""

    blocks: list[DraftBlock]  # the proposals so far
    probs: list[list[torch.Tensor]]  # q_j of each proposal of a sampled row, [V] each
    feeds: dict[int, list[int]]  # the tokens the row feeds next (catch-up, last proposal, forced ones)
    starts: dict[int, int]  # the position of feeds[i][0]
    cursors: dict = field(default_factory=dict)  # the grammar's cursor of a constrained row
    left: dict[int, list[int]] = field(default_factory=dict)  # [drafted tokens left, forced budget left]
    unfed: dict[int, int] = field(default_factory=dict)  # proposals at the end of feeds[i] (not in the cache yet)
    short: dict[int, bool] = field(default_factory=dict)  # the last forced run stopped before its budget
    ran: set[int] = field(default_factory=set)  # rows whose catch-up the drafter has fed


@register_proposer("draft")
class DraftModelProposer:
    drafts_trees = True  # `tree` > 0 makes trees (SpecConfig.tree)
    needs_draft_model = True
    kv_pool_factor = 1  # the draft's pool: as many blocks as the target's
    feature_layers = ()  # reads no target features

    def __init__(self, draft=None, target=None, num_blocks: int = 0, block_size: int = 16,
                 eos_ids: list[int] | None = None, prefix_caching: bool = False, tree: int = 0, **_):
        if draft is None:
            raise ValueError("speculative method 'draft' needs a draft model (--draft DIR)")
        if isinstance(draft, LoadedDSpark):
            raise ValueError(f"{draft.path} is a DSpark drafter, not a draft model: use --method dspark")
        if isinstance(draft, LoadedEagle3):
            raise ValueError(f"{draft.path} is an EAGLE-3 drafter, not a draft model: use --method eagle3")
        if target is not None and draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft vocabulary size ({draft.config.vocab_size}, {draft.path}/config.json) does not match "
                f"the target's ({target.config.vocab_size}, {target.path}/config.json)"
            )
        # prefix caching for the drafter's own cache too (the scheduler matches a sequence's cached
        # prefix before the drafter first reserves for it; postprocess registers its committed
        # blocks): a prompt the target finds cached would otherwise be prefilled by the drafter
        # again (its catch-up) before the first proposal (off for a hybrid drafter, as for a target)
        self.runner = ModelRunner(draft, num_blocks, block_size, prefix_caching=prefix_caching)
        self.kv = self.runner.kv
        self.eos_ids = list(eos_ids or [])
        self.vocab = draft.config.vocab_size
        self._fed: dict[int, int] = {}  # seq_id -> proposals the last round fed to the draft cache
        self.confidence = True  # compute max q_j per proposal (the engine turns it off when unused)
        self.catch_up_seconds = 0.0  # the last propose's long catch-ups (see _catch_up_long)
        # greedy rows' k steps in one kernel call where the draft model allows it (ModelRunner.greedy_steps,
        # greedy_steps_rows for several rows): the same proposals; False keeps the step-by-step loop (tests)
        self.fused_steps = True
        self.tree = tree if draft.config.hybrid is None else 0  # children per expanded node (0: chains)
        self._tree_fed: dict[int, TreeRecord] = {}  # seq_id -> the drafted tree's record
        self.budget = TreeBudget()  # this step's (`set_tree_budget`)
        self.calibration = NodeCalibration()  # greedy trees' node acceptance from q(token)
        self.draw_calibration = NodeCalibration()  # sampled trees' first and later draws, from max q

    def set_tree_budget(self, budget: TreeBudget) -> None:
        self.budget = budget

    @torch.inference_mode()
    def propose(self, seqs, num_draft, num_forced=None):
        price = self.budget.price
        nodes, trees = tree_rows(self.budget, self.tree, seqs, num_draft,
                                 lambda s: getattr(s, "grammar", None) is None)
        if not trees:
            return self._propose_chains(seqs, num_draft, num_forced)
        tree_set = set(trees)
        blocks = self._propose_chains(seqs, [0 if i in tree_set else n for i, n in enumerate(num_draft)], num_forced)
        feeds = {i: seqs[i].all_ids[seqs[i].draft_computed :] for i in trees}
        starts = {i: seqs[i].draft_computed for i in trees}
        before = self.catch_up_seconds
        self._catch_up_long(seqs, feeds, starts)
        self.catch_up_seconds += before
        for sampled in (False, True):  # greedy rows: top-q trees (point); sampled: drawn spines (distinct)
            rows = [i for i in trees if (not seqs[i].params.is_greedy) == sampled]
            if not rows:
                continue
            args = ([seqs[i] for i in rows], [nodes[i] for i in rows], self.tree, self.eos_ids,
                    [feeds[i] for i in rows], [starts[i] for i in rows])
            raw = not any(changes_logits(seqs[i].params, len(seqs[i].output_ids)) for i in rows)
            got = None
            if sampled:
                got = draft_sampled_trees(self.runner, *args, calibration=self.draw_calibration)
            elif raw and self.fused_steps:  # the chain's fused call, with each slot's runner-up
                got = spine_trees(self.runner, [seqs[i] for i in rows], [max(1, num_draft[i]) for i in rows],
                                  [nodes[i] for i in rows], [feeds[i] for i in rows], [starts[i] for i in rows],
                                  self.calibration, price)
            if got is None:
                got = draft_trees(self.runner, *args, raw=raw, calibration=self.calibration, price=price)
            for i, (blk, record) in zip(rows, got):
                blocks[i] = blk
                if record is not None:
                    self._tree_fed[seqs[i].seq_id] = record
        return blocks

    def _propose_chains(self, seqs, num_draft, num_forced=None):
        active = [i for i, n in enumerate(num_draft) if n > 0]
        r = _Round([DraftBlock([], None, []) for _ in seqs], [[] for _ in seqs],
                   feeds={i: seqs[i].all_ids[seqs[i].draft_computed :] for i in active},
                   starts={i: seqs[i].draft_computed for i in active})
        self._catch_up_long(seqs, r.feeds, r.starts)
        r.cursors = {i: seqs[i].grammar.cursor() for i in active if getattr(seqs[i], "grammar", None) is not None}
        # [drafted, forced budget left] per row: forced tokens spend the forced budget first
        r.left = {i: [num_draft[i], num_forced[i] if num_forced else 0] for i in active}
        r.unfed = {i: 0 for i in active}
        for i in r.cursors:  # the round starts on forced tokens: fed with the catch-up
            r.unfed[i] += self._add_forced(r.cursors[i], r.blocks[i], r.probs[i], r.feeds[i], r.left[i], seqs[i],
                                           self.vocab, r.short, i)
        active = [i for i in active if r.left[i][0] > 0 and not (i in r.cursors and r.cursors[i].done)]
        # greedy rows with nothing to process (for the whole round: the rule reads the committed
        # history): q's argmax is the raw logits', process_logits is skipped
        raw = not any(i in r.cursors or changes_logits(seqs[i].params, len(seqs[i].output_ids)) for i in active)
        if raw and self.fused_steps and active and all(seqs[i].params.is_greedy for i in active):
            if self._fused_greedy(seqs, active, r):
                active = []
        while active:
            active = self._step(seqs, active, r, raw)
        for i, b in enumerate(r.blocks):
            if b.token_ids:  # proposals fed to the draft cache: all but the unfed tail (None: no forward ran)
                self._fed[seqs[i].seq_id] = len(b.token_ids) - r.unfed[i] if i in r.ran else None
            if r.probs[i]:
                b.probs = torch.stack(r.probs[i])  # [k_b, V]
            b.forced_done = i in r.cursors and (r.cursors[i].done or r.short[i])  # the engine need not look again
        return r.blocks

    def _fused_greedy(self, seqs, active: list[int], r: "_Round") -> bool:
        """All of the round's steps for the greedy rows `active` in one kernel call
        (`ModelRunner.greedy_steps`, `greedy_steps_rows` for several rows), leaving blocks, feeds
        and starts as `_step`'s loop would; False (nothing done) where the draft model cannot."""
        feeds, starts, left = r.feeds, r.starts, r.left
        if len(active) == 1:
            i = active[0]
            one = self.runner.greedy_steps(seqs[i].seq_id, feeds[i], starts[i], left[i][0], self.confidence)
            got = None if one is None else ([one[0]], None if one[1] is None else [one[1]])
        else:
            got = self.runner.greedy_steps_rows([seqs[i].seq_id for i in active], [feeds[i] for i in active],
                                                [starts[i] for i in active], [left[i][0] for i in active],
                                                self.confidence)
        if got is None:
            return False
        for row, i in enumerate(active):
            toks = got[0][row]
            r.blocks[i].token_ids.extend(toks)
            r.blocks[i].confidence.extend(got[1][row] if got[1] is not None else [None] * len(toks))
            starts[i] += len(feeds[i]) + len(toks) - 1
            feeds[i], r.unfed[i] = [toks[-1]], 1
            r.ran.add(i)
            left[i][0] = 0
        return True

    def _q_logits(self, seqs, active: list[int], r: "_Round", raw: bool) -> torch.Tensor:  # [A, V] float32
        """One draft forward of the rows `active` (each feeding feeds[i]) and q's logits at the next
        position: `process_logits` of the draft's, with the proposals so far in the history."""
        logits = self.runner.run(
            [seqs[i].seq_id for i in active], [r.feeds[i] for i in active], [r.starts[i] for i in active],
            [1] * len(active),
            provisional=[True] * len(active),  # a hybrid drafter's state waits for postprocess (else ignored)
        )  # [A, V]
        if raw:  # the same values process_logits would return
            return logits if logits.dtype == torch.float32 else logits.float()
        return process_logits(
            logits,
            [seqs[i].params for i in active],
            [seqs[i].prompt_ids for i in active],
            [seqs[i].output_ids + r.blocks[i].token_ids for i in active],
            eos_ids=[self.eos_ids] * len(active),
            token_bitmask=self._bitmask(active, r.cursors, logits.shape[1]),
        )

    def _step(self, seqs, active: list[int], r: "_Round", raw: bool) -> list[int]:
        """One proposal for each row of `active`: greedy rows take q's argmax, the others draw from q;
        then forced tokens after it. Returns the rows that draft on."""
        q_logits = self._q_logits(seqs, active, r, raw)
        # greedy rows need only the argmax (their verification ignores q); others need q
        sampled = [row for row, i in enumerate(active) if not seqs[i].params.is_greedy]
        q = torch.softmax(q_logits[sampled], dim=-1) if sampled else None  # [S, V]
        if self.confidence:  # confidence = max_x q_j(x): a function of q_j alone, known before x_j is drawn
            argmax, conf = argmax_confidence(q_logits)  # [A], [A]
        else:  # only greedy rows' argmax: numpy's (the first maximum, as torch.max's, and faster a row)
            argmax = q_logits.detach().cpu().numpy().argmax(axis=-1).tolist() if len(sampled) < len(active) else None
            conf = [None] * len(active)
        drawn = self._draw(q, [seqs[active[row]].generator for row in sampled]) if sampled else []
        nxt = []
        n_sampled = 0
        for row, i in enumerate(active):
            seq = seqs[i]
            if seq.params.is_greedy:
                tok = argmax[row]
            else:
                tok = drawn[n_sampled]
                r.probs[i].append(q[n_sampled])
                n_sampled += 1
            r.blocks[i].token_ids.append(tok)
            r.blocks[i].confidence.append(conf[row])
            r.starts[i] += len(r.feeds[i])
            r.feeds[i], r.unfed[i] = [tok], 1
            r.ran.add(i)
            r.left[i][0] -= 1
            if i in r.cursors:
                r.cursors[i].accept(tok)
                r.unfed[i] += self._add_forced(r.cursors[i], r.blocks[i], r.probs[i], r.feeds[i], r.left[i], seq,
                                               self.vocab, r.short, i)
            if r.left[i][0] > 0 and not (i in r.cursors and r.cursors[i].done):
                nxt.append(i)
        return nxt

    @staticmethod
    def _draw(q: torch.Tensor, generators) -> list[int]:
        """x_j ~ q_j for the sampled rows ([S, V]), each from one uniform of its own generator, by
        the inverse CDF (`categorical_from_uniform`, as verification draws): batched, several times
        faster than one torch.multinomial call per row."""
        u = torch.cat([torch.rand(1, dtype=torch.float64, generator=g,
                                  device=g.device if g is not None else "cpu").cpu() for g in generators])
        return categorical_from_uniform(q, u.to(q.device)).tolist()

    LONG_CATCH_UP = 32  # committed tokens a row feeds with its first proposal step; more: fed before it

    def _catch_up_long(self, seqs, feeds, starts) -> None:
        """A row far behind (a new prompt, many steps without drafting) feeds its committed tokens
        but the last before the round (rows up to FUSED_MAX_TOKENS behind together, packed; longer
        ones each in a forward of its own), so that the batch's first step is not padded (or
        packed) to its length; its K/V (a hybrid drafter: its checkpoint) then reach the last
        committed token, which the first step feeds as usual. Its time (`catch_up_seconds`: the
        drafter's prefill, in effect) is left out of the decode-step cost model, as the target's
        prefill chunks are."""
        t0 = time.perf_counter()
        long = [i for i, feed in feeds.items() if len(feed) > self.LONG_CATCH_UP]
        # rows up to FUSED_MAX_TOKENS behind go in one (packed) forward; longer ones one by one
        limit = getattr(self.runner.model, "FUSED_MAX_TOKENS", 0)
        batch = [i for i in long if len(feeds[i]) - 1 <= limit]
        groups = ([batch] if batch else []) + [[i] for i in long if i not in batch]
        for group in groups:
            pre = [feeds[i][:-1] for i in group]
            self.runner.run([seqs[i].seq_id for i in group], pre, [starts[i] for i in group], [1] * len(group))
            for i, p in zip(group, pre):
                seqs[i].draft_computed = starts[i] + len(p)
                starts[i], feeds[i] = seqs[i].draft_computed, feeds[i][-1:]
        self.catch_up_seconds = time.perf_counter() - t0

    def postprocess(self, seq, block, num_accepted, num_tokens_before):
        if block.nodes is not None:  # a tree's accepted path (`DraftBlock.along`)
            record = self._tree_fed.pop(seq.seq_id, None)
            if record is not None:
                m = keep_path(self.runner, seq.seq_id, num_tokens_before, record.fed, block.nodes)
                self._roll_back(seq, num_tokens_before + m)
                if record.draws:
                    self.draw_calibration.observe_draws(record.parents, record.qs, block.nodes)
                elif record.qs is not None:
                    self.calibration.observe(record.parents, record.qs, record.firsts, block.nodes)
            return
        n = len(block.token_ids)
        if n == 0:
            return
        fed = self._fed.pop(seq.seq_id, n - 1)
        if fed is None:  # forced tokens only: the drafter did not run, its cache is as it was
            return
        # the drafter fed the committed tokens and proposals d_1..d_{n-1} (fewer when forced tokens
        # ended the block); keep the accepted ones
        self._roll_back(seq, num_tokens_before + min(num_accepted, fed))

    def _roll_back(self, seq, draft_computed: int) -> None:
        seq.draft_computed = draft_computed
        self.kv.truncate(seq.seq_id, seq.draft_computed)
        self.runner.commit_state(seq.seq_id, seq.draft_computed)  # a hybrid drafter's recurrent state
        # the drafter's K/V of committed tokens only (accepted proposals are committed tokens)
        self.kv.cache_committed(seq.seq_id, lambda: seq.all_ids, seq.draft_computed)

    def finish(self, seq):
        self._fed.pop(seq.seq_id, None)  # (the scheduler frees the drafter's blocks)
        self._tree_fed.pop(seq.seq_id, None)

    @staticmethod
    def _bitmask(active, cursors, vocab: int) -> torch.Tensor | None:  # [A, W] int32 or None
        if not any(i in cursors for i in active):
            return None
        out = torch.full((len(active), bitmask_width(vocab)), -1, dtype=torch.int32)
        for r, i in enumerate(active):
            if i in cursors:
                cursors[i].fill(out[r])
        return out

    @staticmethod
    def _add_forced(cursor, block, probs, feed, left: list[int], seq, vocab: int, short: dict, row: int) -> int:
        """Append the tokens the grammar forces next (q = point mass), to be fed with the next step;
        `left` = [drafted tokens left, forced budget left], spent forced budget first. Returns how
        many; short[row] = whether the run ended before the budget did."""
        limit = left[0] + left[1]
        forced = cursor.forced_tokens(limit)
        short[row] = len(forced) < limit
        for tok in forced:
            left[1 if left[1] > 0 else 0] -= 1
            cursor.accept(tok)
            block.token_ids.append(tok)
            block.confidence.append(1.0)
            feed.append(tok)
            if not seq.params.is_greedy:
                probs.append(torch.nn.functional.one_hot(torch.tensor(tok), vocab).to(torch.float32))
        return len(forced)
