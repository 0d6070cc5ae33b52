"""The two OpenAI endpoints: a request becomes engine requests, their outputs become a response.

Each choice (prompt x n) is its own engine request; with a `seed`, choice j gets seed + j, so
choices differ yet each is reproducible. All choices of one HTTP request share one queue.

Non-streamed: the response is built when every choice has finished; a client that disconnects
meanwhile aborts them. Streamed (server-sent events): the response starts only once the first
output arrives, so a request that fails in its first step is still answered with a 500; a later
failure is sent as an `{"error": ...}` event. The stream ends with `data: [DONE]` (also when
shutdown cuts it: an error event first, sse.py); leaving it early (client disconnect) aborts the
unfinished choices, which frees their KV blocks.

Every response carries a `draftwise` object: the request's speculation statistics summed over its
choices (each choice also has its own), with the method and k it ran with (its `speculation`
field may cap k or turn speculation off).

Before anything reaches the engine: the body's text is valid Unicode (`invalid_text`), the
request is within `ServerLimits` (prompt characters before tokenizing; prompts, n, stop strings),
a constraint is compiled within the server's limits (`ConstraintCompiler`, constraints.py), the
sampling values pass `SamplingParams.validate` and the engine's model checks (`check_request`),
and the choices fit the queue (else 429 with `Retry-After`). Tokenization, chat rendering and
constraint compiles run in threads and a worker process, never on the event loop. Each HTTP
request is counted once in `Outcomes` (app.py counts those answered with an error).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse

from ..sampling import SamplingParams
from .async_engine import AsyncEngine, RequestOutput
from .constraints import ConstraintCompiler, constraint_field
from ..model.chat_template import ChatTemplate
from .errors import APIError, from_value_error
from .limits import ServerLimits, queue_full
from .metrics import Outcomes, request_outcome
from .protocol import ChatCompletionRequest, CompletionRequest, invalid_text, message_error
from .sse import EventStream, sse
from .tools import ChatTools, history

TOKENIZER_THREADS = 2


@dataclass
class _Choice:
    index: int
    request_id: str
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stats: dict | None = None
    text_offset: int = 0  # completions logprobs: offset of the next token's text
    started: bool = False  # chat streaming: the role delta was sent
    logprobs: list = field(default_factory=list)


def spec_summary(stats: list[dict], method: str | None, k: int) -> dict:
    rounds = sum(s["rounds"] for s in stats)
    committed = sum(s["mean_accepted_length"] * s["rounds"] for s in stats)
    proposed = sum(s["proposed_tokens"] for s in stats)
    accepted = sum(s["accepted_tokens"] for s in stats)
    per_pos = [sum(col) for col in itertools.zip_longest(*(s["accepted_per_position"] for s in stats), fillvalue=0)]
    return {
        "method": method or "none", "k": k if method else 0, "rounds": rounds,
        "proposed_tokens": proposed, "accepted_tokens": accepted,
        "mean_accepted_length": committed / rounds if rounds else 0.0,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "accepted_per_position": per_pos,
        "preemptions": sum(s["preemptions"] for s in stats),
    }


def _split_prompt(p) -> tuple[list[str] | None, list[list[int]] | None]:
    """A completions `prompt`: (texts, None) for a string or a list of them, (None, token id
    lists) for a list of ids or a list of such lists."""
    if isinstance(p, str):
        return [p], None
    if p and all(isinstance(x, str) for x in p):
        return list(p), None
    if p and all(isinstance(x, int) for x in p):
        return None, [list(p)]
    return None, [list(x) for x in p]


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, model_aliases: set[str], chat: ChatTemplate,
                 limits: ServerLimits | None = None, outcomes: Outcomes | None = None):
        self.engine = engine
        self.model_name = model_name
        self.aliases = {model_name} | model_aliases
        self.chat_template = chat
        self.tokenizer = engine.engine.tokenizer
        self.limits = limits or ServerLimits()
        self.outcomes = outcomes if outcomes is not None else Outcomes()
        self.max_num_seqs = engine.engine.config.max_num_seqs
        spec = engine.engine.spec
        self.method, self.k = spec.method, spec.max_draft
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="draftwise-tokenize")
        self.constraints = ConstraintCompiler(engine.engine, self.limits)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.constraints.close()

    @property
    def capacity(self) -> int | None:
        """Choices the server holds at once (running + queued); None without a queue limit."""
        q = self.engine.max_queue
        return None if q is None else self.max_num_seqs + q

    # ------------------------------------------------------------------ helpers
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.aliases:
            raise APIError(404, f"The model '{name}' does not exist.", "model", "model_not_found")

    def token_str(self, tok: int) -> str:
        return self.tokenizer.decode([tok], skip_special_tokens=False) if self.tokenizer is not None else str(tok)

    async def encode(self, texts: list[str], special: bool = True, render=None) -> list[list[int]]:
        """Token ids of `texts` (or of `render()`'s text), computed in the tokenizer pool."""
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send token ids", "prompt")

        def work():
            batch = [render()] if render is not None else texts
            return [e.ids for e in self.tokenizer.encode_batch(batch, add_special_tokens=special)]

        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    def check_text(self, req) -> None:
        """400 for a string that is not valid Unicode; param: the top-level field ("messages").
        A body nested deeper than Python's recursion (JSON that FastAPI could still read) is a 422.
        (The walk visits every string: run it in a thread, as `check_text_async` does.)"""
        try:
            bad = invalid_text(req)
        except RecursionError:
            raise APIError(422, "the request body is nested too deeply", None, "invalid_request_body") from None
        if bad:
            raise APIError(400, bad, re.match(r"\w+", bad).group(0), "invalid_text")

    async def check_text_async(self, req) -> None:
        """`check_text` off the event loop: for a 1 MB schema its walk takes a quarter second, and
        in a thread the loop still gets the GIL between its bytecodes."""
        await asyncio.to_thread(self.check_text, req)

    def submit(self, prompts: list[list[int]], params: SamplingParams, prefix: str, param_name: str,
               compiled=None):
        """Validate against the model and the queue, then add prompt x n engine requests sharing one queue."""
        for ids in prompts:
            try:
                self.engine.engine.check_request(ids, params, compiled)
            except ValueError as e:
                raise from_value_error(e, param_name) from None
        new = len(prompts) * params.n
        limit = self.engine.max_queue
        if limit is not None:  # the limits let it fit an idle server: only a transient overload is left
            waiting = self.engine.snapshot.waiting  # held back for lack of K/V blocks
            queued_after = max(self.engine.num_in_flight + new - self.max_num_seqs, waiting + new if waiting else 0)
            if queued_after > limit:
                raise queue_full(self.engine.num_queued, limit)
        n = params.n
        sink: asyncio.Queue = asyncio.Queue()
        choices = []
        for pi, ids in enumerate(prompts):
            for j in range(n):
                p = params
                if params.seed is not None and j:
                    p = dataclasses.replace(params, seed=(params.seed + j) % 2**63)
                rid = f"{prefix}-{pi * n + j}"
                try:
                    self.engine.add_request(rid, ids, p, sink, compiled)
                except RuntimeError as e:  # shutting down
                    self._abort_unfinished(choices)
                    raise APIError(503, str(e), None, "shutting_down") from None
                choices.append(_Choice(pi * n + j, rid))
        return sink, choices

    async def _collect(self, sink: asyncio.Queue, choices: list[_Choice], first=None):
        """Outputs of all choices until they finish; yields (choice, output)."""
        by_id = {c.request_id: c for c in choices}
        left = len(choices)
        while left:
            out: RequestOutput = first if first is not None else await sink.get()
            first = None
            c = by_id[out.request_id]
            if out.finished:
                left -= 1
                c.finish_reason, c.stats = out.finish_reason, out.stats
            yield c, out

    async def _first(self, sink: asyncio.Queue, raw: Request) -> RequestOutput | None:
        """Wait for the first output while watching for the client leaving (None if it left)."""
        get = asyncio.ensure_future(sink.get())
        gone = asyncio.ensure_future(_disconnected(raw))
        try:
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if get in done:
            return get.result()
        get.cancel()
        return None

    def _abort_unfinished(self, choices: list[_Choice]) -> None:
        for c in choices:
            if c.finish_reason is None:
                self.engine.abort(c.request_id)

    def _usage(self, prompts: list[list[int]], choices: list[_Choice]) -> dict:
        p = sum(len(x) for x in prompts)
        g = sum(c.num_tokens for c in choices)
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}

    def _summary(self, choices: list[_Choice], params: SamplingParams) -> dict:
        """The request's speculation statistics, with the method and k it ran with (its own
        `speculation` cap applied: method "none", k 0 when it turned speculation off)."""
        k = self.k if params.max_draft is None else min(self.k, params.max_draft)
        return spec_summary([c.stats for c in choices if c.stats], self.method if k else None, k)

    async def _run(self, kind, req, prompts, params, fmt, raw: Request, param_name: str):
        """`fmt` = (chunk(choice, output) -> [choice dicts], add(choice, output), final(choice) -> dict)."""
        fmt_chunk, fmt_add, fmt_final = fmt
        prefix = f"{'cmpl' if kind == 'text_completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        compiled = await self.constraints.compile(params.structured_output, constraint_field(req))
        sink, choices = self.submit(prompts, params, prefix, param_name, compiled)
        created = int(time.time())
        head = {"id": prefix, "object": kind, "created": created, "model": self.model_name}
        try:
            first = await self._first(sink, raw)
        except BaseException:
            self._abort_unfinished(choices)
            self.outcomes.record("abort")
            raise
        if first is None:  # the client left before anything was generated
            self._abort_unfinished(choices)
            self.outcomes.record("abort")
            return JSONResponse({}, status_code=499)
        if first.error:
            self._abort_unfinished(choices)
            raise APIError(500, first.error, None, "internal_error")
        if req.stream:
            return EventStream(self._stream(req, params, prompts, choices, sink, first, head, fmt_chunk),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        watcher = asyncio.ensure_future(_disconnected(raw))  # the client leaving aborts the choices
        watcher.add_done_callback(lambda f: f.cancelled() or self._abort_unfinished(choices))
        try:
            async for c, out in self._collect(sink, choices, first):
                if out.error:
                    raise APIError(500, out.error, None, "internal_error")  # counted by app.py
                fmt_add(c, out)
                c.num_tokens = out.num_output_tokens
        except asyncio.CancelledError:  # shutdown past its bound
            self.outcomes.record("abort")
            raise
        finally:
            watcher.cancel()
            self._abort_unfinished(choices)
        self.outcomes.record(request_outcome([c.finish_reason for c in choices]))
        body = dict(head)
        body["choices"] = [fmt_final(c) for c in choices]
        body["usage"] = self._usage(prompts, choices)
        body["draftwise"] = self._summary(choices, params)
        return JSONResponse(body)

    async def _stream(self, req, params, prompts, choices, sink, first, head, fmt_chunk):
        chunk_kind = head["object"] + ".chunk" if head["object"] == "chat.completion" else head["object"]
        base = dict(head, object=chunk_kind)
        outcome = "abort"  # unless the stream ends
        try:
            async for c, out in self._collect(sink, choices, first):
                if out.error:
                    err = APIError(500, out.error, None, "internal_error").body()
                    outcome = "error"
                    yield sse(err)
                    break
                c.num_tokens = out.num_output_tokens
                for choice in fmt_chunk(c, out):
                    yield sse(dict(base, choices=[choice]))
            else:
                outcome = request_outcome([c.finish_reason for c in choices])
                if req.include_usage:
                    yield sse(dict(base, choices=[], usage=self._usage(prompts, choices),
                                   draftwise=self._summary(choices, params)))
            yield "data: [DONE]\n\n"
        finally:  # also on client disconnect (the task is cancelled): nothing awaited here
            self._abort_unfinished(choices)
            self.outcomes.record(outcome)

    # ------------------------------------------------------------------ /v1/completions
    async def completions(self, req: CompletionRequest, raw: Request):
        await self.check_text_async(req)
        self.check_model(req.model)
        if req.echo:
            raise APIError(400, "echo is not supported", "echo", "unsupported")
        p = req.prompt
        texts, prompts = _split_prompt(p)
        num_prompts = len(texts if texts is not None else prompts)
        if not num_prompts:
            raise APIError(400, "prompt must not be empty", "prompt", "invalid_value")
        await self.constraints.precompile(req)
        try:
            params = req.sampling_params(16 if req.max_tokens is None else req.max_tokens, req.logprobs)
        except ValueError as e:
            raise from_value_error(e) from None
        self.limits.check_request(num_prompts, params.n, params.stop, self.capacity)
        if texts is not None:
            for i, t in enumerate(texts):
                self.limits.check_prompt_chars(len(t), "prompt" if isinstance(p, str) else f"prompt[{i}]")
            prompts = await self.encode(texts)
        want_lp = req.logprobs is not None

        def lp_block(c: _Choice, out: RequestOutput) -> dict | None:
            if not want_lp:
                return None
            toks = [self.token_str(lp.token_id) for lp in out.logprobs]
            offsets = []
            for t in toks:
                offsets.append(c.text_offset)
                c.text_offset += len(t)
            return {
                "tokens": toks,
                "token_logprobs": [lp.logprob for lp in out.logprobs],
                "top_logprobs": [{self.token_str(i): v for i, v in lp.top} for lp in out.logprobs],
                "text_offset": offsets,
            }

        def fmt_add(c: _Choice, out: RequestOutput) -> None:
            c.text += out.text
            if want_lp:
                c.logprobs.append(lp_block(c, out))

        def fmt_final(c: _Choice) -> dict:
            lp = None
            if want_lp:
                lp = {key: [x for blk in c.logprobs for x in blk[key]]
                      for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
            return {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason,
                    "draftwise": c.stats}

        def fmt_chunk(c: _Choice, out: RequestOutput):
            if not (out.text or out.token_ids or out.finished):
                return []
            ch = {"index": c.index, "text": out.text, "logprobs": lp_block(c, out),
                  "finish_reason": out.finish_reason if out.finished else None}
            if out.finished:
                ch["draftwise"] = out.stats
            return [ch]

        fmt = (fmt_chunk, fmt_add, fmt_final)
        return await self._run("text_completion", req, prompts, params, fmt, raw, "prompt")

    # ------------------------------------------------------------------ /v1/chat/completions
    async def chat(self, req: ChatCompletionRequest, raw: Request):
        await self.check_text_async(req)
        self.check_model(req.model)
        if not req.messages:
            raise APIError(400, "messages must not be empty", "messages", "invalid_value")
        bad = message_error(req.messages)
        if bad:
            raise APIError(400, bad, "messages", "invalid_value")
        messages = history([m.as_dict() for m in req.messages])
        tools = ChatTools.from_request(req, self.chat_template, messages)
        self.limits.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
        self.limits.check_request(1, req.n, [req.stop] if isinstance(req.stop, str) else req.stop or [], None)

        def render() -> str:
            text = self.chat_template.render(messages, req.add_generation_prompt, tools.rendered)
            self.limits.check_prompt_chars(len(text), "messages")  # the template's own text too
            return text

        try:
            ids = (await self.encode([], special=False, render=render))[0]
        except ValueError as e:
            raise APIError(400, str(e), "messages", "invalid_value") from None
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs", "invalid_value")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.engine.engine.max_model_len - len(ids))
        lp = (req.top_logprobs or 0) if req.logprobs else None
        await self.constraints.precompile(req)
        try:
            params = req.sampling_params(max_tokens, lp)
        except ValueError as e:
            raise from_value_error(e, "messages") from None
        self.limits.check_request(1, params.n, params.stop, self.capacity)
        params = await asyncio.get_running_loop().run_in_executor(self._pool, tools.constrain, params,
                                                                  self.limits.max_grammar_bytes)

        def lp_entries(out: RequestOutput) -> list[dict]:
            def entry(tok, v):
                s = self.token_str(tok)
                return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}
            return [dict(entry(x.token_id, x.logprob), top_logprobs=[entry(i, v) for i, v in x.top])
                    for x in out.logprobs]

        def fmt_add(c: _Choice, out: RequestOutput) -> None:
            c.text += out.text
            if req.logprobs:
                c.logprobs.extend(lp_entries(out))

        def fmt_final(c: _Choice) -> dict:
            message, reason = tools.message(c.text, c.finish_reason)
            return {"index": c.index, "message": message, "logprobs": {"content": c.logprobs} if req.logprobs else None,
                    "finish_reason": reason, "draftwise": c.stats}

        def fmt_chunk(c: _Choice, out: RequestOutput):
            chunks = []
            if not c.started:
                c.started = True
                chunks.append({"index": c.index, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None})
            if out.text or out.token_ids:  # text held back by the tool-call parser still carries its logprobs
                lp = {"content": lp_entries(out)} if req.logprobs else None
                for delta in tools.stream(c.index, out.text) or [{"content": ""}]:
                    chunks.append({"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": None})
                    lp = None
            if out.finished:
                deltas, reason = tools.finish_stream(c.index, out.finish_reason)
                chunks.extend({"index": c.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas)
                chunks.append({"index": c.index, "delta": {}, "logprobs": None,
                               "finish_reason": reason, "draftwise": out.stats})
            return chunks

        fmt = (fmt_chunk, fmt_add, fmt_final)
        return await self._run("chat.completion", req, [ids], params, fmt, raw, "messages")


async def _disconnected(raw: Request) -> None:
    """Returns when the client has gone (the body was read already, so receive() waits for that)."""
    while True:
        msg = await raw.receive()
        if msg["type"] == "http.disconnect":
            return
