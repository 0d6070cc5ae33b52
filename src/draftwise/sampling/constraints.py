"""Structured-output constraints: checked, normalised, parsed and compiled by xgrammar, and the
compiled grammars cached by content.

A constraint is `SamplingParams.structured_output`, one of
`{"json_schema": dict | str}`, `{"json_object": True}`, `{"regex": str}`, `{"grammar": str}` (EBNF,
xgrammar's dialect of GBNF) or `{"choice": [str, ...]}`.

- `constraint_text` checks its shape and gives `(kind, text)`, the text xgrammar parses (a schema
  as JSON, a choice as EBNF). It never parses: cheap enough for an event loop.
- `normalize_structured_output` (run by `SamplingParams`) also parses it, so an invalid one is a
  `ValueError` naming the field.
- `compile_constraint` compiles it for a tokenizer; compiled grammars are kept per tokenizer in
  an LRU bounded by count and by their size (`CompiledGrammar.memory_size_bytes`), and two
  threads asking for the same constraint at once share one compile. `cached_constraint` looks
  the cache up without compiling.

Parsing and compiling cost grows faster than the text: a JSON schema of objects nested 160 deep
(5 KB) takes 0.6 s to parse and 900 deep over a minute; a 20,000-option choice (470 KB) compiles
in about 25 s and 250 MB. Both release the GIL. The server bounds them (compile_worker.py,
server/constraints.py) before anything here sees an untrusted constraint.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from functools import lru_cache

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
CACHE_ENTRIES = 256  # compiled grammars kept per tokenizer ...
CACHE_BYTES = 256 * 2**20  # ... and their total size (one 20,000-option choice is ~95 MB)


def constraint_text(spec, yielding: bool = False) -> tuple[str, str]:
    """(kind, text to parse) of a constraint; ValueError naming the field for a malformed one.
    `yielding`: write a schema with the pure-Python encoder, which lets other threads (an event
    loop) run between its steps; json.dumps holds the GIL throughout (a tenth of a second per MB)."""
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ValueError(f"structured_output must be a dict with exactly one of {', '.join(KINDS)}, "
                         f"got {_short(spec)}")
    (kind, value), = spec.items()
    if kind not in KINDS:
        raise ValueError(f"structured_output: unknown kind {_short(kind)} (one of {', '.join(KINDS)})")
    return kind, _text(kind, value, yielding)


def _short(value, limit: int = 200) -> str:
    """repr of a (maybe huge) request value, cut for an error message."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + f"... ({len(r)} characters)"


