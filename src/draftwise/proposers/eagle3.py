"""The EAGLE-3 drafter in the engine (`--method eagle3 --draft DIR`): k autoregressive steps of one
decoder layer on the target's fused features (model/eagle3.py), with its own paged cache.

The sharing arrangement is DSpark's (proposers/dspark.py):

- **Features.** The proposer declares the target layers it reads (`feature_layers`); the engine's
  target forwards return their outputs and postprocess hands each sequence's *committed* rows to
  `commit_features` (a prefill chunk's rows; a verification's last committed token and accepted
  proposals). Committed position t's row is fc_in([norm(g_t) ; norm(emb(x_{t+1}))]): x_{t+1} is
  committed by then (the token after a chunk, or the accepted / recovered / bonus token).
- **The drafter's cache** holds each committed row's K/V (`kv`, a `KVManager` over
  `cache [1, 2, slots, Hkv, D]`; the scheduler frees it with the sequence's other blocks) and the
  row itself (`rows [slots, H]`: the last committed one is the next round's step 1). Only committed
  rows are written, so its length is the target's `num_computed` after every step
  (`seq.draft_computed`) and rollback is bookkeeping: blocks reserved past it are truncated, and
  the draft steps' own K/V never enter it. A preempted sequence's recompute refills it.
- **Drafting** (`propose`): k steps for every drafting row, one forward of the layer per step for
  the whole batch (`Eagle3Drafter.draft`): step 1 is the row of the last committed position L-1,
  step j the drafter's own output of step j-1 with the token it drew there; every step attends the
  row's context K/V (positions < L-1, gathered from its slots and padded to the longest) and the
  round's earlier steps. `StepChooser` turns each step's logits into q_j (`process_logits`: the
  same temperature, top-k/top-p, penalties and grammar mask as the target's) and draws: greedy rows
  its argmax, sampled rows from it with their own generator, DraftBlock.probs = those q_j, so the
  rejection sampler stays exact. Confidences are max_x q_j(x). A row drafts num_draft tokens,
  fewer where its grammar ends.
- **Greedy rows whose q is their raw logits** (`raw_greedy`) draft in one kernel call instead
  (`Eagle3Kernel.greedy`, model/eagle3_native.py): the same steps, their argmax; the steps' K/V
  written to scratch slots past the paged ones (`step_slots`), so the committed cache is untouched.
  The other rows take one kernel call a step where the kernels run (`Eagle3Kernel.draft`: the
  step's layer and head, its logits back to `StepChooser`, the same scratch slots).
- **Trees** (`--tree N`, lab `eagle3:k=K:tree=N`): a greedy row drafted in that kernel call may
  take a spine tree instead of its chain: the k argmax tokens and each slot's runner-up as a leaf,
  the best nodes by calibrated gain up to the step's `TreeBudget` (draft_tree.spine_block, as the
  draft model's fused greedy rows), for a chain's drafting time. Verification keeps the accepted
  path's K/V, and the engine hands the drafter the feature rows of that path; other rows draft chains.
- **Cache writes** take one kernel call where the kernels run (`Eagle3Kernel.commit`: fc, fc_in,
  the layer's k/v and RoPE, the writes to the slots), else the drafter's PyTorch pieces.

p is the target, q the draft.
"""
from __future__ import annotations

import torch

from ..kv import KVManager, pool_tensor
from ..model.eagle3_native import Eagle3Kernel
from .base import DraftBlock, register_proposer
from .draft_tree import TreeRecord, spine_block
from .feature_cache import checked_drafter, commit_slots, padded_context, scratch_table
from .step_chooser import StepChooser, raw_greedy
from .tree_budget import NodeCalibration, TreeBudget, tree_rows


