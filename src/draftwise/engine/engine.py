"""The engine: requests in, committed tokens out, one step at a time.

    step = schedule -> propose -> verify -> postprocess

- schedule (`Scheduler`): which sequences run, how many tokens each feeds, how many proposals each
  may verify (`num_draft`, and `num_forced` grammar-forced ones on top for a constrained
  sequence); K/V slots are reserved for them (target: last committed + num_draft + num_forced;
  drafter: its catch-up + num_draft + num_forced - 1; neither for drafted proposals when the
  policy is sure the step drafts nothing, `ScheduledSeq.plain`).
- propose (`Speculation`, speculation.py): the verification `Policy` plans how many tokens each
  decoding sequence drafts (0 = plain decoding this step), the `Proposer` drafts them (a
  `DraftBlock` each), and the policy admits a prefix of each block for verification (causally:
  never by looking at the proposal itself); a constrained sequence's block is followed by the
  tokens its grammar forces next (free proposals).
- verify: target forward -> `process_logits` (p at every position) -> `sampling.verify` (the pure
  selection rule over the ragged batch; tree rows: tree_verify.py) -> a typed `Verification`.
- postprocess: the only place state changes: committed tokens are appended one at a time with
  stop checks (so nothing after a stop is committed), cache lengths are set to the committed path
  (target and drafter: rollback by bookkeeping), finished sequences free their blocks. Each
  sequence is postprocessed on its own: an exception there fails that sequence alone.

A batched phase that raises is handled by `FailureIsolation` (isolation.py): the step's
sequences are requeued and re-admitted one by one until the culprit is found; the others are
unaffected. A failed sequence finishes with `finish_reason == "error"` and `seq.error` set.

Glossary: proposed (drafter's tokens), accepted (proposals kept), recovered (the replacement
drawn at the first rejection), bonus (the extra token when all proposals are accepted),
committed (accepted + recovered or bonus). p = target distribution, q = draft distribution.
`k` is the configured maximum of proposals per step; `num_draft` what one sequence verifies.
"""
from __future__ import annotations

import logging
import math
import time
from itertools import accumulate

import torch

from ..model.loader import LoadedModel
from ..model.runner import ModelRunner
from ..proposers import DraftBlock, drafting_class, proposer_class
from ..proposers.base import TargetSlotted
from ..sampling import SamplingParams, process_logits
from ..sampling.processors import changes_logits
from ..sampling.grammar import GrammarState, compile_constraint, grammar_bitmask
from ..sampling.verify import VerifyMetadata, flat_draft_probs, verify_argmax
from ..sampling.verify import verify as verify_proposals
from .config import EngineConfig, SpecConfig
from .detokenizer import Detokenizer, find_stop
from .isolation import FailureIsolation
from .kv_sizing import plan_kv
from .scheduler import ScheduledSeq, Scheduler
from .sequence import Sequence
from .speculation import NO_DRAFT, Speculation
from .stats import EngineStats
from .step_output import Committed, StepOutput, Verification
from .target_forward import forward_target
from .tree_verify import keep_accepted_path, path_rows, verify_with_trees

log = logging.getLogger("draftwise.engine")


def _takes_argmax(seq: Sequence) -> bool:
    """p is the argmax of the raw logits at every position this step: greedy, and no processor
    that would change the logits (bias, penalties, a min_tokens mask, a grammar). Logprobs are
    reported from the same raw rows (they are p's rows for such a sequence)."""
    return not changes_logits(seq.params, len(seq.output_ids)) and seq.grammar is None


