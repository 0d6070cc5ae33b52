"""The DSpark drafter in the engine (`--method dspark --draft DIR`): a block drafted on the target's
own features (model/dspark.py), with its own paged cache of context K/V.

The sharing arrangement:

- **Features.** The proposer declares the target layers it reads (`feature_layers`, from the
  drafter's config.json); the engine's target forwards (prefill chunks, verification) return those
  layers' outputs for every fed row, and postprocess hands each sequence's *committed* rows to
  `commit_features`: a prefill chunk's rows, and in verification the rows of [last committed,
  accepted proposals]. The recovered or bonus token has no features yet: it is the next anchor.
- **The drafter's cache** holds each committed position's `context_kv` per backbone layer in
  `cache [layers, 2, slots, Hkv, D]`, and with `anchor_feature` its fused feature in `fused
  [slots, H]` (a block reads its last position's: the slot of position L-1), at the **target's
  slots** (`use_target_slots`: the target's `KVManager`, `TargetSlotted`): position i of a sequence
  lives in the slot where the target keeps its K/V. Only committed rows are ever written, so its
  length is the target's `num_computed` after every step (`seq.draft_computed`), and rollback is the
  target's bookkeeping. A preempted sequence's prefill is recomputed with features and refills it.
  After the target's forward the engine hands all the step's fed rows to `stage_features`: where
  the kernels run they are all written in one call (model/dspark_native.py; a rejected row's lands
  past the committed length, as the target's K/V do, and is rewritten when its position commits),
  and each sequence's `commit_features` moves its length; else they are fused and projected in one
  product each and `commit_features` rotates and writes a sequence's committed rows.
  **Prefix caching**: a row here is a function of the tokens up to its position only (the target's
  features there), and every position in a block the target's prefix cache registers has been
  committed, its row written in the same step; so a prefix-cache hit, which skips the target's
  forward over the prefix and with it the features, finds the drafter's rows of that prefix in the
  shared blocks (the scheduler sets `draft_computed` to the matched length). Without
  `use_target_slots` (a proposer built outside an engine) the drafter keeps a pool of its own.
- **Drafting** (`propose`): one forward for every drafting row: the block [anchor, mask x
  (gamma-1)] at positions L .. L+gamma-1 (L = the row's committed context, the anchor its last
  committed token), each row's context K/V gathered from its slots and padded to the longest
  (padding never seen: `HIDDEN_POSITION`). Then `draw` left to right with `StepChooser`: at position k
  `process_logits` (temperature, top-k/top-p, penalties over history + the tokens drafted before k,
  a constrained row's grammar bitmask from a fork of its matcher) gives q_k; greedy rows take its
  argmax, sampled rows draw from it with their own generator. q_k reads the drafted x_{k-1}
  (the Markov head), and DraftBlock.probs carries exactly those q_k, so the rejection sampler stays
  exact. A row drafts min(num_draft, gamma) tokens (a block is cut, never extended), fewer where its
  grammar ends; its confidences are the confidence head's c_k (what the `dspark` policy admits by).
  Grammar-forced proposals are left to the engine (`forced_tail`).
- **Trees** (`--tree W`, lab `dspark:k=K:tree=W`): a greedy row whose q is its raw logits drafts a
  tree of at most K nodes instead, grown from its block's base logits by the Markov head
  (dspark_tree.py: EAGLE-2's best-K tree sized by the step's `TreeBudget`, each expansion a rank-r
  product, not a forward; inside the block's kernel call where it runs). Verification keeps the
  accepted path's K/V (engine/tree_verify.py), and the engine hands the drafter the feature rows
  of that path (its root's and its nodes'), which `commit_features` writes at the committed
  positions. Sampled rows draft chains.
  Where the kernels run the forward is one call (`DSparkKernel.block`, its block's own K/V in
  scratch slots past the paged ones), which also drafts the greedy rows whose q is their raw logits
  and the rows sampled with a temperature alone (`raw_greedy`, `temperature_only`: the same q_k,
  drawn with uniforms from the row's generator); the other rows take `draw` on its logits.

p is the target, q the draft.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..kv import KVManager, pool_tensor
from ..model.dspark_native import DSparkKernel, TreeRequest
from .base import DraftBlock, register_proposer
from .draft_tree import TreeRecord
from .dspark_tree import grows_trees, markov_trees, tree_block
from .feature_cache import checked_drafter, commit_slots, padded_context, scratch_table
from .step_chooser import StepChooser, raw_greedy, temperature_only
from .tree_budget import NodeCalibration, TreeBudget, tree_rows


@register_proposer("dspark")
class DSparkProposer:
    drafts_trees = True  # `tree` > 0 makes trees (SpecConfig.tree)
    needs_draft_model = True
    kv_pool_factor = 1  # the drafter's pool: as many blocks as the target's

    def __init__(self, draft=None, target=None, num_blocks: int = 0, block_size: int = 16,
                 eos_ids: list[int] | None = None, tree: int = 0, **_):
        draft = checked_drafter("dspark", draft, target)
        self.drafter = draft.model
        cfg = draft.config
        self.feature_layers = tuple(cfg.target_feature_layers)
        self.gamma = cfg.block_size
        self.eos_ids = list(eos_ids or [])
        self.slots = KVManager(num_blocks, block_size)  # its rows' slots: a pool of its own until `use_target_slots`
        self.kv = self.slots  # what the scheduler reserves besides the target's (None once the target's are used)
        dtype = next(self.drafter.parameters()).dtype
        self.device = next(self.drafter.parameters()).device
        self.num_slots = num_blocks * block_size  # the paged slots; the cache's further ones are the kernel's scratch
        self.cache = pool_tensor((cfg.num_hidden_layers, 2, self.num_slots, cfg.num_key_value_heads,
                                  cfg.head_dim), dtype, self.device)  # [layers, 2, slots, Hkv, D]
        # each committed position's fused feature, which the block after it reads (cfg.anchor_feature)
        self.fused = (torch.zeros(num_blocks * block_size, cfg.hidden_size, dtype=dtype, device=self.device)
                      if cfg.anchor_feature else None)  # [slots, H]
        self.catch_up_seconds = 0.0  # no catch-up: the context K/V are written in postprocess
        self.staged: dict = {}  # this step's projected feature rows by seq_id (`stage_features`)
        self.kernel = DSparkKernel.of(self.drafter) if self.device.type == "cpu" else None
        # greedy rows' trees (dspark_tree.py): children per expanded node (0: chains)
        self.tree = tree if grows_trees(self.drafter) else 0
        self.budget = TreeBudget()  # this step's (`set_tree_budget`)
        self.calibration = NodeCalibration()  # the trees' node acceptance from q(token)
        self._trees: dict[int, TreeRecord] = {}  # seq_id -> the drafted tree's record
        self.confidence = True  # (the engine turns it off when its policy reads none)

    def set_tree_budget(self, budget: TreeBudget) -> None:
        self.budget = budget

    def use_target_slots(self, kv: KVManager) -> None:
        """Keep the rows at the target's slots (`kv`: the target's KVManager, `cache` sized to its pool)."""
        if kv.pool.num_blocks * kv.block_size != self.num_slots:
            raise ValueError(f"dspark drafter: the target's pool has {kv.pool.num_blocks * kv.block_size} slots, "
                             f"its cache {self.num_slots}")
        self.slots, self.kv = kv, None

    @torch.inference_mode()
    def stage_features(self, features: dict[int, tuple[int, torch.Tensor]]) -> None:
        """A step's fed rows of every sequence (seq_id -> (first position, features [n, F*H]), as the
        target's forward returned them), at once: a row's values are a function of that row alone,
        and each weight is read once a step, not once a sequence. Where the kernels run on the
        target's slots every fed row is written now, in one call (`DSparkKernel.commit`): the rows of
        rejected proposals land where the target wrote their K/V, past the committed length, and
        are rewritten when those positions commit (rollback by bookkeeping, as the target's), so
        `commit_features` only moves the length. Else they are fused and projected (one product
        each) and `commit_features` rotates and writes a sequence's committed ones."""
        ids = [i for i, (_, rows) in features.items() if rows.shape[0]]
        self.staged = {}
        if not ids:
            return
        if self.kernel is not None:  # (a pool of its own: each commit is a call of its own)
            if self.kv is None:
                self._write_rows(features, ids)
            return
        fused, kv = self._project(torch.cat([features[i][1] for i in ids]))  # [1, N, H]; per layer k, v
        off = 0
        for i in ids:
            start, rows = features[i]
            n = rows.shape[0]
            rows_kv = [(k[:, off:off + n], v[:, off:off + n]) for k, v in kv]
            self.staged[i] = (start, rows, (fused[:, off:off + n], rows_kv))
            off += n

    def _write_rows(self, features: dict[int, tuple[int, torch.Tensor]], ids: list[int]) -> None:
        """Every fed row of the step into the drafter's cache at the target's slots, in one kernel call."""
        starts = [features[i][0] for i in ids]
        ends = [s + features[i][1].shape[0] for i, s in zip(ids, starts)]
        table = self.slots.slots(ids, ends).numpy()  # [B, max end]
        slots = torch.from_numpy(np.concatenate([table[b, s:e] for b, (s, e) in enumerate(zip(starts, ends))]))
        positions = [p for s, e in zip(starts, ends) for p in range(s, e)]
        self.kernel.commit(torch.cat([features[i][1] for i in ids]), positions, slots, self.cache, self.fused)
        self.staged = {i: (features[i][0], features[i][1], None) for i in ids}

    def _staged(self, seq, start: int, features: torch.Tensor):
        """This step's staging of the committed rows (`stage_features`) where they are a prefix of the
        step's rows: their projections, or None where they are written already; else False."""
        staged = self.staged.pop(seq.seq_id, None)
        if staged is not None and staged[0] == start and staged[1].shape[0] >= features.shape[0] \
                and staged[1].data_ptr() == features.data_ptr():
            return staged[2]
        return False

    def _project(self, rows: torch.Tensor):
        """Feature rows [n, F*H] -> fused [1, n, H] and each layer's unrotated k, v [1, n, Hkv*D]."""
        fused = self.drafter.fuse(rows[None].to(self.device))
        return fused, self.drafter.context_projections(fused)

    @torch.inference_mode()
    def commit_features(self, seq, start, features):
        """The context K/V of committed positions start .. start + n - 1, written into the drafter's
        cache; its length becomes start + n (blocks reserved past it are truncated)."""
        n = features.shape[0]
        if n == 0 or (self.kv is None and self.kernel is not None and self._staged(seq, start, features) is None):
            if start != seq.draft_computed:
                raise ValueError(f"dspark drafter: features from position {start}, but its cache holds "
                                 f"{seq.draft_computed} positions")
            seq.draft_computed = start + n  # (written in `stage_features`)
            return
        end = start + n
        slots = commit_slots(self.slots, seq, start, n, "dspark", self.device, own=self.kv is not None)  # [n]
        if self.kernel is not None:
            self.kernel.commit(features, range(start, end), slots, self.cache, self.fused)
            seq.draft_computed = end
            return
        staged = self._staged(seq, start, features)
        fused, projected = staged or self._project(features)
        fused, projected = fused[:, :n], [(k[:, :n], v[:, :n]) for k, v in projected]
        cos, sin = self.drafter.rope(torch.arange(start, end, device=self.device)[None])
        for i, (layer, (k, v)) in enumerate(zip(self.drafter.layers, projected)):
            k, v = layer.rotate_kv(k, v, cos, sin)  # [1, n, Hkv, D] each
            self.cache[i, 0, slots] = k[0].to(self.cache.dtype)
            self.cache[i, 1, slots] = v[0].to(self.cache.dtype)
        if self.fused is not None:
            self.fused[slots] = fused[0].to(self.fused.dtype)
        seq.draft_computed = end

    def context(self, seq_ids: list[int], lengths: list[int]):
        """Each drafter layer's context K/V of the rows, gathered from their slots and padded to the
        longest, and the fused feature of each row's last position: ([(k, v) [B, S, Hkv, D] per layer],
        positions [B, S] (HIDDEN_POSITION = padding), last [B, H] or None without `anchor_feature`)."""
        slots, pos, last_slot = padded_context(self.slots, seq_ids, lengths, self.device)
        last = self.fused[last_slot] if self.fused is not None else None  # [B, H]
        kv = [(self.cache[layer, 0][slots], self.cache[layer, 1][slots]) for layer in range(self.cache.shape[0])]
        return kv, pos, last

    @torch.inference_mode()
    def propose(self, seqs, num_draft, num_forced=None):
        blocks = [DraftBlock([], None, []) for _ in seqs]
        rows = [i for i, n in enumerate(num_draft) if n > 0]
        if not rows:
            return blocks
        lengths = []
        for i in rows:
            s = seqs[i]
            if s.draft_computed != s.num_tokens - 1:
                raise ValueError(f"dspark drafter: its cache holds {s.draft_computed} positions, the committed "
                                 f"context {s.num_tokens - 1}")
            lengths.append(s.draft_computed)
        anchors = [seqs[i].all_ids[-1] for i in rows]
        cut = [min(num_draft[i], self.gamma) for i in rows]
        nodes, trees = tree_rows(self.budget, self.tree, seqs, num_draft, raw_greedy)
        tree_set = set(trees)
        trees = [r for r, i in enumerate(rows) if i in tree_set]  # (positions in rows)
        grown = {}  # greedy rows' trees grown in the kernel call: row -> (block, record)
        if self.kernel is not None:
            fused = {r: nodes[rows[r]] for r in trees if self.kernel.sequential}
            hidden, base, done, grown = self._kernel_block(seqs, rows, lengths, anchors, cut, set(trees), fused)
        else:
            hidden, base, done = self._block_hidden(seqs, rows, lengths, anchors), None, {}
        for r, (toks, probs, conf) in done.items():
            blocks[rows[r]] = DraftBlock(toks, probs, conf)
        grow = [r for r in trees if r not in grown]
        if grow:
            sel = torch.tensor(grow)
            h = hidden[sel]  # [T, gamma, H]
            got = markov_trees(self.drafter, h, self.drafter.head(h) if base is None else base[sel],
                               [anchors[r] for r in grow], [nodes[rows[r]] for r in grow], self.tree,
                               self.calibration, self.budget.price, self.confidence)
            grown.update(zip(grow, got))
        for r, (blk, record) in grown.items():
            blocks[rows[r]] = blk
            if record is not None:
                self._trees[seqs[rows[r]].seq_id] = record
        slow = [r for r in range(len(rows)) if r not in done and r not in grown]
        if not slow:
            return blocks
        choose = StepChooser([seqs[rows[r]] for r in slow], [cut[r] for r in slow], self.eos_ids)
        k = max(cut[r] for r in slow)
        sel = torch.tensor(slow)
        drafted = self.drafter.draw(hidden[sel, :k], torch.tensor([anchors[r] for r in slow], device=self.device),
                                    choose, base=None if base is None else base[sel, :k])  # confidence [S, k]
        conf = drafted.confidence.tolist()
        for n, r in enumerate(slow):
            toks = choose.tokens[n]
            probs = torch.stack(choose.probs[n]) if choose.probs[n] else None  # [n, V]: q_k of a sampled row
            blocks[rows[r]] = DraftBlock(toks, probs, conf[n][: len(toks)])
        return blocks

    def _block_hidden(self, seqs, rows: list[int], lengths: list[int], anchors: list[int]) -> torch.Tensor:
        """The parallel stage in PyTorch: the rows' hidden states [B, gamma, H]."""
        kv, ctx_pos, last = self.context([seqs[i].seq_id for i in rows], lengths)
        anchor_pos = torch.tensor(lengths, device=self.device)[:, None]  # [B, 1]
        last = last[:, None] if last is not None else None  # [B, 1, H]: the fused feature of position L-1
        ids = torch.tensor(anchors, device=self.device)[:, None]
        return self.drafter.block_hidden(ids, anchor_pos, kv, ctx_pos, last)[:, 0]

    def _kernel_block(self, seqs, rows: list[int], lengths: list[int], anchors: list[int], cut: list[int],
                      trees: set[int], fused: dict[int, int]):
        """The parallel stage in one kernel call (`DSparkKernel.block`), and the sequential stage of the
        greedy rows whose q is their raw logits and of the rows sampled with a temperature alone (each
        row's uniforms from its generator): (hidden [B, gamma, H] and base logits [B, gamma, V] (None when
        every row was drafted here), {row: (tokens, q [n, V] or None, confidences)} of the rows drafted
        here, never the rows `trees`, whose base logits go to their trees; {row: (block, record)} of
        the greedy trees grown in the call, `fused` (row -> node budget)). The block's own K/V go to
        scratch slots past the paged ones."""
        g, B = self.gamma, len(rows)
        temps, ks, u = [0.0] * B, [0] * B, None
        for r, (i, c) in enumerate(zip(rows, cut)):
            s = seqs[i]
            if self.kernel.sequential and r not in trees and (raw_greedy(s) or temperature_only(s)):
                ks[r] = c
                if not s.params.is_greedy:
                    temps[r] = float(s.params.temperature)
                    if u is None:
                        u = torch.zeros(B, g, dtype=torch.float64)
                    u[r, :c] = torch.rand(c, dtype=torch.float64, generator=s.generator)
        ids = [seqs[i].seq_id for i in rows]
        self.cache, table, last = scratch_table(self.slots, self.cache, self.num_slots, ids, lengths, lengths, [g] * B)
        last = self.fused.index_select(0, torch.tensor(last)) if self.fused is not None else None  # [B, H]
        request = None
        if fused:
            floor = math.log(self.budget.price) if self.budget.price > 0 else -math.inf
            request = TreeRequest([fused.get(r, 0) for r in range(B)], self.tree, self.calibration.ratios(), floor,
                                  self.confidence)
        outputs = any(k == 0 and r not in fused for r, k in enumerate(ks))
        toks, conf, probs, logits, hidden, got = self.kernel.block(
            anchors, last, lengths, ks, self.cache, table, outputs, temps if u is not None else None, u, request)
        grown = {r: tree_block(*got[r]) for r in fused}
        return hidden, logits, {r: (toks[r], probs[r, :k] if temps[r] > 0 else None, conf[r])
                                for r, k in enumerate(ks) if k}, grown

    @torch.inference_mode()
    def cache_error(self, seq, target) -> float:
        """The largest difference, relative to the largest value, between the drafter's cached context
        K/V (and fused features, with `anchor_feature`) of `seq` and those of a fresh forward of
        `target` (the LlamaModel, no cache) over its committed tokens (`draftwise check`'s rollback
        check)."""
        n = seq.draft_computed
        _, feats = target(torch.tensor([seq.all_ids[:n]], device=self.device), feature_layers=self.feature_layers)
        fused = self.drafter.fuse(feats)  # [1, n, H]
        pairs = list(zip(self.context([seq.seq_id], [n])[0],
                         self.drafter.context_kv(fused, torch.arange(n, device=self.device)[None])))
        if self.fused is not None:
            slots = self.slots.slots([seq.seq_id], [n]).to(self.device)  # [1, n]
            pairs.append(((self.fused[slots],), (fused,)))
        worst = 0.0
        for got, fresh in pairs:
            for a, b in zip(got, fresh):
                b = b.float()
                worst = max(worst, float((a.float() - b).abs().max() / max(1.0, float(b.abs().max()))))
        return worst

    def postprocess(self, seq, block, num_accepted, num_tokens_before):
        """Nothing to roll back: the cache holds committed rows only (`commit_features`). A verified
        tree (`block.nodes` its accepted path) teaches the node calibration."""
        record = self._trees.pop(seq.seq_id, None)
        if record is not None and block.nodes is not None:
            self.calibration.observe(record.parents, record.qs, record.firsts, block.nodes)

    def finish(self, seq):
        """The scheduler frees the sequence's blocks (the target's, or the drafter's own pool's)."""
        self._trees.pop(seq.seq_id, None)
