"""`LLM`: the offline Python API (vLLM-style) over the engine.

    llm = LLM(model="models/target", draft="models/draft", spec=SpecConfig(method="draft", k=4))
    outs = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=64))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason, outs[0].stats.mean_accepted_length
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

from .engine import EngineConfig, LLMEngine, RequestStats, SpecConfig
from .engine.sequence import Sequence, TokenLogprob
from .model.pair import load_pair
from .proposers import proposer_class
from .sampling import SamplingParams


@dataclass
class Output:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None
    extra: dict = field(default_factory=dict)
    error: str | None = None  # finish_reason "error": what failed (the other requests are untouched)

    @staticmethod
    def from_seq(seq: Sequence) -> "Output":
        return Output(seq.request_id, seq.prompt_ids, seq.text, list(seq.output_ids), seq.finish_reason, seq.stats,
                      seq.logprobs, error=seq.error)

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        draft: str | Path | None = None,
        spec: SpecConfig | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        draft_dtype: str | None = None,
        quantization: str | None = None,
        draft_quantization: str | None = None,
        draft_vocab: int | None = None,
        **engine_kwargs,
    ):
        spec = spec or SpecConfig()
        needs_draft = bool(spec.method) and proposer_class(spec.method).needs_draft_model
        target, draft_model = load_pair(model, draft, needs_draft=needs_draft, dtype=dtype, draft_dtype=draft_dtype,
                                        device=device, method=spec.method or "", draft_option="draft=...",
                                        quantization=quantization, draft_quantization=draft_quantization,
                                        draft_vocab=draft_vocab)
        self.engine = LLMEngine(target, draft_model, spec, EngineConfig(dtype=dtype, device=device, **engine_kwargs))
        # what was loaded, as a server reports it about itself (bench --url records it)
        self.models = {"target": target.path.name, "draft": draft_model.path.name if draft_model is not None else None,
                       "dtype": dtype, "draft_dtype": (draft_dtype or dtype) if draft_model is not None else None,
                       "quantization": quantization, "device": device}
        self.tokenizer = target.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Output]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(plist)} SamplingParams")
        # validate everything before anything runs: one bad prompt fails the call cleanly
        encoded = []
        for prompt, p in zip(prompts, plist):
            ids = self.engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.engine.check_request(ids, p)
            encoded.append(ids)
        seqs = [self.engine.add_request(f"gen-{next(self._ids)}", ids, p) for ids, p in zip(encoded, plist)]
        while self.engine.has_unfinished():
            self.engine.step()
        outs = [Output.from_seq(s) for s in seqs]
        for s in seqs:
            self.engine.release(s.request_id)
        return outs
