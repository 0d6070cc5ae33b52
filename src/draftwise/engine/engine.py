"""The engine: requests in, committed tokens out, one step at a time.

    step = schedule -> propose -> verify -> postprocess

- schedule (`Scheduler`): which sequences run, how many tokens each feeds, how many proposals each
  may verify; K/V slots are reserved for them (target: last committed + k; drafter: its catch-up
  + k-1).
- propose (`Proposer`): a `DraftBlock` per decoding sequence (length 0..k).
- verify: one target forward over all decoding sequences' `[last committed, d_1..d_k]` (plus one
  for prefill chunks), `process_logits` gives p at every position; greedy rows keep proposals
  while they equal the argmax of p's logits (`greedy_accept`, no softmax), and the pure
  `rejection_sample` runs batched over the other rows' ragged block (`VerifyBatch`).
- postprocess: the only place state changes: committed tokens are appended one at a time with
  stop checks (so nothing after a stop is committed), cache lengths are set to the committed path
  (target and drafter: rollback by bookkeeping), finished sequences free their blocks.

Glossary: proposed (drafter's tokens), accepted (proposals kept), recovered (the replacement
drawn at the first rejection), bonus (the extra token when all proposals are accepted),
committed (accepted + recovered or bonus). p = target distribution, q = draft distribution.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..model.loader import LoadedModel
from ..proposers import DraftBlock, proposer_class
from ..sampling import SamplingParams, greedy_accept, process_logits, rejection_sample
from .config import EngineConfig, SpecConfig
from .detokenizer import Detokenizer, find_stop
from .verify_batch import VerifyBatch
from .runner import ModelRunner
from .scheduler import ScheduledSeq, Scheduler
from .sequence import Sequence, TokenLogprob
from .stats import EngineStats


@dataclass
class StepOutput:
    """What one step did to one sequence (for streaming): new tokens/text, finished or not."""

    seq: Sequence
    new_token_ids: list[int]
    new_text: str
    finished: bool


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
        max_len = target.config.max_position_embeddings
        cls = proposer_class(self.spec.method) if self.spec.method else None
        if cls is not None and cls.needs_draft_model and draft is None:
            raise ValueError(f"speculative method {self.spec.method!r} needs a draft model (--draft DIR)")
        if cls is not None and cls.needs_draft_model:
            max_len = min(max_len, draft.config.max_position_embeddings)
        if cfg.max_model_len:
            max_len = min(max_len, cfg.max_model_len)
        self.max_model_len = max_len
        lookahead = self.spec.num_spec + 1
        num_blocks = cfg.num_kv_blocks
        if num_blocks is None:
            tokens = min(cfg.max_num_seqs * (max_len + lookahead), max(cfg.kv_cache_max_tokens, max_len + lookahead))
            num_blocks = -(-tokens // cfg.block_size)
        min_blocks = -(-(max_len + lookahead) // cfg.block_size)
        if num_blocks < min_blocks:
            raise ValueError(f"num_kv_blocks must be >= {min_blocks} to hold one full context, got {num_blocks}")
        self.runner = ModelRunner(target, num_blocks, cfg.block_size)
        self.proposer = None
        if cls is not None:
            self.proposer = cls(
                target=target, draft=draft, num_blocks=num_blocks, block_size=cfg.block_size,
                eos_ids=self.eos_ids, ngram_max=self.spec.ngram_max, ngram_min=self.spec.ngram_min,
            )
        draft_kv = self.proposer.kv if self.proposer is not None else None
        self.scheduler = Scheduler(
            self.runner.kv, draft_kv, max_len, self.spec.num_spec, cfg.max_num_seqs, cfg.max_num_batched_tokens
        )
        self.detok = Detokenizer(self.tokenizer)
        self.stats = EngineStats(accepted_per_position=[0] * self.spec.num_spec)
        self.seqs: dict[str, Sequence] = {}

    # ---------------------------------------------------------------- requests
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer.json; pass token ids instead of text")
        return self.tokenizer.encode(prompt).ids

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        params.validate_vocab(self.vocab_size)
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

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_request(ids, params)
        if request_id in self.seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seq = Sequence(request_id, ids, params, self.spec.num_spec)
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

    # ---------------------------------------------------------------- the step
    def step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        decoding = [s for s in sched.scheduled if s.num_spec > 0]
        t1 = time.perf_counter()
        blocks = self.propose(decoding)
        t2 = time.perf_counter()
        results = self.verify(sched.scheduled, blocks)
        t3 = time.perf_counter()
        outputs = self.postprocess(sched.scheduled, blocks, results, t2 - t1, t3 - t2)
        t4 = time.perf_counter()
        st = self.stats
        st.steps += 1
        st.propose_seconds += t2 - t1
        st.verify_seconds += t3 - t2
        st.other_seconds += (t1 - t0) + (t4 - t3)
        st.preemptions = self.scheduler.num_preemptions
        return outputs

    def propose(self, decoding: list[ScheduledSeq]) -> dict[int, DraftBlock]:
        if self.proposer is None or not decoding:
            return {}
        blocks = self.proposer.propose([s.seq for s in decoding], [s.num_spec for s in decoding])
        return {s.seq.seq_id: b for s, b in zip(decoding, blocks)}

    @torch.inference_mode()
    def verify(self, scheduled: list[ScheduledSeq], blocks: dict[int, DraftBlock]):
        """Target forward(s) + p + rejection sampling. Returns {seq_id: (committed, num_accepted, p_logits)}."""
        empty = DraftBlock([], None)
        # decode/verify group: one forward over [last committed + proposals] of every sequence
        dec = [s for s in scheduled if not s.seq.is_prefilling]
        pre = [s for s in scheduled if s.seq.is_prefilling]
        logits_rows: dict[int, torch.Tensor] = {}
        for group in (dec, pre):
            if not group:
                continue
            feeds, starts, nlog = [], [], []
            for s in group:
                seq = s.seq
                toks = seq.all_ids[seq.num_computed : seq.num_computed + s.num_new_tokens]
                d = blocks.get(seq.seq_id, empty).token_ids
                feeds.append(toks + d)
                starts.append(seq.num_computed)
                nlog.append(1 + len(d) if s.samples else 1)
            logits = self.runner.run([s.seq.seq_id for s in group], feeds, starts, nlog)
            off = 0
            for s, n in zip(group, nlog):
                logits_rows[s.seq.seq_id] = logits[off : off + n]
                off += n
        sampling = [s for s in scheduled if s.samples]
        if not sampling:
            return {}
        seq_blocks = [blocks.get(s.seq.seq_id, empty) for s in sampling]
        # p at every position j of every sequence: history = output + proposals before j
        params, prompts, hists = [], [], []
        for s, blk in zip(sampling, seq_blocks):
            for j in range(len(blk.token_ids) + 1):
                params.append(s.seq.params)
                prompts.append(s.seq.prompt_ids)
                hists.append(s.seq.output_ids + blk.token_ids[:j])
        flat_logits = torch.cat([logits_rows[s.seq.seq_id] for s in sampling])  # [N, V]
        p_logits = process_logits(flat_logits, params, prompts, hists, eos_ids=[self.eos_ids] * len(params))
        cu = VerifyBatch.offsets(seq_blocks)
        out = {}
        # greedy rows: the greedy rule on the argmax of the processed logits (no softmax needed)
        greedy = [i for i, s in enumerate(sampling) if s.seq.params.is_greedy]
        if greedy:
            argmax = p_logits.argmax(dim=-1).tolist()
            for i in greedy:
                toks, a = greedy_accept(seq_blocks[i].token_ids, argmax[cu[i] : cu[i + 1]])
                out[sampling[i].seq.seq_id] = (toks, a, p_logits[cu[i] : cu[i] + a + 1])
        # random rows: the rejection sampler on p and q
        rand = [i for i in range(len(sampling)) if not sampling[i].seq.params.is_greedy]
        if rand:
            rblocks = [seq_blocks[i] for i in rand]
            vb = VerifyBatch.build(rblocks)
            rows = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in rand])
            target_probs = vb.pad_rows(torch.softmax(p_logits[rows], dim=-1))  # [R, K+1, V]
            draft_probs = None
            if vb.max_k and any(b.probs is not None for b in rblocks):
                draft_probs = torch.zeros(len(rand), vb.max_k, target_probs.shape[-1])
                for r, b in enumerate(rblocks):
                    if b.probs is not None:
                        draft_probs[r, : len(b.token_ids)] = b.probs
            committed, num_accepted = rejection_sample(
                vb.draft_token_ids,
                draft_probs,
                target_probs,
                [sampling[i].seq.generator for i in rand],
                num_draft_tokens=torch.tensor(vb.num_draft, dtype=torch.long),
            )
            for r, i in enumerate(rand):
                a = int(num_accepted[r])
                out[sampling[i].seq.seq_id] = (committed[r, : a + 1].tolist(), a, p_logits[cu[i] : cu[i] + a + 1])
        return out

    def postprocess(self, scheduled, blocks, results, propose_s, verify_s) -> list[StepOutput]:
        outputs = []
        now = time.perf_counter()
        st = self.stats
        for s in scheduled:
            seq = s.seq
            if seq.seq_id not in results:  # a prefill chunk that does not reach the end yet
                seq.num_computed += s.num_new_tokens
                continue
            toks, a, rows = results[seq.seq_id]
            blk = blocks.get(seq.seq_id)
            n_before = seq.num_tokens
            was_decoding = not seq.is_prefilling
            if was_decoding:  # a verification round (a prefill's first token is not a round)
                self._count_round(seq, len(blk.token_ids) if blk else 0, a, propose_s)
            seq.stats.verify_seconds += verify_s
            new_ids, new_text, reason, stop_string = [], "", None, False
            for j, tok in enumerate(toks):
                seq.output_ids.append(tok)
                new_ids.append(tok)
                if seq.logprobs is not None:
                    seq.logprobs.append(self._logprob(rows[j], tok, seq.params.logprobs))
                reason = self._check_stop(seq, tok)
                if seq.params.stop:
                    added = self.detok.step(seq)
                    new_text += added
                    if added:
                        cut = find_stop(seq.text, len(added), seq.params.stop)
                        if cut != -1:
                            new_text = new_text[: max(0, len(new_text) - (len(seq.text) - cut))]
                            seq.text = seq.text[:cut]
                            reason, stop_string = "stop", True
                if reason:
                    break
            if not seq.params.stop:
                new_text = self.detok.step(seq)
            if seq.first_token_time is None:
                seq.first_token_time = now
            st.generation_tokens += len(new_ids)
            if self.proposer is not None and blk is not None:
                self.proposer.postprocess(seq, blk, a, n_before)
            if reason:
                self._finish(seq, reason, flush=not stop_string)
            else:
                seq.num_computed = seq.num_tokens - 1
                self.runner.kv.truncate(seq.seq_id, seq.num_computed)
            outputs.append(StepOutput(seq, new_ids, new_text, seq.is_finished))
        return outputs

    # ---------------------------------------------------------------- helpers
    def _count_round(self, seq: Sequence, k: int, a: int, propose_s: float) -> None:
        """Statistics of one round that proposed k tokens and accepted a (committing a + 1)."""
        st = self.stats
        seq.stats.rounds += 1
        seq.stats.proposed_tokens += k
        seq.stats.accepted_tokens += a
        seq.stats.committed_in_rounds += a + 1
        seq.stats.committed_per_round.append(a + 1)
        seq.stats.draft_seconds += propose_s if k else 0.0
        for j in range(a):
            seq.stats.accepted_per_position[j] += 1
            st.accepted_per_position[j] += 1
        st.rounds += 1
        st.draft_tokens += k
        st.accepted_tokens += a
        st.committed_tokens += a + 1
        st.committed_per_round[a + 1] = st.committed_per_round.get(a + 1, 0) + 1

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

    @staticmethod
    def _logprob(row: torch.Tensor, tok: int, top_n: int) -> TokenLogprob:
        lp = torch.log_softmax(row, dim=-1)
        top = []
        if top_n:
            vals, idx = torch.topk(lp, top_n)
            top = [(int(i), float(v)) for i, v in zip(idx, vals)]
        return TokenLogprob(tok, float(lp[tok]), top)

    def _finish(self, seq: Sequence, reason: str, flush: bool = True) -> None:
        self.scheduler.finish(seq)
        if flush and reason != "abort":
            self.detok.flush(seq)
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        seq.stats.total_seconds = seq.finish_time - seq.arrival_time
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    def release(self, request_id: str) -> None:
        """Forget a finished request (the caller has read its output)."""
        self.seqs.pop(request_id, None)
