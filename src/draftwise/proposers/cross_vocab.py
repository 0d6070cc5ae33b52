"""A draft model whose tokenizer differs from the target's: drafting over the shared tokens, or text.

A sampled or constrained row's draft proposes only tokens of the **intersection** of the two
vocabularies (model/vocab_map.py: tokens whose bytes are the same in both). At each proposed
position its logits over the draft vocabulary are placed onto the shared tokens' target ids (-inf
elsewhere), then go through the same `process_logits` as p (temperature, top-k/p, penalties, bias,
min_tokens, the grammar mask: all on target ids). q is thus a proper distribution over the
target's vocabulary, zero outside the intersection, and a function of the committed history and
the proposals before it only: the rejection sampler is exact for sampled rows, and greedy rows are
exact by construction (the target decides every token).

A greedy row without logit processors or a grammar drafts **text** instead (`_propose_text`): the
draft's own greedy tokens over its whole vocabulary (k steps in one kernel call where the draft
model allows it), re-tokenized by the target's tokenizer (`VocabMap.target_tokens`), up to k target
tokens. Exact because the target decides every greedy token; it is accepted more often than the
intersection's argmax, which cannot follow the draft where its best token is not shared.

The draft's context is the committed target tokens translated one by one (`VocabMap.draft_tokens`:
a shared token is its draft id, any other its bytes re-encoded by the draft's tokenizer), kept
per sequence with the cumulative draft length after each target token (`DraftContext`). The
round's proposals are appended to it as target tokens too (translated the same way); after
verification the context is cut back to the committed target tokens (`truncate`: a list slice by
the cumulative lengths) and the draft's K/V length with it: rollback by bookkeeping. A text round
feeds the draft's own tokens, which the translated proposals need not repeat: its K/V stay valid
over the common prefix of the two (`DraftContext.keep_fed`). The recovered or bonus token is
translated in the next round, with the other committed tokens.

The draft's positions are not the target's, so this proposer keeps its own paged cache
(`ModelRunner`) and reserves in it itself (`kv` is None: the scheduler reserves target positions
only); a row whose context does not fit (the pool or the draft's context length) drafts nothing
that round. Chains only; a constrained row drafts under the grammar's mask and stops where the
mask leaves no shared token (the engine appends the tokens the grammar forces, as for any drafter).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..model.cpu_kernels import argmax_confidence
from ..model.runner import ModelRunner
from ..model.vocab_map import VocabMap
from ..sampling import process_logits
from ..sampling.grammar import bitmask_width
from ..sampling.processors import changes_logits
from ..sampling.rejection import categorical_from_uniform
from .base import DraftBlock, register_proposer

# the draft's cache holds the target's context in draft tokens, which re-encoding makes longer
# than in target tokens: this many times the target's blocks
POOL_FACTOR = 2
# an intersection below this fraction of the draft's vocabulary (or empty) is refused: such a
# draft could propose almost nothing the target would accept
MIN_SHARED_FRACTION = 0.05
LONG_CATCH_UP = 32  # context tokens a row feeds with its first proposal step; more: fed before the round


@dataclass
class DraftContext:
    """One sequence's context in draft tokens: the translated target tokens, the cumulative draft
    length after each, and how many draft positions hold valid K/V."""

    ids: list[int] = field(default_factory=list)  # draft ids of the target tokens so far
    ends: list[int] = field(default_factory=list)  # [target tokens] len(ids) after each one
    computed: int = 0  # draft positions whose K/V are valid (a prefix of ids)
    committed: int = 0  # target tokens of `ends` that are committed (the rest: this round's proposals)

    def extend(self, vmap: VocabMap, target_ids: list[int]) -> None:
        for t in target_ids:
            self.ids.extend(vmap.draft_tokens(t))
            self.ends.append(len(self.ids))

    def truncate(self, num_target: int) -> None:
        """Keep the first `num_target` target tokens' draft tokens (and the K/V within them)."""
        if num_target < len(self.ends):
            keep = self.ends[num_target - 1] if num_target else 0
            del self.ends[num_target:]
            del self.ids[keep:]
            self.computed = min(self.computed, keep)

    def keep_fed(self, fed: list[int]) -> None:
        """After a text round that wrote the K/V of draft ids `fed` at positions 0..: they stay valid
        as far as `fed` agrees with `ids`."""
        n = 0
        for a, b in zip(fed, self.ids):
            if a != b:
                break
            n += 1
        self.computed = n