@register_proposer("eagle3")
class Eagle3Proposer:
    drafts_trees = True  # `tree` > 0 makes trees (SpecConfig.tree)
    needs_draft_model = True
    kv_pool_factor = 1  # the drafter's pool: as many blocks as the target's

    def __init__(self, draft=None, target=None, num_blocks: int = 0, block_size: int = 16,
                 eos_ids: list[int] | None = None, tree: int = 0, **_):
        draft = checked_drafter("eagle3", draft, target)
        self.drafter = draft.model
        cfg = draft.config
        self.feature_layers = tuple(cfg.target_feature_layers)
        self.eos_ids = list(eos_ids or [])
        self.kv = KVManager(num_blocks, block_size)
        dtype = next(self.drafter.parameters()).dtype
        self.device = next(self.drafter.parameters()).device
        slots = num_blocks * block_size
        self.cache = pool_tensor((1, 2, slots, cfg.num_key_value_heads, cfg.head_dim), dtype,
                                 self.device)  # [1, 2, slots, Hkv, D]
        self.rows = torch.zeros(slots, cfg.hidden_size, dtype=dtype, device=self.device)  # [slots, H]
        self.num_slots = slots  # the paged slots; the cache's further ones are the kernel's scratch
        self.catch_up_seconds = 0.0  # no catch-up: the context K/V are written in postprocess
        self.kernel = Eagle3Kernel.of(self.drafter) if self.device.type == "cpu" else None
        self.confidence = True  # max q_j per proposal (the engine turns it off when its policy reads none)
        self.tree = 1 if tree and self.kernel is not None else 0  # greedy rows' spine trees (a runner-up a slot)
        self.budget = TreeBudget()  # this step's (`set_tree_budget`)
        self.calibration = NodeCalibration()  # the trees' node acceptance from q(token)
        self._trees: dict[int, TreeRecord] = {}  # seq_id -> the drafted tree's record

    def set_tree_budget(self, budget: TreeBudget) -> None:
        self.budget = budget

    @torch.inference_mode()
    def commit_features(self, seq, start, features):
        """The rows and K/V of committed positions start .. start + n - 1, written into the drafter's
        cache; its length becomes start + n (blocks reserved past it are truncated)."""
        n = features.shape[0]
        if start != seq.draft_computed:
            raise ValueError(f"eagle3 drafter: features from position {start}, but its cache holds "
                             f"{seq.draft_computed} positions")
        if n == 0:
            return
        end = start + n
        nxt = seq.all_ids[start + 1: end + 1]  # x_{t+1} of each row
        if len(nxt) != n:
            raise ValueError(f"eagle3 drafter: features up to position {end - 1}, but the sequence has "
                             f"{seq.num_tokens} tokens (a row reads the token after it)")
        slots = commit_slots(self.kv, seq, start, n, "eagle3", self.device)  # [n]
        kern = self.kernel
        if kern is not None and kern.commits and n <= kern.max_rows and self.cache.dtype == self.rows.dtype == kern.dtype:
            kern.commit(features, nxt, start, slots, self.cache, self.rows)
            seq.draft_computed = end
            return
        d = self.drafter
        rows = d.row_input(d.fuse(features[None].to(self.device)), torch.tensor([nxt], device=self.device))  # [1, n, H]
        k, v = d.kv(rows, torch.arange(start, end, device=self.device)[None])  # [1, n, Hkv, D] each
        self.cache[0, 0, slots] = k[0].to(self.cache.dtype)
        self.cache[0, 1, slots] = v[0].to(self.cache.dtype)
        self.rows[slots] = rows[0].to(self.rows.dtype)
        seq.draft_computed = end

    def context(self, seq_ids: list[int], lengths: list[int]):
        """The rows' cached context, padded to the longest: (k, v [B, S, Hkv, D], positions [B, S]
        (HIDDEN_POSITION = padding), last [B, H] the row of each one's last position)."""
        slots, pos, last = padded_context(self.kv, seq_ids, lengths, self.device)
        return self.cache[0, 0][slots], self.cache[0, 1][slots], pos, self.rows[last]

    @torch.inference_mode()
    def propose(self, seqs, num_draft, num_forced=None):
        blocks = [DraftBlock([], None, []) for _ in seqs]
        rows = [i for i, n in enumerate(num_draft) if n > 0]
        if not rows:
            return blocks
        for i in rows:
            s = seqs[i]
            if s.draft_computed != s.num_tokens - 1 or s.draft_computed < 1:
                raise ValueError(f"eagle3 drafter: its cache holds {s.draft_computed} positions, the committed "
                                 f"context {s.num_tokens - 1}")
        fast = [i for i in rows if raw_greedy(seqs[i])] if self.kernel is not None else []
        if fast and not self.kernel.fits([seqs[i].draft_computed - 1 for i in fast], [num_draft[i] for i in fast]):
            fast = []
        if fast:
            nodes, trees = tree_rows(self.budget, self.tree, seqs, num_draft, lambda s: True)
            self._draft_greedy(seqs, num_draft, fast, blocks, {i: nodes[i] for i in trees if i in set(fast)})
        slow = [i for i in rows if i not in fast] if fast else rows
        if slow:
            self._draft_chosen(seqs, num_draft, slow, blocks)
        return blocks

    def _draft_greedy(self, seqs, num_draft, rows: list[int], blocks: list[DraftBlock],
                      trees: dict[int, int]) -> None:
        """Greedy rows whose q is their raw logits, in one kernel call (`Eagle3Kernel.greedy`): the
        steps' K/V go to scratch slots past the paged ones (the committed cache stays as it is).
        The rows `trees` (row -> its node budget) take a spine tree from the same steps: the chain
        and each slot's runner-up as a leaf, the best nodes by calibrated gain
        (draft_tree.spine_block)."""
        lengths = [seqs[i].draft_computed for i in rows]
        ks = [num_draft[i] for i in rows]
        first, slots = self.step_slots([seqs[i].seq_id for i in rows], lengths, ks)
        tokens, conf, logits = self.kernel.greedy(first, [n - 1 for n in lengths], ks, self.cache, slots,
                                                  self.confidence or bool(trees), logits=bool(trees))
        for r, i in enumerate(rows):
            if i in trees:
                lq = torch.log_softmax(logits[r, : ks[r]], dim=-1)  # [k, V]
                top = torch.topk(lq, 2, dim=-1)
                runner_up, p2 = top.indices[:, 1].tolist(), top.values[:, 1].exp().tolist()
                blk, record = spine_block(tokens[r], conf[r], runner_up, p2, trees[i], self.calibration,
                                          self.budget.price)
                blocks[i] = blk
                if record is not None:
                    self._trees[seqs[i].seq_id] = record
                continue
            blocks[i] = DraftBlock(tokens[r], None, conf[r] if conf is not None else [None] * ks[r])

    def step_slots(self, seq_ids: list[int], lengths: list[int], ks: list[int]):
        """For rows of `lengths` committed positions drafting ks steps: (step 1's rows [B, H], the
        slot of every position [B, Lmax]: the cache's below L - 1, scratch slots (`scratch_table`) from
        position L - 1, step 1's, to L + k - 2)."""
        self.cache, table, last = scratch_table(self.kv, self.cache, self.num_slots, seq_ids, lengths,
                                                [n - 1 for n in lengths], ks)
        return self.rows.index_select(0, torch.tensor(last, device=self.device)), table

    def _draft_chosen(self, seqs, num_draft, rows: list[int], blocks: list[DraftBlock]) -> None:
        """The other rows step by step, each token chosen from q (`StepChooser`): one kernel call a step
        where it runs (`Eagle3Kernel.draft`, the steps' K/V in scratch slots as `_draft_greedy`'s),
        else `Eagle3Drafter.draft`."""
        lengths = [seqs[i].draft_computed for i in rows]
        cut = [num_draft[i] for i in rows]
        choose = StepChooser([seqs[i] for i in rows], cut, self.eos_ids)
        steps = max(cut)
        if self.kernel is not None and self.kernel.fits([n - 1 for n in lengths], [steps] * len(rows)):
            first, slots = self.step_slots([seqs[i].seq_id for i in rows], lengths, [steps] * len(rows))
            self.kernel.draft(first, [n - 1 for n in lengths], steps, self.cache, slots, choose)
        else:
            k, v, pos, last = self.context([seqs[i].seq_id for i in rows], lengths)
            start = torch.tensor(lengths, device=self.device) - 1  # [B]: step 1 is position L-1's row
            self.drafter.draft(last, start, k, v, pos < start[:, None], steps, choose)
        for r, i in enumerate(rows):
            toks = choose.tokens[r]
            probs = torch.stack(choose.probs[r]) if choose.probs[r] else None  # [n, V]: q_j of a sampled row
            blocks[i] = DraftBlock(toks, probs, choose.max_q[r][: len(toks)])

    @torch.inference_mode()
    def cache_error(self, seq, target) -> float:
        """The largest difference, relative to the largest value, between the drafter's cached rows and
        K/V of `seq` and those of a fresh forward of `target` (the LlamaModel, no cache) over its
        committed tokens (`draftwise check`'s rollback check)."""
        n = seq.draft_computed
        ids = torch.tensor([seq.all_ids[: n + 1]], device=self.device)
        _, feats = target(ids[:, :n], feature_layers=self.feature_layers)
        d = self.drafter
        rows = d.row_input(d.fuse(feats), ids[:, 1:])  # [1, n, H]
        k, v = d.kv(rows, torch.arange(n, device=self.device)[None])
        slots = self.kv.slots([seq.seq_id], [n]).to(self.device)[0]  # [n]
        worst = 0.0
        pairs = ((self.cache[0, 0][slots], k[0]), (self.cache[0, 1][slots], v[0]), (self.rows[slots], rows[0]))
        for got, fresh in pairs:
            fresh = fresh.float()
            worst = max(worst, float((got.float() - fresh).abs().max() / max(1.0, float(fresh.abs().max()))))
        return worst

    def postprocess(self, seq, block, num_accepted, num_tokens_before):
        """Nothing to roll back: the cache holds committed rows only (`commit_features`). A verified
        tree (`block.nodes` its accepted path) teaches the node calibration."""
        record = self._trees.pop(seq.seq_id, None)
        if record is not None and block.nodes is not None:
            self.calibration.observe(record.parents, record.qs, record.firsts, block.nodes)

    def finish(self, seq):
        """The scheduler frees the sequence's blocks of the drafter's cache."""
        self._trees.pop(seq.seq_id, None)
