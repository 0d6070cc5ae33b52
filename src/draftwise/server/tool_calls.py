"""Hermes-style tool calls in generated text: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The format of Qwen2.5 (and other templates that follow NousResearch's Hermes prompt): each call is
one JSON object between `<tool_call>` and `</tool_call>`, several calls one after another. A block
may also hold a JSON list of such objects, the form SmolLM2 was trained to write.

`ToolCallParser` splits text into plain text and `ToolCall`s, incrementally: `feed` takes the next
piece of generated text and returns what is decided so far, `finish` the rest. A non-streamed
response runs the same parser over the whole text, so streamed and non-streamed answers agree.

The rules (what a client sees):
- A block counts as a call when its body is a JSON object with a string `"name"` that is one of
  the request's tools and `"arguments"` that is an object (or a string holding one; absent = `{}`);
  as calls when it is a non-empty list of such objects, every one well formed.
  Anything else (malformed JSON, an unknown function, a block cut off by `max_tokens`) stays in the
  text verbatim, tags included, so nothing the model wrote is lost.
- A block the model left unclosed at the very end still counts when its body is a complete call
  (models sometimes end the turn right after the JSON).
- Bare calls: an output that is nothing but call objects (one or more, or a list of them) without
  the tags, maybe inside one Markdown code fence, counts too. Qwen2.5-Coder, which was not trained
  on the Hermes tags, answers so although its template asks for them. Output that begins like such
  an object (`{"name"`, `[{"name"`, or a fence before them) is held back until the end, when the
  whole of it decides.
- The content is the text with the calls taken out; when there are calls, the whitespace at its
  start and end (the newlines before, between and after the blocks) is dropped, the whitespace
  between two pieces of text is kept. Without any call the text comes out exactly as generated.
- Streaming holds back text that may be the start of `<tool_call>` (e.g. a trailing `<tool`) and
  trailing whitespace until the next piece decides it; a call is sent whole once `</tool_call>`
  arrives.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (the OpenAI field is a string)
    id: str

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_calls(body: str, names: set[str]) -> list[ToolCall] | None:
    """The calls in a block's body (an object or a list of them), or None unless every one is a
    well-formed call of a known function."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    calls = [_call(x, names) for x in (obj if isinstance(obj, list) else [obj])]
    return calls if calls and all(calls) else None


def _call(obj, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())


_FENCE = re.compile(r"\s*```(?:json)?\s*\n(.*)\n\s*```\s*", re.DOTALL)


def bare_calls(text: str, names: set[str]) -> list[ToolCall] | None:
    """The calls when `text` is only call objects / lists of them (whitespace between; maybe in
    one code fence), else None."""
    if fenced := _FENCE.fullmatch(text):
        text = fenced.group(1)
    dec, calls, i = json.JSONDecoder(), [], 0
    while (i := len(text) - len(text[i:].lstrip())) < len(text):
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        found = [_call(x, names) for x in (obj if isinstance(obj, list) else [obj])]
        if not found or not all(found):
            return None
        calls += found
    return calls or None


_BARE_STARTS = tuple(fence + start for fence in ("", "```", "```json") for start in ('{"name"', '[{"name"'))


def _may_be_bare(text: str) -> bool:
    """Whether text (so far) may begin a bare call: its non-space characters start like one."""
    compact = "".join(text.split())
    return any(compact.startswith(b) or b.startswith(compact) for b in _BARE_STARTS)


def _partial_open(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `<tool_call>`."""
    for n in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Incremental text -> [str | ToolCall]; one per choice."""

    def __init__(self, names: set[str]):
        self.names = names
        self.buf = ""  # undecided text: a partial `<tool_call>`, or a block's body so far
        self.in_call = False  # buf is the body of an open block
        self.pending_ws = ""  # whitespace after the last text, kept only if more text follows
        self.has_text = False  # some text went out: whitespace after it is a gap, not a start
        self.num_calls = 0
        self.held: str | None = ""  # the output so far while it may be bare calls; None once it cannot

    def feed(self, text: str) -> list[str | ToolCall]:
        if self.held is not None:
            self.held += text
            if _may_be_bare(self.held):
                return []
            text, self.held = self.held, None
        return self._feed(text)

    def finish(self) -> list[str | ToolCall]:
        """What is left at the end of generation."""
        if self.held is not None:
            held, self.held = self.held, None
            calls = bare_calls(held, self.names)
            if calls:
                self.num_calls = len(calls)
                return list(calls)
            return self._feed(held) + self._finish()
        return self._finish()

    def _feed(self, text: str) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        self.buf += text
        while True:
            if self.in_call:
                end = self.buf.find(CLOSE)
                if end < 0:
                    return out
                body, self.buf = self.buf[:end], self.buf[end + len(CLOSE):]
                self.in_call = False
                self._block(body, OPEN + body + CLOSE, out)
                continue
            start = self.buf.find(OPEN)
            if start < 0:
                keep = _partial_open(self.buf)
                self._text(self.buf[:len(self.buf) - keep], out)
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            self._text(self.buf[:start], out)
            self.buf = self.buf[start + len(OPEN):]
            self.in_call = True

    def _finish(self) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        if self.in_call:
            self._block(self.buf, OPEN + self.buf, out)
        else:
            self._text(self.buf, out)
        self.buf, self.in_call = "", False
        if self.pending_ws and not self.num_calls:
            out.append(self.pending_ws)
        self.pending_ws = ""
        return out

    def _block(self, body: str, raw: str, out: list) -> None:
        calls = parse_calls(body, self.names)
        if calls is None:
            self._text(raw, out)
            return
        if not self.has_text:  # whitespace before the content's start
            self.pending_ws = ""
        self.num_calls += len(calls)
        out.extend(calls)

    def _text(self, text: str, out: list) -> None:
        if self.num_calls and not self.has_text:  # the content starts after a call
            text = text.lstrip()
        if not text:
            return
        body = text.rstrip()
        if not body:  # whitespace only: decided by what follows
            self.pending_ws += text
            return
        out.append(self.pending_ws + body)
        self.pending_ws = text[len(body):]
        self.has_text = True


def split_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished text; content None when there are calls and no other text."""
    p = ToolCallParser(names)
    items = p.feed(text) + p.finish()
    calls = [x for x in items if isinstance(x, ToolCall)]
    content = "".join(x for x in items if isinstance(x, str))
    return (content or None) if calls else content, calls