@register_proposer("cross-vocab")
class CrossVocabProposer:
    needs_draft_model = True
    kv_pool_factor = POOL_FACTOR
    feature_layers: tuple[int, ...] = ()  # reads no target features

    def __init__(self, draft=None, target=None, num_blocks: int = 0, block_size: int = 16,
                 eos_ids: list[int] | None = None, tree: int = 0, vocab_map: VocabMap | None = None, **_):
        if draft is None or target is None:
            raise ValueError("speculative method 'cross-vocab' needs a target and a draft model (--draft DIR)")
        if tree:
            raise ValueError("tree: a draft whose vocabulary differs from the target's drafts chains only "
                             "(drop --tree)")
        self.vmap = vocab_map if vocab_map is not None else build_vocab_map(target, draft)
        self.runner = ModelRunner(draft, num_blocks * self.kv_pool_factor, block_size)
        self.kv = None  # (the draft's own positions: reserved here, not by the scheduler)
        self.eos_ids = list(eos_ids or [])
        self.vocab = target.config.vocab_size  # q lives on target ids
        self.max_positions = draft.config.max_position_embeddings
        self.contexts: dict[int, DraftContext] = {}  # seq_id -> its draft context
        self.confidence = True  # compute max q_j per proposal (the engine turns it off when unused)
        self.catch_up_seconds = 0.0  # the last propose's long catch-ups (left out of the step cost model)
        self.text = True  # greedy rows draft text, re-tokenized (False: over the intersection, as sampled rows)

    @torch.inference_mode()
    def propose(self, seqs, num_draft, num_forced=None):
        blocks = [DraftBlock([], None, []) for _ in seqs]
        feeds, starts = {}, {}
        for i, n in enumerate(num_draft):
            if n > 0 and self._ready(seqs[i], n):
                ctx = self.contexts[seqs[i].seq_id]
                feeds[i], starts[i] = ctx.ids[ctx.computed:], ctx.computed
        self._catch_up_long(seqs, feeds, starts)
        for i in [i for i in feeds if self._drafts_text(seqs[i])]:
            self._propose_text(seqs[i], blocks[i], feeds.pop(i), starts.pop(i), num_draft[i])
        cursors = {i: seqs[i].grammar.cursor() for i in feeds if seqs[i].grammar is not None}
        raw = not any(i in cursors or changes_logits(seqs[i].params, len(seqs[i].output_ids)) for i in feeds)
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in feeds}
        active = [i for i in feeds if feeds[i]]
        while active:
            active = self._step(seqs, active, num_draft, blocks, probs, feeds, starts, cursors, raw)
        for i, p in probs.items():
            if p:
                blocks[i].probs = torch.stack(p)  # [k_i, V target]
        return blocks

    def _drafts_text(self, seq) -> bool:
        """Does this row draft text (greedy, nothing changes its logits, no grammar)?"""
        return (self.text and seq.params.is_greedy and seq.grammar is None
                and not changes_logits(seq.params, len(seq.output_ids)))

    def _propose_text(self, seq, block: DraftBlock, feed: list[int], start: int, n: int) -> None:
        """n greedy draft steps over the draft's whole vocabulary, re-tokenized into at most n target
        tokens (the proposals, `block`); their translation joins the context, and the K/V written stay
        valid where it repeats the draft's tokens."""
        ctx = self.contexts[seq.seq_id]
        got = self.runner.greedy_steps(seq.seq_id, feed, start, n, self.confidence)
        if got is None:  # the draft's forward is not one kernel call: step by step
            got, fed_now, at = ([], [] if self.confidence else None), feed, start
            for _ in range(n):
                logits = self.runner.run([seq.seq_id], [fed_now], [at], [1]).float()  # [1, V draft]
                at += len(fed_now)
                (tok,), (conf,) = argmax_confidence(logits) if self.confidence else (logits.argmax(dim=1).tolist(),
                                                                                       [None])
                got[0].append(tok)
                if got[1] is not None:
                    got[1].append(conf)
                fed_now = [tok]
        drafted, confs = got[0], got[1]
        toks = self.vmap.target_tokens(drafted)[:n]
        fed = ctx.ids + drafted[:-1]  # (feed is the context's tail from `start`)
        ctx.extend(self.vmap, toks)
        ctx.keep_fed(fed)
        block.token_ids.extend(toks)
        block.confidence.extend(_spread(confs, drafted, toks, self.vmap) if confs is not None else [None] * len(toks))

    def _ready(self, seq, n: int) -> bool:
        """Translate the sequence's new committed tokens; reserve the draft's K/V for the round.
        False (the row drafts nothing) where the context does not fit."""
        ctx = self.contexts.setdefault(seq.seq_id, DraftContext())
        ctx.truncate(ctx.committed)  # proposals of a round that was never verified (a failed step)
        ctx.extend(self.vmap, seq.all_ids[ctx.committed:])
        ctx.committed = len(ctx.ends)
        # the last context token is fed with the first step (again, when its K/V are there already:
        # a target token without draft tokens added nothing after a rejection)
        ctx.computed = max(0, min(ctx.computed, len(ctx.ids) - 1))
        need = len(ctx.ids) + n - 1  # the context and all draft steps but the last
        if not ctx.ids or need + 1 > self.max_positions or not self.runner.kv.can_reserve(seq.seq_id, need):
            return False
        self.runner.kv.reserve(seq.seq_id, need)
        return True

    def _catch_up_long(self, seqs, feeds: dict, starts: dict) -> None:
        """Rows far behind (a new prompt) feed all but their last context token before the round,
        one forward each, so that the round's steps are not padded to their length."""
        t0 = time.perf_counter()
        for i, feed in feeds.items():
            if len(feed) > LONG_CATCH_UP:
                self.runner.run([seqs[i].seq_id], [feed[:-1]], [starts[i]], [1])
                ctx = self.contexts[seqs[i].seq_id]
                ctx.computed = starts[i] + len(feed) - 1
                feeds[i], starts[i] = feed[-1:], ctx.computed
        self.catch_up_seconds = time.perf_counter() - t0

    def _q_logits(self, seqs, active, blocks, feeds, starts, cursors, raw) -> torch.Tensor:  # [A, V target]
        """One draft forward of the rows `active`; its logits on the shared tokens' target ids
        (-inf elsewhere), through `process_logits` with the proposals so far in the history."""
        logits = self.runner.run([seqs[i].seq_id for i in active], [feeds[i] for i in active],
                                 [starts[i] for i in active], [1] * len(active))  # [A, V draft]
        out = torch.full((len(active), self.vocab), float("-inf"), dtype=torch.float32)
        out[:, self.vmap.shared_target] = logits[:, self.vmap.shared_draft].float()
        if raw:
            return out
        mask = None
        if any(i in cursors for i in active):
            mask = torch.full((len(active), bitmask_width(self.vocab)), -1, dtype=torch.int32)
            for r, i in enumerate(active):
                if i in cursors:
                    cursors[i].fill(mask[r])
        return process_logits(out, [seqs[i].params for i in active], [seqs[i].prompt_ids for i in active],
                              [seqs[i].output_ids + blocks[i].token_ids for i in active],
                              eos_ids=[self.eos_ids] * len(active), token_bitmask=mask)

    def _step(self, seqs, active, num_draft, blocks, probs, feeds, starts, cursors, raw) -> list[int]:
        """One proposal for each row of `active` (greedy: q's argmax; sampled: a draw from q).
        Returns the rows that draft on."""
        q_logits = self._q_logits(seqs, active, blocks, feeds, starts, cursors, raw)
        usable = torch.isfinite(q_logits).any(dim=1).tolist()  # a row the mask left no shared token: stops
        if self.confidence:
            argmax, conf = argmax_confidence(q_logits)
        else:
            argmax, conf = q_logits.argmax(dim=1).tolist(), [None] * len(active)
        sampled = [r for r, i in enumerate(active) if usable[r] and not seqs[i].params.is_greedy]
        q = torch.softmax(q_logits[sampled], dim=-1) if sampled else None  # [S, V target]
        drawn = dict(zip(sampled, _draw(q, [seqs[active[r]].generator for r in sampled]))) if sampled else {}
        nxt = []
        for r, i in enumerate(active):
            if not usable[r]:
                continue
            tok = drawn.get(r, argmax[r])
            if r in drawn:
                probs[i].append(q[sampled.index(r)])
            ctx = self.contexts[seqs[i].seq_id]
            ctx.computed = starts[i] + len(feeds[i])
            d = self.vmap.draft_id(tok)
            ctx.extend(self.vmap, [tok])  # the proposal is one draft token (a shared one)
            blocks[i].token_ids.append(tok)
            blocks[i].confidence.append(conf[r])
            starts[i], feeds[i] = ctx.computed, [d]
            if i in cursors:
                cursors[i].accept(tok)
            if len(blocks[i].token_ids) < num_draft[i] and not (i in cursors and cursors[i].done):
                nxt.append(i)
        return nxt

    def postprocess(self, seq, block, num_accepted, num_tokens_before):
        ctx = self.contexts.get(seq.seq_id)
        if ctx is None or not block.token_ids:
            return
        ctx.truncate(num_tokens_before + num_accepted)  # the accepted proposals are committed tokens
        ctx.committed = len(ctx.ends)
        self.runner.kv.truncate(seq.seq_id, ctx.computed)

    def draft_view(self, seq) -> tuple[list[int], int]:
        """(the sequence's committed tokens in draft tokens, draft positions whose K/V are valid):
        what a check of the drafter's cache compares against a fresh forward."""
        ctx = self.contexts.get(seq.seq_id, DraftContext())
        return self.vmap.translate(seq.all_ids)[0], ctx.computed

    def finish(self, seq):
        self.contexts.pop(seq.seq_id, None)
        self.runner.kv.free(seq.seq_id)


