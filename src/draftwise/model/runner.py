"""ModelRunner: one model, its paged K/V cache tensor and its block tables.

`run(seq_ids, new_tokens, starts, num_logits)` places each sequence's new tokens at absolute
positions `start .. start+T-1` (K/V capacity must already be reserved), runs one forward over the
padded batch `[B, Tmax]` (or, on the fused CPU path, packed: one row per real token, when the
sequences feed different numbers of tokens: `_run_packed`), and returns logits only for the last
`num_logits[b]` positions of each sequence, flattened in batch order: `[sum(num_logits), vocab]`. The same call serves prefill
chunks, single-token decode, a drafter's steps and verification of `[last committed + K]`. With
`trees`, a sequence's rows may form a tree (model/tree_attention.py): such a step runs packed on
the fused CPU path (the kernels take each tree's parents), else padded on the PyTorch path with a
per-row mask, and `move_kv` then gathers an accepted path's K/V onto consecutive positions.

A hybrid model (model/hybrid.py) has K/V for its attention layers only and a recurrent state per
sequence (`self.state`, model/recurrent_state.py): rows passed as `provisional` (verification
blocks) keep their state updates aside until `commit_state(seq_id, num_computed)`; the others
advance it during the forward. Prefix caching is off for hybrid models (a cached block of K/V
says nothing of the recurrent state at its end).
"""
from __future__ import annotations

import torch

from ..kv import KVManager, pool_tensor
from .attention import AttentionMetadata, PagedMetadata
from .loader import LoadedModel
from .recurrent_state import RecurrentStatePool
from .tree_attention import TreeSpec, kernel_trees, tree_metadata