def _text(kind: str, value, yielding: bool = False) -> str:
    if kind == "json_schema":
        if isinstance(value, dict):
            return "".join(json.JSONEncoder().iterencode(value)) if yielding else json.dumps(value)
        if isinstance(value, str):
            return value
        raise ValueError(f"structured_output.json_schema must be a JSON object or a string, got {_short(value)}")
    if kind == "json_object":
        if value not in (True, "", {}):
            raise ValueError(f"structured_output.json_object must be true, got {_short(value)}")
        return ""
    if kind == "choice":
        if (not isinstance(value, (list, tuple)) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise ValueError(f"structured_output.choice must be a non-empty list of non-empty strings, "
                             f"got {_short(value)}")
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_output.{kind} must be a non-empty string, got {_short(value)}")
    return value


def normalize_structured_output(spec) -> dict | None:
    """Check and parse a constraint; return it normalised (a schema as a JSON string, a choice as a
    list, json_object as True; idempotent), or None."""
    if spec is None:
        return None
    kind, text = constraint_text(spec)
    parse_constraint(kind, text)
    value = spec[kind]
    return {kind: text if kind in ("json_schema", "regex", "grammar") else list(value) if kind == "choice" else True}


def clean_error(e: BaseException) -> str:
    """xgrammar's message without its C++ location prefix, first line only."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", msg)


def parse_constraint(kind: str, text: str, cached: bool = True):
    """The xgrammar Grammar of (kind, text) (kept in an LRU unless `cached` is False); ValueError
    "structured_output.KIND is invalid: ..."."""
    try:
        return _grammar(kind, text) if cached else _parse(kind, text)
    except Exception as e:  # xgrammar raises RuntimeError with a C++ location prefix
        raise ValueError(f"structured_output.{kind} is invalid: {clean_error(e)}") from None


def _parse(kind: str, text: str):
    import xgrammar as xgr

    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(text, any_whitespace=False)
    if kind == "json_object":
        return xgr.Grammar.builtin_json_grammar()
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    return xgr.Grammar.from_ebnf(text)  # grammar, choice


_grammar = lru_cache(maxsize=CACHE_ENTRIES)(_parse)


def tokenizer_info(tokenizer, vocab_size: int, eos_ids: list[int]):
    """xgrammar's TokenizerInfo of a `tokenizers.Tokenizer`."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=list(eos_ids))


class _Pending:
    """A compile in progress, waited on by the threads that ask for the same constraint."""

    def __init__(self):
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None


class Compiler:
    """An xgrammar GrammarCompiler for one tokenizer + an LRU of its compiled grammars.

    The lock guards the cache only: a long compile never holds up a cache hit in another thread
    (the server's event loop, the engine thread)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        import xgrammar as xgr

        self.info = tokenizer_info(tokenizer, vocab_size, eos_ids)
        # xgrammar's own cache is unbounded by default; this class keeps a bounded one
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.tokenizer = tokenizer  # keeps the id() key alive
        self.compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.cached_bytes = 0
        self.num_compiles = 0  # grammars compiled (cache misses that finished)
        self.lock = threading.Lock()
        self.pending: dict[tuple[str, str], _Pending] = {}

    def lookup(self, kind: str, text: str):
        """The cached compiled grammar, or None."""
        with self.lock:
            hit = self.compiled.get((kind, text))
            if hit is not None:
                self.compiled.move_to_end((kind, text))
            return hit

    def compile(self, kind: str, text: str):
        key = (kind, text)
        with self.lock:
            hit = self.compiled.get(key)
            if hit is not None:
                self.compiled.move_to_end(key)
                return hit
            job, owner = self.pending.get(key), False
            if job is None:
                job, owner = self.pending.setdefault(key, _Pending()), True
        if not owner:
            job.done.wait()
            if job.error is not None:
                raise job.error
            return job.result
        try:
            job.result = self.compiler.compile_grammar(parse_constraint(kind, text))
            self._store(key, job.result)
            return job.result
        except BaseException as e:
            job.error = e
            raise
        finally:
            with self.lock:
                del self.pending[key]
            job.done.set()

    def _store(self, key: tuple[str, str], compiled) -> None:
        with self.lock:
            self.num_compiles += 1
            self.compiled[key] = compiled
            self.cached_bytes += compiled.memory_size_bytes
            while len(self.compiled) > 1 and (len(self.compiled) > CACHE_ENTRIES or self.cached_bytes > CACHE_BYTES):
                _, old = self.compiled.popitem(last=False)
                self.cached_bytes -= old.memory_size_bytes


_COMPILERS: dict[tuple, Compiler] = {}
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer, vocab_size: int, eos_ids: list[int]) -> Compiler:
    """The `Compiler` of a tokenizer (made once)."""
    if tokenizer is None:
        raise ValueError("structured_output needs the model's tokenizer (tokenizer.json)")
    key = (id(tokenizer), vocab_size, tuple(eos_ids))
    with _COMPILERS_LOCK:
        if key not in _COMPILERS:
            _COMPILERS[key] = Compiler(tokenizer, vocab_size, eos_ids)
        return _COMPILERS[key]


def compile_constraint(tokenizer, vocab_size: int, eos_ids: list[int], spec: dict):
    """The xgrammar CompiledGrammar of a constraint, cached per tokenizer."""
    return compiler_for(tokenizer, vocab_size, eos_ids).compile(*constraint_text(spec))


def cached_constraint(tokenizer, vocab_size: int, eos_ids: list[int], spec: dict):
    """The cached CompiledGrammar of a constraint, or None (never compiles)."""
    return compiler_for(tokenizer, vocab_size, eos_ids).lookup(*constraint_text(spec))
