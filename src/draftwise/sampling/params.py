"""Per-request sampling parameters: `SamplingParams`, with the defaults of the OpenAI / vLLM APIs.

`validate` (run by `__post_init__`) is the one place where parameter values are checked: every
value that can be checked without a model, with a `ValueError` naming the parameter and its
allowed range, e.g. "top_p must be in (0, 1], got 1.5". Values are checked as the sampler will use
them, in float32: a temperature or penalty that is finite and nonzero as a Python float but 0 or
inf in float32 would turn the logits into NaN, so the ranges below are float32-safe:

- temperature: 0 (greedy) or up to float32's largest finite value; a temperature below
  `GREEDY_BELOW` (1e-5) samples greedily, as in vLLM (dividing logits by less overflows float32);
- repetition_penalty: in [1e-4, 1e4] (a smaller one overflows the logits it divides);
- top_p: in (0, 1]; min_p: in [0, 1]; presence/frequency penalty: in [-2, 2]; logit_bias: in
  [-100, 100]; none of them NaN.

Checks that need the model (token ids in `logit_bias` and `stop_token_ids` against the
vocabulary, the context length) are the engine's (`validate_vocab`, `LLMEngine.check_request`).

The dataclass is plain (mutable, compared by value, not hashed): copy it with
`dataclasses.replace`, which re-runs the checks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .constraints import normalize_structured_output

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
GREEDY_BELOW = 1e-5  # temperatures in (0, GREEDY_BELOW) sample greedily (vLLM's _SAMPLING_EPS)
FLOAT32_MAX = 3.4028234663852886e38
REPETITION_PENALTY_RANGE = (1e-4, 1e4)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _number(name: str, x, allowed: str) -> float:
    try:
        v = float(x) if _is_number(x) else math.nan
    except OverflowError:  # an int beyond float's range
        v = math.inf
    if math.isnan(v):
        raise ValueError(f"{name} must be {allowed}, got {x!r}")
    return v


def _integer(name: str, x, allowed: str) -> int:
    if not _is_int(x):
        raise ValueError(f"{name} must be an integer {allowed}, got {x!r}")
    return x


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None  # normalised to a list
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return per token
    n: int = 1
    # one of {"json_schema": dict|str}, {"json_object": True}, {"regex": str}, {"grammar": str},
    # {"choice": [str]}; normalised to {kind: text} (sampling/grammar.py)
    structured_output: dict | None = None
    # the most proposals this request verifies per step (None: the engine's k; 0: no speculation);
    # the verification policy decides within it, and greedy output is the same whatever it is
    max_draft: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every value (raises ValueError naming the parameter); normalises `stop`,
        `stop_token_ids` and `logit_bias` in place."""
        self._validate_distribution()
        self._validate_logit_bias()
        self._validate_lengths_and_stops()
        self.structured_output = normalize_structured_output(self.structured_output)

    def _validate_distribution(self) -> None:
        """temperature, top_k, top_p, min_p and the penalties, in float32 terms."""
        t = _number("temperature", self.temperature, "a finite number >= 0")
        if not (0.0 <= t <= FLOAT32_MAX):
            note = f" (infinite in float32: at most {FLOAT32_MAX:.4g})" if t > FLOAT32_MAX else ""
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}{note}")

        k = _integer("top_k", self.top_k, ">= -1 (0 or -1 = disabled)")
        if k < -1:
            raise ValueError(f"top_k must be >= -1 (0 or -1 = disabled), got {k}")

        top_p = _number("top_p", self.top_p, "in (0, 1]")
        if not (0.0 < top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

        min_p = _number("min_p", self.min_p, "in [0, 1]")
        if not (0.0 <= min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")

        lo, hi = REPETITION_PENALTY_RANGE
        rp = _number("repetition_penalty", self.repetition_penalty, f"in [{lo:g}, {hi:g}]")
        if not (lo <= rp <= hi):
            raise ValueError(f"repetition_penalty must be in [{lo:g}, {hi:g}] (1 = no penalty; a smaller "
                             f"penalty overflows float32 logits), got {self.repetition_penalty!r}")

        for name in ("presence_penalty", "frequency_penalty"):
            v = _number(name, getattr(self, name), "in [-2, 2]")
            if not (-2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(
                    f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}"
                )
            bias = {}
            for tok, b in self.logit_bias.items():
                if not _is_int(tok) or tok < 0:
                    raise ValueError(f"logit_bias: token id must be an integer >= 0, got {tok!r}")
                allowed = f"in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
                v = _number(f"logit_bias[{tok}]", b, allowed)
                if not (-MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS):
                    raise ValueError(f"logit_bias[{tok}] must be {allowed}, got {b!r}")
                bias[tok] = v
            self.logit_bias = bias

    def _validate_lengths_and_stops(self) -> None:
        """seed, max_tokens, min_tokens, stop, stop_token_ids, ignore_eos, logprobs, n, max_draft."""
        if self.seed is not None:
            _integer("seed", self.seed, "in [-2**63, 2**64)")
            if not (-(2**63) <= self.seed < 2**64):
                raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed}")

        _integer("max_tokens", self.max_tokens, ">= 1")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _integer("min_tokens", self.min_tokens, f"in [0, max_tokens={self.max_tokens}]")
        if not (0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop must be a non-empty string or a list of them, got {s!r}")

        if self.stop_token_ids is not None:
            ids = list(self.stop_token_ids)
            for tok in ids:
                if not _is_int(tok) or tok < 0:
                    raise ValueError(f"stop_token_ids: token id must be an integer >= 0, got {tok!r}")
            self.stop_token_ids = ids

        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, f"in [0, {MAX_LOGPROBS}]")
            if not (0 <= self.logprobs <= MAX_LOGPROBS):
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

        _integer("n", self.n, ">= 1")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

        if self.max_draft is not None:
            _integer("max_draft", self.max_draft, ">= 0 (0: no speculation for this request)")
            if self.max_draft < 0:
                raise ValueError(f"max_draft must be an integer >= 0 (0: no speculation for this request), "
                                 f"got {self.max_draft}")

    @property
    def is_greedy(self) -> bool:
        """Temperature 0, or below `GREEDY_BELOW` (the argmax; no seed is used)."""
        return self.temperature < GREEDY_BELOW

    def validate_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a token id named by the request is outside [0, vocab_size)."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids or [])):
            for tok in ids:
                if not (0 <= tok < vocab_size):
                    raise ValueError(
                        f"{name}: token id {tok} is outside the vocabulary [0, {vocab_size})"
                    )