# a ragged batch whose longest sequence feeds at least this many tokens runs one forward per
# sequence when it cannot run packed (see `_run_split`); shorter ones are padded (a decode or
# verification batch, whose padded rows cost little next to reading the weights)
SPLIT_MIN_TOKENS = 32


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int = 16, prefix_caching: bool = False,
                 recurrent_rollback: str = "snapshot"):
        self.loaded = loaded
        self.model = loaded.model
        self.cfg = cfg = loaded.config
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.state = None  # the recurrent state pool of a hybrid model
        # a CPU model that can run a whole step in one kernel call (LlamaModel.native_logits)
        self._native = self.device.type == "cpu" and hasattr(self.model, "native_logits")
        hs = cfg.hybrid
        if hs is not None:
            self.state = RecurrentStatePool(len(hs.recurrent_layers), hs.num_v_heads, hs.k_head_dim, hs.v_head_dim,
                                            hs.conv_kernel, hs.conv_dim, self.dtype, self.device, recurrent_rollback)
            prefix_caching = False
        self.kv = KVManager(num_blocks, block_size, prefix_caching)
        if self.state is not None:  # the state slot goes with the sequence's blocks
            self.kv.free_hooks.append(self.state.free)
        num_kv_layers = len(hs.attention_layers) if hs is not None else cfg.num_hidden_layers
        self.cache = pool_tensor(
            (num_kv_layers, 2, num_blocks * block_size, cfg.num_key_value_heads, cfg.head_dim), self.dtype, self.device,
        )  # [layers, 2, num_slots, Hkv, D]

    @torch.inference_mode()
    def run(
        self,
        seq_ids: list[int],
        new_tokens: list[list[int]],
        starts: list[int],
        num_logits: list[int],
        return_hidden: bool = False,
        provisional: list[bool] | None = None,  # hybrid models: rows whose state waits for commit_state
        trees: list[TreeSpec | None] | None = None,  # [B] rows that form a tree (None: causal)
        feature_layers: tuple[int, ...] = (),  # also return these layers' outputs for every fed row
    ):
        """`feature_layers`: (logits, features [sum(lens), F * hidden]), those layers' outputs for every
        fed token in batch order (model/dspark.py reads them); the one-call `native_logits` copies
        them out where it runs."""
        B = len(seq_ids)
        lens = [len(t) for t in new_tokens]
        if feature_layers and (return_hidden or self.state is not None):
            raise ValueError("feature_layers: attention-only models, no return_hidden")
        if trees is not None and any(t is not None for t in trees):
            return self._run_tree(seq_ids, new_tokens, starts, num_logits, lens, trees, return_hidden, feature_layers)
        T = max(lens)
        ragged = B > 1 and T * B != sum(lens) and self.state is None and self.device.type == "cpu"
        if ragged and getattr(self.model, "packs", None) is not None and self.model.packs(T, self.cache):
            return self._run_packed(seq_ids, new_tokens, starts, num_logits, lens, return_hidden, feature_layers)
        if ragged and T >= SPLIT_MIN_TOKENS:  # long prefill chunks of different lengths: one forward each
            return self._run_split(seq_ids, new_tokens, starts, num_logits, return_hidden, feature_layers)
        # plain lists, one tensor each (per-element tensor writes cost more than the forward of a
        # small draft); padding: token 0 at position 0, marked invalid
        id_rows = [t + [0] * (T - len(t)) for t in new_tokens]
        pos_rows = [list(range(s, s + n)) + [0] * (T - n) for s, n in zip(starts, lens)]
        ends = [s + n for s, n in zip(starts, lens)]
        first = self.kv.contiguous_start(seq_ids[0], ends[0]) if B == 1 else None
        if first is not None:  # one sequence on consecutive slots (the usual case at batch 1)
            meta = AttentionMetadata.consecutive(first, starts[0], T, None, self.cfg.sliding_window)
        else:
            gather = self.kv.slots(seq_ids, ends)  # [B, L]
            window = self.cfg.sliding_window
            if T * B == sum(lens):  # no padding: every token writes its slot
                def build():  # the CPU positions (a GPU run moves the tensors below)
                    pos = torch.tensor(pos_rows, dtype=torch.long)
                    return AttentionMetadata.build_dense(pos, gather.gather(1, pos), gather, window)
            else:
                def build():
                    pos = torch.tensor(pos_rows, dtype=torch.long)
                    valid = torch.tensor([[1] * n + [0] * (T - n) for n in lens], dtype=torch.bool)
                    slot_mapping = torch.where(valid, gather.gather(1, pos.clamp(max=gather.shape[1] - 1)), -1)
                    return AttentionMetadata.build(pos, valid, slot_mapping, gather, window)
            # the key and new-token counts for the fused CPU path; the rest built if read
            meta = PagedMetadata(gather, ends, lens, build)
        rows = [b * T + t for b in range(B) for t in range(lens[b] - num_logits[b], lens[b])]
        if self._native and not return_hidden and self.state is None:  # one kernel call
            out = self.model.native_logits([t for r in id_rows for t in r], [p for r in pos_rows for p in r],
                                           B, T, self.cache, meta, max(ends), rows, feature_layers)
            if out is not None:
                return out if not feature_layers else (out[0], _fed_rows(out[1], lens, T))
        ids = torch.tensor(id_rows, dtype=torch.long)
        pos = torch.tensor(pos_rows, dtype=torch.long)
        dev = self.device
        if dev.type != "cpu":
            ids, pos = ids.to(dev), pos.to(dev)
            meta = AttentionMetadata(*(None if t is None else t.to(dev)
                                       for t in (meta.write_index, meta.write_slots, meta.gather_slots, meta.mask)),
                                     gather_start=meta.gather_start)
        if self.state is None:  # hidden [B, T, hidden] (and feats [B, T, F * hidden])
            out = self.model(ids, pos, self.cache, meta, max_position=max(ends), feature_layers=feature_layers)
            hidden, feats = out if feature_layers else (out, None)
        else:
            sb = self.state.batch(seq_ids, starts, lens, provisional)
            hidden = self.model(ids, pos, self.cache, meta, state=sb)
            sb.finish()
        if T == 1:
            sel = hidden[:, 0]  # decode: one logits row per sequence, no gather
        else:
            sel = hidden.reshape(B * T, -1)[torch.tensor(rows, dtype=torch.long, device=dev)]
        logits = self.model.compute_logits(sel).cpu()  # [sum(num_logits), V]
        if feature_layers:  # every fed row, padding dropped: [sum(lens), F * hidden]
            return logits, _fed_rows(feats.reshape(B * T, -1), lens, T).cpu()
        if return_hidden:
            return logits, sel
        return logits

    @torch.inference_mode()
    def greedy_steps(self, seq_id: int, feed: list[int], start: int, k: int, confidence: bool = False,
                     feature_layers: tuple[int, ...] = ()):
        """k greedy proposals of one sequence in one call (`LlamaModel.greedy_steps`): what k calls of
        `run` (feed, then each proposal but the last) and the argmax of their logits give. None
        where the model cannot (a hybrid or non-CPU model, another kernel layout): then `run`.
        `feature_layers`: a third entry, the features of every fed token [len(feed) + k - 1, F * hidden]."""
        fn = getattr(self.model, "greedy_steps", None)
        if fn is None or self.state is not None or self.device.type != "cpu":
            return None
        end = start + len(feed) + k - 1  # keys at the last step
        first = self.kv.contiguous_start(seq_id, end)
        slots = None if first is not None else self.kv.slots([seq_id], [end])[0].contiguous()
        return fn(feed, start, k, self.cache, first, slots, confidence, feature_layers)

    def greedy_steps_rows(self, seq_ids: list[int], feeds: list[list[int]], starts: list[int], ks: list[int],
                          confidence: bool = False, runners_up: bool = False):
        """`greedy_steps` for several sequences in one call (`LlamaModel.greedy_steps_rows`): ks[b]
        greedy proposals of sequence b, each step one packed forward of the sequences still drafting
        (`runners_up`: each step's runner-up token and probability too). None where the model
        cannot: then `run`."""
        fn = getattr(self.model, "greedy_steps_rows", None)
        if fn is None or self.state is not None or self.device.type != "cpu":
            return None
        ends = [s + len(f) + k - 1 for s, f, k in zip(starts, feeds, ks)]  # keys at each one's last step
        return fn(feeds, starts, ks, self.cache, self.kv.slots(seq_ids, ends), confidence, runners_up)

    def _run_split(self, seq_ids, new_tokens, starts, num_logits, return_hidden, feature_layers=()):
        """`run` one sequence at a time: prefill chunks of different lengths, too long for the
        packed path, would be padded to the longest (16 prompts of 50-400 tokens: ~half the
        products wasted on padding); a forward of that many rows is bound by its arithmetic, not by
        reading the weights, so one forward per chunk costs the tokens fed and no more."""
        outs = [self.run([sid], [toks], [st], [nl], return_hidden=return_hidden, feature_layers=feature_layers)
                for sid, toks, st, nl in zip(seq_ids, new_tokens, starts, num_logits)]
        if return_hidden or feature_layers:
            return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
        return torch.cat(outs)

    def _run_packed(self, seq_ids, new_tokens, starts, num_logits, lens, return_hidden, feature_layers=(),
                    trees: list[TreeSpec | None] | None = None):
        """`run` for sequences feeding different numbers of tokens, without padding: one row per
        real token (a verification batch where rows verify 0..k proposals, a drafter's catch-up
        beside single tokens), so the products cost the tokens fed, not B x the longest. `trees`:
        rows that form trees, attended by the fused kernels (`kernel_trees`), at depth positions."""
        ends = [s + n for s, n in zip(starts, lens)]
        offs = [0]
        for n in lens:
            offs.append(offs[-1] + n)
        flat_ids = [t for row in new_tokens for t in row]
        trees = trees or [None] * len(lens)
        flat_pos = [p for s, n, tr in zip(starts, lens, trees)
                    for p in (range(s, s + n) if tr is None else tr.positions(s, n))]
        gather = self.kv.slots(seq_ids, ends)  # [B, L]: the fused kernels write each new token's K/V there
        meta = AttentionMetadata(None, None, gather, None, seq_lens=ends, seq_new=lens, row_offsets=offs,
                                 kernel_trees=kernel_trees(trees, ends))
        rows = [offs[b] + t for b in range(len(lens)) for t in range(lens[b] - num_logits[b], lens[b])]
        if self._native and not return_hidden:  # the whole step in one kernel call
            out = self.model.native_logits(flat_ids, flat_pos, len(lens), 0, self.cache, meta, max(ends), rows,
                                           feature_layers)
            if out is not None:
                return out
        ids = torch.tensor([flat_ids], dtype=torch.long)  # [1, N]
        pos = torch.tensor([flat_pos], dtype=torch.long)
        if feature_layers:  # rows are the fed tokens already: [1, N, F * hidden]
            hidden, feats = self.model(ids, pos, self.cache, meta, max_position=max(ends), feature_layers=feature_layers)
            return self.model.compute_logits(hidden[0].index_select(0, torch.tensor(rows, dtype=torch.long))), feats[0]
        hidden = self.model(ids, pos, self.cache, meta, max_position=max(ends))  # [1, N, hidden]
        sel = hidden[0].index_select(0, torch.tensor(rows, dtype=torch.long))
        logits = self.model.compute_logits(sel)  # [sum(num_logits), V]
        if return_hidden:
            return logits, sel
        return logits

    def _run_tree(self, seq_ids, new_tokens, starts, num_logits, lens, trees, return_hidden, feature_layers=()):
        """`run` for a batch in which some sequences' rows form a tree: packed on the fused CPU path
        where it runs (`_run_packed` with the trees), else one padded forward on the PyTorch path
        with a per-row mask (`tree_metadata`). Not for a hybrid model (its recurrent state follows
        one path). `feature_layers`: every fed row's, each tree node's own."""
        if self.state is not None:
            raise ValueError("tree attention needs an attention-only model (a hybrid's recurrent state is a chain)")
        if self._native and self.model.packs(max(lens), self.cache):
            return self._run_packed(seq_ids, new_tokens, starts, num_logits, lens, return_hidden, feature_layers,
                                    trees=list(trees))
        B, T = len(seq_ids), max(lens)
        ends = [s + n for s, n in zip(starts, lens)]
        gather = self.kv.slots(seq_ids, ends)  # [B, L]
        pos_rows, meta = tree_metadata(starts, lens, gather, list(trees), self.cfg.sliding_window)
        ids = torch.tensor([t + [0] * (T - len(t)) for t in new_tokens], dtype=torch.long)
        pos = torch.tensor(pos_rows, dtype=torch.long)
        dev = self.device
        if dev.type != "cpu":
            ids, pos = ids.to(dev), pos.to(dev)
            meta = AttentionMetadata(meta.write_index.to(dev), meta.write_slots.to(dev), meta.gather_slots.to(dev),
                                     meta.mask.to(dev))
        out = self.model(ids, pos, self.cache, meta, max_position=max(ends), feature_layers=feature_layers)
        hidden, feats = out if feature_layers else (out, None)  # [B, T, hidden], [B, T, F * hidden]
        rows = [b * T + t for b in range(B) for t in range(lens[b] - num_logits[b], lens[b])]
        sel = hidden.reshape(B * T, -1)[torch.tensor(rows, dtype=torch.long, device=dev)]
        logits = self.model.compute_logits(sel).cpu()  # [sum(num_logits), V]
        if feature_layers:
            return logits, _fed_rows(feats.reshape(B * T, -1), lens, T).cpu()
        return (logits, sel) if return_hidden else logits

    @torch.inference_mode()
    def move_kv(self, seq_id: int, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of positions `src` to positions `dst` of one sequence, every layer: a tree's
        accepted path onto the consecutive positions after the committed context (dst[j] <= src[j],
        both ascending; the gather reads every source before any write). The destinations lie past
        the sequence's committed positions, so never in a block the prefix cache shares."""
        pairs = [(s, d) for s, d in zip(src, dst) if s != d]
        if not pairs:
            return
        row = self.kv.slots([seq_id], [max(s for s, _ in pairs) + 1])[0]  # [L]
        s_idx = row[torch.tensor([s for s, _ in pairs], dtype=torch.long)].to(self.cache.device)
        d_idx = row[torch.tensor([d for _, d in pairs], dtype=torch.long)].to(self.cache.device)
        # (index_copy_ of an index_select: a tenth of the time of assigning through advanced indexing)
        self.cache.index_copy_(2, d_idx, self.cache.index_select(2, s_idx))

    def commit_state(self, seq_id: int, num_computed: int) -> None:
        """Postprocess of a hybrid model's provisional row: its recurrent checkpoint advances to
        `num_computed` positions (snapshot copy or replay); nothing to do for attention models."""
        if self.state is not None and seq_id in self.state.pending:
            with torch.inference_mode():
                self.state.commit(seq_id, num_computed)


def _fed_rows(feats: torch.Tensor, lens: list[int], T: int) -> torch.Tensor:
    """The rows of a padded batch's features [B * T, F * hidden] that hold fed tokens (sequence b's
    first lens[b]), in batch order: [sum(lens), F * hidden]."""
    if T * len(lens) == sum(lens):
        return feats
    fed = torch.tensor([b * T + t for b, n in enumerate(lens) for t in range(n)], dtype=torch.long, device=feats.device)
    return feats[fed]
