"""Verification of a batch in which some rows carry a tree of proposals (`DraftBlock.parents`).

The engine's forward feeds a tree row as [last committed token, node 0 .. node n-1]: the last
committed token is the root of a `TreeSpec` zone, node i sits at key root + 1 + i and attends the
context and its ancestors only (model/tree_attention.py). Then, per row:

- p at every slot with the slot's own history (committed output + the tokens on the path to the
  slot), through the same `process_logits` as a chain's (penalties, bias, min_tokens per node);
- chain rows keep `sampling.verify` (the ragged chain rule, unchanged); tree rows go through
  `sampling.tree.tree_rejection_sample` (greedy: the longest path on p's argmax; sampled:
  recursive rejection over siblings with the row's drafting mode), each with its own generator;
- the committed logits rows of a tree row are its slots along the accepted path, and the path
  (node indices) goes to postprocess, which moves the path's K/V onto consecutive positions
  (`keep_accepted_path`) before the usual rollback by bookkeeping.

Constrained rows never reach here as trees (speculation.py verifies a tree's main chain for
them: the grammar's fork walks one path).
"""
from __future__ import annotations

import math

import torch

from ..model.runner import ModelRunner
from ..model.tree_attention import TreeSpec
from ..proposers import DraftBlock
from ..sampling import process_logits
from ..sampling.processors import changes_logits
from ..sampling.grammar import grammar_bitmask
from ..sampling.tree import DraftTree, tree_rejection_sample
from ..sampling.verify import VerifyMetadata, flat_draft_probs
from ..sampling.verify import verify as verify_proposals
from .step_output import Verification


def tree_spec(root: int, blk: DraftBlock) -> TreeSpec | None:
    """The attention zone of a row whose last committed token is at key `root` (None: a chain)."""
    if blk.parents is None:
        return None
    return TreeSpec(root, (-1,) + tuple(p + 1 for p in blk.parents))


def slot_histories(blk: DraftBlock) -> list[list[int]]:
    """The proposals before each of the row's 1 + n logits rows: a chain's prefix, a tree's path."""
    n = len(blk.token_ids)
    if blk.parents is None:
        return [blk.token_ids[:j] for j in range(n + 1)]
    paths: list[list[int]] = [[]]
    for i, parent in enumerate(blk.parents):
        paths.append(paths[parent + 1] + [blk.token_ids[i]])
    return paths


def verify_with_trees(sampling: list, drafts: list[DraftBlock], logits: torch.Tensor, eos_ids: list[int],
                      vocab: int) -> Verification:
    """`LLMEngine.verify` for a batch with tree rows (`sampling`: ScheduledSeqs; logits `[N, V]`,
    1 + n rows each)."""
    if all(_takes_argmax(s.seq) for s in sampling):
        return _verify_argmax(sampling, drafts, logits)
    params, prompts, hists = [], [], []
    for s, blk in zip(sampling, drafts):
        for h in slot_histories(blk):
            params.append(s.seq.params)
            prompts.append(s.seq.prompt_ids)
            hists.append(s.seq.output_ids + h)
    bitmask = grammar_bitmask([s.seq.grammar for s in sampling], [b.token_ids for b in drafts], vocab)
    p_logits = process_logits(logits, params, prompts, hists, eos_ids=[eos_ids] * len(params),
                              token_bitmask=bitmask)  # [N, V]
    starts = [0]
    for b in drafts:
        starts.append(starts[-1] + 1 + len(b.token_ids))
    chains = [b for b, blk in enumerate(drafts) if not blk.is_tree]
    tokens, accepted, valid, pieces, paths = {}, {}, {}, {}, {}
    if chains:
        idx = torch.tensor([r for b in chains for r in range(starts[b], starts[b + 1])], dtype=torch.long)
        ids = [drafts[b].token_ids for b in chains]
        meta = VerifyMetadata.build(ids, [sampling[b].seq.params.is_greedy for b in chains])
        q = flat_draft_probs(ids, [drafts[b].probs for b in chains], vocab)
        res = verify_proposals(p_logits.index_select(0, idx), meta, q, [sampling[b].seq.generator for b in chains])
        for r, b in enumerate(chains):
            tokens[b], accepted[b], valid[b] = res.tokens(r), int(res.num_accepted[r]), bool(res.valid[r])
            pieces[b] = p_logits[starts[b] : starts[b + 1]]
    for b, blk in enumerate(drafts):
        if blk.is_tree:
            rows = p_logits[starts[b] : starts[b + 1]]  # [n + 1, V]
            path, last, ok = _sample_tree(rows, blk, sampling[b].seq, vocab)
            tokens[b] = [blk.token_ids[i] for i in path] + [last] if ok else []
            accepted[b], valid[b], paths[b] = len(path), ok, path
            pieces[b] = rows.index_select(0, torch.tensor([0] + [i + 1 for i in path]))
    order = range(len(drafts))
    offs = [0]
    for b in order:
        offs.append(offs[-1] + pieces[b].shape[0])
    rows_of = {s.seq.seq_id: b for b, s in enumerate(sampling)}
    return Verification(rows_of, [tokens[b] for b in order], [accepted[b] for b in order], [valid[b] for b in order],
                        offs[:-1], torch.cat([pieces[b] for b in order]), paths)