def _spread(confs: list[float], drafted: list[int], toks: list[int], vmap: VocabMap) -> list[float]:
    """Each proposed target token's confidence: the least of the draft steps whose tokens' bytes
    overlap its own."""
    ends, n = [], 0
    for d in drafted:
        n += vmap.byte_length(d, draft=True)
        ends.append(n)
    out, pos, j = [], 0, 0
    for t in toks:
        end = pos + vmap.byte_length(t, draft=False)
        lo = j
        while j < len(ends) - 1 and ends[j] < end:
            j += 1
        out.append(min(confs[lo : j + 1]))
        if ends[j] == end:
            j = min(j + 1, len(ends) - 1)
        pos = end
    return out


def _draw(q: torch.Tensor, generators) -> list[int]:
    """x ~ q for each row ([S, V]), one uniform from each row's generator, by the inverse CDF (as
    verification draws)."""
    u = torch.cat([torch.rand(1, dtype=torch.float64, generator=g,
                              device=g.device if g is not None else "cpu").cpu() for g in generators])
    return categorical_from_uniform(q, u.to(q.device)).tolist()


def _draft_tokenizer(draft):
    from tokenizers import Tokenizer

    f = Path(draft.path) / "tokenizer.json"
    if not f.is_file():
        return None
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # tokenizers raises a bare Exception
        raise ValueError(f"{f}: not a readable tokenizer ({e})") from None


