"""Structured-output constraints compiled off the event loop, within the server's limits.

A request's constraint (`response_format`, `guided_*`, `structured_outputs`, a forced tool call)
goes through `ConstraintCompiler.compile` before the engine sees it:

1. its shape is checked and its text made (`constraint_text`) in a thread, and its size checked
   against `--max-grammar-bytes`;
2. the compiled-grammar cache is looked up by content (a hit costs nothing more); the same
   constraint in flight for another request is waited for, not compiled twice; a constraint
   that failed before gets the same answer again (a bounded LRU of failures);
3. the worker process parses and compiles it under `--grammar-compile-timeout` and
   `--grammar-memory-mib` (sampling/compile_worker.py: a thread cannot be stopped nor held to a
   memory budget; a process can);
4. one that passed is compiled again in this process, in a low-priority thread (parse and
   compile release the GIL), and cached (sampling/constraints.py: LRU by count and bytes).

A constraint over a limit, or one that does not parse, is a 400 naming the request's field and
the limit's flag. Nothing here runs on the event loop for longer than a dict lookup, so /health
and the open streams go on while a constraint compiles (the engine gets the compiled grammar
with the request and never compiles in its thread).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from ..engine import LLMEngine
from ..sampling.compile_worker import NICE, CompileWorker, Probe, shared_worker
from ..sampling.constraints import compiler_for, constraint_text
from .errors import APIError, from_value_error
from .limits import ServerLimits

log = logging.getLogger("draftwise.server")

COMPILE_THREADS = 2  # constraints compiled at once (each probe runs in its own child beside)
FAILURES_KEPT = 64


def _lower_priority() -> None:
    """A compile thread yields the CPU to the engine thread (Linux: niceness is per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (OSError, AttributeError):
        pass


class ConstraintCompiler:
    def __init__(self, engine: LLMEngine, limits: ServerLimits):
        self.tokenizer, self.vocab_size, self.eos_ids = engine.tokenizer, engine.vocab_size, engine.eos_ids
        self.limits = limits
        self._threads = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="draftwise-grammar",
                                           initializer=_lower_priority)
        self._worker: CompileWorker | None = None
        self._worker_lock = threading.Lock()
        self._in_flight: dict[tuple[str, str], asyncio.Future] = {}
        self._failed: OrderedDict[tuple[str, bytes], Probe] = OrderedDict()  # their answer, again
        self._failed_lock = threading.Lock()
        self._made = None  # the tokenizer's Compiler (sampling/constraints.py), once made
        self.compiling = 0  # constraints being compiled now
        self.probes = 0  # constraints sent to the worker
        self.cache_hits = 0

    def close(self) -> None:
        """(The worker is shared by every server of this process and tokenizer: it stays.)"""
        self._threads.shutdown(wait=False, cancel_futures=True)

    def warm(self) -> None:
        """Start the worker now (it imports xgrammar and torch: seconds), not on the first constraint."""
        try:
            self._get_worker().start()
        except Exception:  # the first constraint will try again, and answer the error
            log.exception("the grammar compile worker did not start")

    def _compiler(self):
        self._made = compiler_for(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._made

    def _get_worker(self) -> CompileWorker:
        with self._worker_lock:
            if self._worker is None:
                self._worker = shared_worker(self._compiler().info.serialize_json())
            return self._worker

    def health(self) -> dict:
        c = self._made  # (not made here: /health stays a few dict reads)
        return {"compiling": self.compiling, "compiled": c.num_compiles if c else 0,
                "cached": len(c.compiled) if c else 0, "cache_hits": self.cache_hits, "probes": self.probes}

    async def precompile(self, req) -> None:
        """A request's own constraint (`req.structured_output()`) compiled before `sampling_params`
        parses it on the event loop: parsing alone can take minutes (sampling/constraints.py),
        compiled it is found in the parse cache."""
        try:
            field, spec = req.structured_output()
        except ValueError as e:
            raise from_value_error(e) from None
        await self.compile(spec, field)

    async def compile(self, spec: dict | None, field: str):
        """The compiled grammar of `spec` (None without one); APIError 400 naming `field`."""
        if spec is None:
            return None
        if self.tokenizer is None:
            raise APIError(400, f"{field}: structured output needs the model's tokenizer (tokenizer.json)", field,
                           "unsupported")
        loop = asyncio.get_running_loop()
        try:
            kind, text = await asyncio.to_thread(constraint_text, spec, True)
        except ValueError as e:
            raise APIError(400, f"{field}: {e}", field, "invalid_value") from None
        except RecursionError:
            raise APIError(400, f"{field}: the constraint is nested too deeply", field, "invalid_value") from None
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.limits.max_grammar_bytes:
            raise APIError(400, f"{field}: the constraint is {size} bytes ({kind}); this server compiles at most "
                                f"{self.limits.max_grammar_bytes} (--max-grammar-bytes)", field, "grammar_too_large")
        compiler = await asyncio.to_thread(self._compiler)  # the first call builds xgrammar's tokenizer info
        hit = compiler.lookup(kind, text)
        if hit is not None:
            self.cache_hits += 1
            return hit
        key = (kind, text)
        job = self._in_flight.get(key)
        if job is None:
            job = self._in_flight[key] = loop.create_future()
            asyncio.ensure_future(self._run(job, key, compiler))
        else:
            self.cache_hits += 1
        probe, compiled = await asyncio.shield(job)
        if not probe.ok:
            raise self._error(probe, field, kind)
        return compiled

    async def _run(self, job: asyncio.Future, key: tuple[str, str], compiler) -> None:
        """Probe, then compile here; the outcome goes to every request waiting on `job`."""
        self.compiling += 1
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._threads, self._probe_and_compile,
                                                                      key, compiler)
            job.set_result(result)
        except BaseException as e:  # a bug, or the executor shut down: the waiters get it
            job.set_exception(e)
        finally:
            self.compiling -= 1
            del self._in_flight[key]

    def _probe_and_compile(self, key: tuple[str, str], compiler) -> tuple[Probe, object]:
        kind, text = key
        digest = (kind, hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest())
        with self._failed_lock:
            probe = self._failed.get(digest)
        if probe is None:
            self.probes += 1
            probe = self._get_worker().probe(kind, text, self.limits.grammar_compile_timeout,
                                             self.limits.grammar_memory_mib * 2**20)
        if probe.ok:
            return probe, compiler.compile(kind, text)
        if probe.reason in ("invalid", "timeout", "memory"):  # not a worker that was stopped
            with self._failed_lock:
                self._failed[digest] = probe
                self._failed.move_to_end(digest)
                while len(self._failed) > FAILURES_KEPT:
                    self._failed.popitem(last=False)
        return probe, None

    def _error(self, probe: Probe, field: str, kind: str) -> APIError:
        lim = self.limits
        if probe.reason == "invalid":
            return APIError(400, f"{field}: {probe.message}", field, "invalid_value")
        if probe.reason == "timeout":
            msg = (f"compiling this {kind} constraint takes longer than {lim.grammar_compile_timeout} s "
                   "(--grammar-compile-timeout)")
        elif probe.reason == "memory":
            msg = (f"compiling this {kind} constraint needs more than {lim.grammar_memory_mib} MiB "
                   "(--grammar-memory-mib)")
        else:
            msg = (f"the grammar compiler failed on this {kind} constraint ({probe.message}; past "
                   f"--grammar-memory-mib {lim.grammar_memory_mib} it may die rather than report it)")
        return APIError(400, f"{field}: {msg}", field, "grammar_too_complex")


def constraint_field(req) -> str:
    """The request field a constraint came from, for error messages (a forced tool call's grammar
    comes from `tool_choice`)."""
    try:
        return req.structured_output()[0] or "tool_choice"
    except ValueError:
        return "structured_output"