def _takes_argmax(seq) -> bool:
    """p is the argmax of the raw logits at every slot (as for a chain: greedy, nothing that changes
    the logits, no grammar; logprobs come from the same raw rows)."""
    return not changes_logits(seq.params, len(seq.output_ids)) and seq.grammar is None


def _verify_argmax(sampling: list, drafts: list[DraftBlock], logits: torch.Tensor) -> Verification:
    """Every row greedy on raw logits: one argmax per slot (numpy's first maximum, as
    `verify_argmax`), then each row follows its proposals while they equal the argmax at their
    parent's slot (a chain: the next proposal; a tree: the child holding it, siblings being
    distinct); a row with a NaN or an all -inf slot commits nothing. What `process_logits` and
    `tree_rejection_sample` decide for such rows, without their tensors."""
    raw = logits if logits.dtype == torch.float32 else logits.float()
    a = raw.detach().cpu().numpy()
    am = a.argmax(axis=-1).tolist()  # [N]
    tokens, accepted, valid, pieces, paths, base = [], [], [], [], {}, 0
    for b, blk in enumerate(drafts):
        n = len(blk.token_ids)
        ok = all(float(a[r, am[r]]) > -math.inf for r in range(base, base + n + 1))  # (NaN compares False)
        path: list[int] = []
        if ok:
            parents = blk.parents if blk.parents is not None else tuple(range(-1, n - 1))
            slot = -1  # the slot after the accepted path: -1 the root, else a node
            while True:
                want = am[base + slot + 1]
                nxt = next((i for i in range(slot + 1, n) if parents[i] == slot and blk.token_ids[i] == want), None)
                if nxt is None:
                    break
                path.append(nxt)
                slot = nxt
            tokens.append([blk.token_ids[i] for i in path] + [am[base + slot + 1]])
        else:
            tokens.append([])
        accepted.append(len(path))
        valid.append(ok)
        pieces.append([base] + [base + i + 1 for i in path])
        if blk.is_tree:
            paths[b] = path
        base += n + 1
    sel = [r for rows in pieces for r in rows]
    starts = [0]
    for rows in pieces[:-1]:
        starts.append(starts[-1] + len(rows))
    rows_of = {s.seq.seq_id: b for b, s in enumerate(sampling)}
    # (index_select: indexing by a list forks torch's thread team, milliseconds on a busy machine)
    return Verification(rows_of, tokens, accepted, valid, starts, raw.index_select(0, torch.tensor(sel)), paths)


def _sample_tree(rows: torch.Tensor, blk: DraftBlock, seq, vocab: int) -> tuple[list[int], int, bool]:
    """(accepted path, recovered or bonus token, usable) of one tree row; p's rows `[n + 1, V]`."""
    top = rows.max(dim=-1).values
    if bool(torch.isnan(top).any()) or bool((top == -torch.inf).any()):
        return [], -1, False  # an unusable distribution: nothing committed, the row fails alone
    tree = DraftTree(tuple(blk.parents), tuple(blk.token_ids), blk.drafting)
    greedy = seq.params.is_greedy
    p = rows if greedy else torch.softmax(rows, dim=-1)  # (greedy reads the argmax only)
    q = None if blk.probs is None or tree.drafting == "point" else blk.probs
    path, last = tree_rejection_sample(tree, p, q, seq.generator, greedy=greedy)
    return path, last, 0 <= last < vocab


def path_rows(rows: torch.Tensor, path: list[int] | None) -> torch.Tensor:
    """A row's fed rows [root, node 0 .. node n-1] (a drafter's feature rows) -> those of its root
    and accepted `path` (node indices), in order: a chain's committed prefix. A path of first nodes
    (or none: a chain) is a prefix already."""
    if not path or all(node == j for j, node in enumerate(path)):
        return rows
    return rows.index_select(0, torch.tensor([0] + [node + 1 for node in path], device=rows.device))


def keep_accepted_path(runner: ModelRunner, seq_id: int, num_tokens_before: int, path: list[int]) -> None:
    """Postprocess of a tree row: node i's K/V sits at position num_tokens_before + i; the accepted
    path's nodes move onto num_tokens_before, num_tokens_before + 1, ... (positions the tree's
    RoPE already gave them), so a truncation to the committed length then leaves exactly the
    chain's cache. Rejected nodes' positions lie past it: reused by the next step. (None: a chain.)"""
    if path:
        runner.move_kv(seq_id, [num_tokens_before + i for i in path],
                       [num_tokens_before + j for j in range(len(path))])