def build_vocab_map(target, draft) -> VocabMap:
    """The intersection of the target's and the draft's vocabularies; ValueError when either has
    no tokenizer, or the intersection is empty or tiny."""
    tok = _draft_tokenizer(draft)
    if target.tokenizer is None or tok is None:
        which = f"{draft.path}/tokenizer.json" if tok is None else f"{target.path}/tokenizer.json"
        raise ValueError(f"the draft's vocabulary differs from the target's; mapping one onto the other needs "
                         f"both tokenizers ({which} is missing)")
    vmap = VocabMap(target.tokenizer, tok, target.config.vocab_size, draft.config.vocab_size)
    if vmap.size < MIN_SHARED_FRACTION * draft.config.vocab_size or vmap.size == 0:
        raise ValueError(f"the draft's vocabulary ({draft.path}) shares only {vmap.size} of its "
                         f"{draft.config.vocab_size} tokens with the target's ({target.path}): too few to draft "
                         f"with (at least {MIN_SHARED_FRACTION:.0%} needed)")
    return vmap


def same_vocabulary(target, draft) -> bool:
    """Do the draft's token ids mean the target's tokens? The same vocabulary size, and the same
    tokenizer (or the draft has none: it is taken to share the target's)."""
    if draft.config.vocab_size != target.config.vocab_size:
        return False
    f = Path(draft.path) / "tokenizer.json"
    tf = Path(target.path) / "tokenizer.json"
    if not f.is_file() or not tf.is_file() or f.read_bytes() == tf.read_bytes():
        return True
    from ..model.vocab_check import count_differing_tokens

    tok = _draft_tokenizer(draft)
    return target.tokenizer is None or count_differing_tokens(target.tokenizer, tok)[0] == 0


def drafting_class(method: str, target, draft):
    """The proposer class `method` runs as for this pair: the draft model's (`draft`) becomes
    drafting across vocabularies when the draft's tokenizer differs from the target's."""
    from .base import proposer_class

    if method != "draft" or draft is None or target is None or same_vocabulary(target, draft):
        return proposer_class(method)
    return proposer_class("cross-vocab")


def proposer_for(method: str, target, draft):
    """(`drafting_class`, and the vocabulary map where it drafts across vocabularies: said on stderr)."""
    from .base import proposer_class

    cls = drafting_class(method, target, draft)
    if cls is proposer_class(method):
        return cls, None
    vmap = build_vocab_map(target, draft)
    print(f"draftwise: the draft ({draft.path}) has another vocabulary than the target: drafting across "
          f"vocabularies over the {vmap.size} tokens both share (of the draft's {draft.config.vocab_size}, the "
          f"target's {target.config.vocab_size}); greedy and sampled output stay exact", file=sys.stderr)
    return proposer_class("cross-vocab"), vmap