class LLMEngine:
    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None = None,
        spec: SpecConfig | None = None,
        config: EngineConfig | None = None,
    ):
        self.spec = spec or SpecConfig()
        self.config = cfg = config or EngineConfig()
        self.target = target
        self.tokenizer = target.tokenizer
        self.eos_ids = target.eos_token_ids
        self.vocab_size = target.config.vocab_size
        cls = proposer_class(self.spec.method) if self.spec.method else None
        if cls is not None and cls.needs_draft_model and draft is None:
            raise ValueError(f"speculative method {self.spec.method!r} needs a draft model (--draft DIR)")
        max_len = target.config.max_position_embeddings
        if cls is not None and cls.needs_draft_model:
            max_len = min(max_len, draft.config.max_position_embeddings)
        if cfg.max_model_len:
            max_len = min(max_len, cfg.max_model_len)
        # the K/V pools, and the context they hold (kv_sizing: the model's own, or what fits them)
        drafter = drafting_class(self.spec.method, target, draft) if cls is not None and cls.needs_draft_model else None
        self.kv_plan = self._plan_kv(max_len, drafter, draft)
        self.max_model_len = max_len = self.kv_plan.max_model_len
        num_blocks = self.kv_plan.num_blocks
        self.stats = EngineStats(accepted_per_position=[0] * self.spec.max_draft)
        # the proposer and the verification policy (None: plain decoding)
        self.speculation = Speculation(self.spec, cfg, target, draft, num_blocks, self.stats) if cls else None
        self.proposer = self.speculation.proposer if self.speculation else None
        self.policy = self.speculation.policy if self.speculation else None
        # a drafter on the target's features (proposers/dspark.py) gets every committed row's features from
        # every forward that commits tokens (multi-step calls too); a prefix-cache hit skips them, so the target
        # caches prefixes only for a drafter whose rows live at its slots (`TargetSlotted`: a hit brings them)
        self.feature_layers = tuple(self.proposer.feature_layers) if self.proposer is not None else ()
        self._features: dict[int, tuple[int, torch.Tensor]] = {}  # this step's, by seq_id (target_forward)
        slotted = isinstance(self.proposer, TargetSlotted)
        self.runner = ModelRunner(target, num_blocks, cfg.block_size, recurrent_rollback=cfg.recurrent_rollback,
                                  prefix_caching=cfg.enable_prefix_caching and (slotted or not self.feature_layers))
        if slotted:
            self.proposer.use_target_slots(self.runner.kv)
        draft_kv = self.proposer.kv if self.proposer is not None else None
        # decode rows and prefill chunks in one forward (vLLM's mixed batches): where the model runs ragged
        # batches packed (the fused CPU kernels), so the decode rows ride along with a prefill chunk instead
        # of a forward of their own; not for a hybrid target (its recurrent state). A policy with a cost
        # model learns from the other steps only (a mixed step's decode part is not timed apart)
        packs = getattr(target.model, "packs", None)
        self.mixed = (packs is not None and self.runner.state is None and self.runner.device.type == "cpu"
                      and packs(1, self.runner.cache))
        self._mixed_step = False
        self._multi_stepped = 0  # target steps this step's lone row ran in one call (_multi_step; 0: none)
        self.scheduler = Scheduler(
            self.runner.kv, draft_kv, max_len, self.spec.max_draft, cfg.max_num_seqs, cfg.max_num_batched_tokens,
            max_forced=self.spec.max_forced, mixed_chunk=target.model.FUSED_MAX_TOKENS if self.mixed else None,
            multi_step=cfg.multi_step, draft_follows_target=slotted,
        )
        # a policy that knows the next step runs plain (a coasting lease) lets a lone greedy row
        # commit several tokens in one call there, as plain decoding does
        self.scheduler.plain_next = self.policy.plain_next if self.policy is not None else None
        self.isolation = FailureIsolation(self.scheduler)
        self.detok = Detokenizer(self.tokenizer)
        self.seqs: dict[str, Sequence] = {}

    def _plan_kv(self, max_len: int, drafter, draft: LoadedModel | None):
        """Blocks per K/V pool (the target's; a draft model's `drafter.kv_pool_factor` times as
        many) and the context they hold: see kv_sizing."""
        lookahead = self.spec.max_draft + 1  # forced proposals stay within the context (num_forced_for)
        pools = [(self.target, 1)] + ([(draft, drafter.kv_pool_factor)] if drafter is not None else [])
        return plan_kv(self.config, max_len, lookahead, pools)

    # ---------------------------------------------------------------- requests
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer.json; pass token ids instead of text")
        return self.tokenizer.encode(prompt).ids

    def check_request(self, prompt_ids: list[int], params: SamplingParams, compiled=None) -> None:
        """What needs the model: vocabulary and context length (values: `SamplingParams`), and the
        constraint compiled (cached by content) unless the caller has `compiled` it already (the
        server, off its event loop and within its limits: server/constraints.py)."""
        params.validate_vocab(self.vocab_size)
        if params.structured_output is not None and compiled is None:
            compile_constraint(self.tokenizer, self.vocab_size, self.eos_ids, params.structured_output)
        if not prompt_ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens; you requested {total} tokens "
                f"({len(prompt_ids)} in the prompt, {params.max_tokens} for the completion). "
                "Please reduce the prompt or max_tokens."
            )

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    compiled=None) -> Sequence:
        """`compiled`: the xgrammar CompiledGrammar of `params.structured_output`, when the caller
        has it (else it is compiled here, or found in the cache)."""
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_request(ids, params, compiled)
        if request_id in self.seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if compiled is not None and params.structured_output is not None:
            grammar = GrammarState(compiled, self.vocab_size)
        else:
            grammar = GrammarState.create(self.tokenizer, self.vocab_size, self.eos_ids, params.structured_output)
        seq = Sequence(request_id, ids, params, self.spec.max_draft)
        seq.grammar = grammar
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        self.stats.prompt_tokens += len(ids)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def release(self, request_id: str) -> None:
        """Forget a finished request (the caller has read its output)."""
        self.seqs.pop(request_id, None)

    def occupancy(self) -> dict:
        """Queue lengths and K/V blocks, for /health and /metrics."""
        def pool(kv):
            if kv is None:
                return None
            return {"total": kv.pool.num_blocks, "used": kv.pool.num_used, "free": kv.pool.num_free}

        return {
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "requests": len(self.seqs),
            "kv": {"target": pool(self.runner.kv), "draft": pool(self.scheduler.draft_kv)},
        }

    # ---------------------------------------------------------------- the step
    def step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        self._prefill_seconds = 0.0
        self.isolation.before_step()
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        t1 = time.perf_counter()
        decoding = [s for s in sched.scheduled if not s.seq.is_prefilling]
        try:
            drafted, blocks = self.propose([s for s in decoding if s.num_draft > 0 or s.plain])
            t2 = time.perf_counter()
            ver = self.verify(sched.scheduled, blocks)
        except Exception as e:  # a batched phase: nothing committed yet
            log.exception("engine step failed")
            culprits = self.isolation.on_failure([s.seq for s in sched.scheduled])
            return [self.fail(seq, f"internal error while generating: {type(e).__name__}: {e}") for seq in culprits]
        t3 = time.perf_counter()
        outputs = self.postprocess(sched.scheduled, drafted, blocks, ver, t2 - t1, t3 - t2)
        self.isolation.after_step([s.seq for s in sched.scheduled])
        t4 = time.perf_counter()
        st = self.stats
        if drafted:
            st.decode_steps += 1
            st.speculative_steps += any(b.token_ids for b in blocks.values())
            # the step's decode part: its time without the prefill chunks' forward
            self.speculation.observe_step(decoding, drafted, blocks, t4 - t0 - self._prefill_seconds, span=(t0, t4),
                                          timed=not self._mixed_step, several_steps=self._multi_stepped,
                                          draft_seconds=t2 - t1)
        st.steps += 1
        st.propose_seconds += t2 - t1
        st.verify_seconds += t3 - t2
        st.other_seconds += (t1 - t0) + (t4 - t3)
        st.grammar_seconds += sum(s.seq.grammar.take_seconds() for s in sched.scheduled if s.seq.grammar is not None)
        st.preemptions = self.scheduler.num_preemptions
        pc = self.runner.kv.prefix_cache
        if pc is not None:
            st.prefix_cache_queried_tokens, st.prefix_cache_hit_tokens = pc.queried_tokens, pc.hit_tokens
        dpc = self.scheduler.draft_kv.prefix_cache if self.scheduler.draft_kv is not None else None
        if dpc is not None:
            st.draft_prefix_cache_queried_tokens, st.draft_prefix_cache_hit_tokens = dpc.queried_tokens, dpc.hit_tokens
        return outputs

    def propose(self, decoding: list[ScheduledSeq]) -> tuple[dict[int, DraftBlock], dict[int, DraftBlock]]:
        """The drafted and the verified blocks by seq_id (`Speculation.propose`)."""
        if self.speculation is None or not decoding:
            return {}, {}
        return self.speculation.propose(decoding)

    @torch.inference_mode()
    def verify(self, scheduled: list[ScheduledSeq], blocks: dict[int, DraftBlock]) -> Verification:
        """Target forward -> p (`process_logits`) -> the selection rule (`sampling.verify`)."""
        multi = self._multi_step(scheduled, blocks)
        if multi is not None:
            return multi
        fwd = forward_target(self.runner, scheduled, blocks, self.mixed, self.feature_layers)
        self._mixed_step, self._prefill_seconds, self._features = fwd.mixed, fwd.prefill_seconds, fwd.features
        if self._features and hasattr(self.proposer, "stage_features"):  # all rows' projections in one product
            self.proposer.stage_features(self._features)
        sampling, logits = fwd.sampling, fwd.logits
        if not sampling:
            return Verification({}, [], [], [], [], None)
        drafts = [blocks.get(s.seq.seq_id, NO_DRAFT) for s in sampling]
        rows = {s.seq.seq_id: b for b, s in enumerate(sampling)}
        if any(b.is_tree for b in drafts):  # chains through verify, trees through sampling/tree.py
            return verify_with_trees(sampling, drafts, logits, self.eos_ids, self.vocab_size)
        ids = [b.token_ids for b in drafts]
        if all(_takes_argmax(s.seq) for s in sampling):  # greedy, nothing to process: p's argmax, on lists
            p_logits = logits if logits.dtype == torch.float32 else logits.float()
            toks, accepted, valid = verify_argmax(p_logits, ids)
            starts = [0, *accumulate(1 + len(d) for d in ids)][:-1]  # row b's first logits row
            return Verification(rows, toks, accepted, valid, starts, p_logits)
        # p at every position j of every sequence: history = output + proposals before j
        params, prompts, hists = [], [], []
        for s, blk in zip(sampling, drafts):
            for j in range(len(blk.token_ids) + 1):
                params.append(s.seq.params)
                prompts.append(s.seq.prompt_ids)
                hists.append(s.seq.output_ids + blk.token_ids[:j])
        bitmask = grammar_bitmask([s.seq.grammar for s in sampling], ids, self.vocab_size)  # [N, W] or None
        p_logits = process_logits(logits, params, prompts, hists, eos_ids=[self.eos_ids] * len(params),
                                  token_bitmask=bitmask)  # [N, V]
        meta = VerifyMetadata.build(ids, [s.seq.params.is_greedy for s in sampling])
        q = flat_draft_probs(ids, [b.probs for b in drafts], self.vocab_size)  # [sum(num_draft), V] or None
        result = verify_proposals(p_logits, meta, q, [s.seq.generator for s in sampling])
        return Verification.from_result(rows, meta, result, p_logits)

    def _multi_step(self, scheduled: list[ScheduledSeq], blocks: dict[int, DraftBlock]) -> Verification | None:
        """Plain decoding of a lone greedy sequence with nothing to process, which the scheduler let
        commit 1 + num_draft tokens, at most `EngineConfig.multi_step` (without speculation: nothing
        waiting; with it: a step in which the sequence drafts nothing, e.g. the policy runs plain
        steps or the drafter found nothing to propose):
        the target's greedy steps in one kernel call (`ModelRunner.greedy_steps`, what as many
        one-token steps compute: each token the argmax of the logits after the ones before). The
        tokens are committed one at a time with the stop checks, as every step's are; K/V written
        past a stop is dropped by bookkeeping. A drafter on the target's features gets those of
        every fed token (postprocess hands it the committed ones). None: the usual step (a sampled
        or processed row, a prefill, several rows, proposals to verify, a model without the fused
        steps)."""
        self._multi_stepped = 0
        if len(scheduled) != 1:
            return None
        s = scheduled[0]
        seq = s.seq
        if not s.num_draft or seq.is_prefilling or not s.samples or not _takes_argmax(seq) \
                or (seq.params.logprobs or 0) > 0 or blocks.get(seq.seq_id, NO_DRAFT).token_ids:
            return None
        feed = seq.all_ids[seq.num_computed : seq.num_tokens]
        # at most multi_step tokens, whatever k: a speculative row's drafter looks again after them
        n = min(1 + s.num_draft, self.scheduler.multi_step)
        lp = seq.logprobs is not None
        got = self.runner.greedy_steps(seq.seq_id, feed, seq.num_computed, n, confidence=lp,
                                       feature_layers=self.feature_layers)
        if got is None:
            return None
        if self.feature_layers:  # [len(feed) + num_draft, F * hidden], from position num_computed
            self._features = {seq.seq_id: (seq.num_computed, got[2])}
        self._multi_stepped = len(got[0])
        chosen = {0: [math.log(c) if c == c else c for c in got[1]]} if lp else {}  # (a NaN row: NaN)
        return Verification({seq.seq_id: 0}, [got[0]], [0], [True], [0], None, logprobs=chosen)

    def postprocess(self, scheduled: list[ScheduledSeq], drafted: dict[int, DraftBlock],
                    blocks: dict[int, DraftBlock], ver: Verification, propose_s: float,
                    verify_s: float) -> list[StepOutput]:
        outputs = []
        for s in scheduled:
            seq = s.seq
            b = ver.rows.get(seq.seq_id)
            try:
                if b is None:  # a prefill chunk that does not reach the end yet
                    seq.num_computed += s.num_new_tokens
                    self.runner.kv.cache_committed(seq.seq_id, lambda: seq.all_ids, seq.num_computed)
                    self._hand_features(seq)
                    continue
                if not ver.valid[b]:
                    raise ValueError("the target's distribution for this request is unusable (NaN logits or every "
                                     "token masked): check temperature, penalties and logit_bias")
                outputs.append(self._postprocess_one(seq, drafted.get(seq.seq_id), blocks.get(seq.seq_id),
                                                     ver.committed(b), propose_s, verify_s))
            except Exception as e:
                log.exception("postprocess failed for request %s", seq.request_id)
                outputs.append(self.fail(seq, f"error while generating: {type(e).__name__}: {e}"))
        return outputs

    def _postprocess_one(self, seq: Sequence, drafted: DraftBlock | None, blk: DraftBlock | None,
                         committed: Committed, propose_s: float, verify_s: float) -> StepOutput:
        a = committed.num_accepted
        n_before = seq.num_tokens
        if not seq.is_prefilling:  # a verification round (a prefill's first token is not a round)
            n_blk = len(blk.token_ids) if blk else 0  # forced proposals can make it longer than the drafted block
            self.stats.count_round(seq.stats, max(len(drafted.token_ids) if drafted else 0, n_blk), n_blk, a, propose_s,
                                   blk.confidence if blk else None, chain=not (blk and blk.is_tree))
        seq.stats.verify_seconds += verify_s
        new_ids, reason, stop_string = self._commit(seq, committed)
        for _ in new_ids[1 + a :]:  # a multi-step row's further tokens: one plain round each
            self.stats.count_round(seq.stats, 0, 0, 0, 0.0)
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        self.stats.generation_tokens += len(new_ids)
        if drafted is not None and (drafted.token_ids or blk.token_ids):  # (nothing drafted nor verified: nothing to do)
            self.speculation.observe(seq, drafted, blk, a, n_before, committed.path)
        if reason:
            self._finish(seq, reason, flush=not stop_string)
        else:
            keep_accepted_path(self.runner, seq.seq_id, n_before, committed.path)  # a tree's: consecutive
            seq.num_computed = seq.num_tokens - 1
            self.runner.kv.truncate(seq.seq_id, seq.num_computed)
            t0 = time.perf_counter()
            self.runner.commit_state(seq.seq_id, seq.num_computed)  # hybrid targets: recurrent rollback
            self.stats.rollback_seconds += time.perf_counter() - t0
            self.runner.kv.cache_committed(seq.seq_id, lambda: seq.all_ids, seq.num_computed)
            self._hand_features(seq, committed.path)
        return StepOutput(seq, new_ids, seq.is_finished)

    def _hand_features(self, seq: Sequence, path: list[int] | None = None) -> None:
        """A drafter on the target's features gets those of seq's newly committed positions (a prefill
        chunk's rows; a verification's last committed token and accepted proposals, a tree's `path`)."""
        got = self._features.pop(seq.seq_id, None)
        if got is not None:
            self.proposer.commit_features(seq, got[0], path_rows(got[1], path)[: seq.num_computed - got[0]])

    def _commit(self, seq: Sequence, committed: Committed) -> tuple[list[int], str | None, bool]:
        """Append committed tokens one at a time, stopping at the first stop condition.
        Returns (tokens appended, finish reason or None, whether a stop string ended it)."""
        new_ids, reason, stop_string = [], None, False
        toks = committed.tokens
        lps = committed.token_logprobs(seq.params.logprobs) if seq.logprobs is not None else None
        for j, tok in enumerate(toks):
            seq.output_ids.append(tok)
            new_ids.append(tok)
            if lps is not None:
                seq.logprobs.append(lps[j])
            reason = self._check_stop(seq, tok)
            if seq.grammar is not None and seq.grammar.accept(tok):  # the grammar has ended
                reason = "stop"
            if seq.params.stop:
                added = self.detok.step(seq)
                cut = find_stop(seq.text, len(added), seq.params.stop) if added else -1
                if cut != -1:
                    seq.text = seq.text[:cut]
                    reason, stop_string = "stop", True
            if reason:
                break
        if not seq.params.stop:
            self.detok.step(seq)
        return new_ids, reason, stop_string

    def fail(self, seq: Sequence, message: str) -> StepOutput:
        """Finish one sequence with an error (its stream ends with it); the others go on."""
        seq.error = message
        if not seq.is_finished:
            self._finish(seq, "error", flush=False)
        return StepOutput(seq, [], True)

    # ---------------------------------------------------------------- helpers
    def _check_stop(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        n = len(seq.output_ids)
        if n >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos_ids:
                return "stop"
            if p.stop_token_ids and tok in p.stop_token_ids:
                return "stop"
        if n >= p.max_tokens:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, flush: bool = True) -> None:
        self.scheduler.finish(seq)
        if flush and reason != "abort":
            self.detok.flush(seq)
        seq.finish_reason = reason
        if self.speculation is not None:
            self.speculation.forget(seq)
        seq.finish_time = time.perf_counter()
        seq.stats.total_seconds = seq.finish_time - seq.arrival_time
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
