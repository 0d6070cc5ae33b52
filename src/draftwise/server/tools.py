"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`, and the
assistant `tool_calls` / `tool` messages of later turns.

The tools reach the model only through its chat template (the template's own prompt, e.g.
Qwen2.5's "# Tools ... <tools></tools>" system block); a template that never shows `tools`
(`ChatTemplate.renders_tools`) makes any request with tools, or with `tool_calls` in its
history, a 400: the model would not see them. `tool_choice`:

- "none": the tools are rendered, the output is plain text (nothing is parsed);
- "auto" (the default with tools): the model decides; `<tool_call>` blocks in its output become
  `message.tool_calls` (tool_calls.py), text without them is an ordinary answer;
- "required" / `{"type": "function", "function": {"name": ...}}`: the output is forced by a
  grammar (tool_grammar.py) to be one call (several with `parallel_tool_calls`) of any tool / of
  that one, with arguments valid against its `parameters` schema. A forced call cannot be combined
  with `response_format` or another structured-output field (400).

A finished choice with at least one call and an end of generation by EOS or a stop string has
`finish_reason: "tool_calls"`. The legacy `functions` / `function_call` fields are rejected (400)
rather than ignored: their response shape (`message.function_call`) is not produced.
In history, an assistant message's `tool_calls[].function.arguments` (a JSON string in the OpenAI
API) is handed to the template as an object, as transformers' templates expect (Qwen2.5 writes
`arguments | tojson`); a string that is not JSON is passed on as it is.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field

from ..model.chat_template import ChatTemplate
from ..sampling import SamplingParams
from .errors import APIError
from .tool_calls import ToolCall, ToolCallParser, split_tool_calls
from .tool_grammar import Function, tool_call_grammar

MAX_TOOLS = 128  # as the OpenAI API
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHOICES = ("none", "auto", "required")


def _bad(msg: str, param: str = "tools", code: str = "invalid_value") -> APIError:
    return APIError(400, msg, param, code)


def _too_large(what: str, limit: int) -> APIError:
    param = what.split(":")[0]
    return APIError(400, f"{what}; this server compiles at most {limit} (--max-grammar-bytes)", param,
                    "grammar_too_large")


def parse_tools(tools: list | None) -> list[Function]:
    """The request's `tools` checked: function tools with unique valid names and object schemas."""
    if not tools:
        return []
    if len(tools) > MAX_TOOLS:
        raise _bad(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}")
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise _bad(f"{where}.type: only \"function\" tools are supported, got {kind!r}")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function must be an object with a \"name\"")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _bad(f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, _ or -, got {name!r}")
        if name in seen:
            raise _bad(f"{where}.function.name: {name!r} is given twice")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise _bad(f"{where}.function.parameters must be a JSON schema of type \"object\"")
        out.append(Function(name, {"type": "object", **params}))
    return out


def parse_tool_choice(choice, functions: list[Function]) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function or None)."""
    if choice is None:
        return ("auto" if functions else "none"), None
    if isinstance(choice, str):
        if choice not in _CHOICES:
            raise _bad(f"tool_choice must be one of {', '.join(_CHOICES)} or "
                       f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}", "tool_choice")
        if choice == "required" and not functions:
            raise _bad("tool_choice \"required\" needs tools", "tool_choice")
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or choice.get("type") != "function":
        raise _bad("tool_choice: a named tool is {\"type\": \"function\", \"function\": {\"name\": ...}}, "
                   f"got {json.dumps(choice)[:200]}", "tool_choice")
    if name not in {f.name for f in functions}:
        raise _bad(f"tool_choice.function.name: no tool named {name!r} in tools", "tool_choice")
    return "named", name


def history(messages: list[dict]) -> list[dict]:
    """Earlier turns for the template: tool calls checked, their arguments as objects."""
    out = []
    for i, m in enumerate(messages):
        if m.get("role") == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise _bad(f"messages[{i}].tool_call_id is required in a tool message", "messages")
        if m.get("tool_calls") is not None:
            if m.get("role") != "assistant":
                raise _bad(f"messages[{i}].tool_calls: only assistant messages have tool calls", "messages")
            m = dict(m, tool_calls=[_past_call(c, f"messages[{i}].tool_calls[{j}]")
                                    for j, c in enumerate(m["tool_calls"])])
        out.append(m)
    return out


def _past_call(c, where: str) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                   "messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass  # passed on as written
    return {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _structured_field(req) -> str | None:
    """The request's structured-output field, if any (an invalid one is reported by `sampling_params`)."""
    try:
        return req.structured_output()[0]
    except ValueError:
        return None


@dataclass
class ChatTools:
    """One chat request's tools: what the template gets, the forcing grammar, the output parsers."""
    functions: list[Function] = field(default_factory=list)
    choice: str = "none"
    named: str | None = None
    parallel: bool = True
    rendered: list[dict] | None = None  # the `tools` the template renders
    parsers: dict[int, ToolCallParser] = field(default_factory=dict)  # per streamed choice
    sent: dict[int, int] = field(default_factory=dict)  # calls streamed per choice

    @staticmethod
    def from_request(req, template: ChatTemplate, messages: list[dict]) -> "ChatTools":
        """`req`: a ChatCompletionRequest. 400s naming the field for everything it cannot honour."""
        for legacy in ("functions", "function_call"):
            if getattr(req, legacy) is not None:
                raise _bad(f"{legacy} is the deprecated form of tools and is not supported: send `tools` "
                           "([{\"type\": \"function\", \"function\": {...}}]) and `tool_choice`", legacy, "unsupported")
        functions = parse_tools(req.tools)
        choice, named = parse_tool_choice(req.tool_choice, functions)
        has_calls = any(m.get("tool_calls") for m in messages)
        if (functions or has_calls) and not template.renders_tools:
            what = "tools" if functions else "messages"
            raise _bad(f"{what}: this model's chat template does not render tools, so the model would never see "
                       "them; use a model whose template does (e.g. Qwen2.5), or put a chat_template.jinja that "
                       "renders `tools` in the model directory", what, "unsupported")
        other = _structured_field(req)
        if choice in ("required", "named") and other:
            raise _bad(f"tool_choice {choice if choice != 'named' else repr(named)} forces a tool call and cannot be "
                       f"combined with {other}", "tool_choice")
        return ChatTools(functions, choice, named, req.parallel_tool_calls, req.tools or None)

    @property
    def parsing(self) -> bool:
        return self.choice != "none"

    @property
    def names(self) -> set[str]:
        return {f.name for f in self.functions}

    def constrain(self, params: SamplingParams, max_bytes: int) -> SamplingParams:
        """`params` with the forcing grammar for "required" / a named tool (unchanged otherwise).
        Builds the grammar: run it off the event loop. The schemas and the grammar are held to
        `max_bytes` (`--max-grammar-bytes`) before the grammar is parsed here; its compile is then
        bounded like any constraint's (constraints.py)."""
        if self.choice not in ("required", "named"):
            return params
        forced = self.functions if self.choice == "required" else [f for f in self.functions if f.name == self.named]
        size = sum(len(json.dumps(f.parameters)) for f in forced)
        if size > max_bytes:
            raise _too_large(f"tools: the forced tools' parameter schemas are {size} bytes", max_bytes)
        try:
            ebnf = tool_call_grammar(forced, self.parallel and self.choice == "required")
        except ValueError as e:
            if self.choice == "named":  # name the tool's position in the request, not in `forced`
                idx = next(i for i, f in enumerate(self.functions) if f.name == self.named)
                e = ValueError(re.sub(r"^tools\[0\]", f"tools[{idx}]", str(e)))
            raise _bad(str(e)) from None
        if len(ebnf.encode("utf-8")) > max_bytes:
            raise _too_large(f"tool_choice: the grammar of the forced call is {len(ebnf.encode('utf-8'))} bytes", max_bytes)
        return dataclasses.replace(params, structured_output={"grammar": ebnf})

    def finish_reason(self, reason: str | None, num_calls: int) -> str | None:
        return "tool_calls" if num_calls and reason == "stop" else reason

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """A finished choice's (message, finish_reason)."""
        if not self.parsing:
            return {"role": "assistant", "content": text}, reason
        content, calls = split_tool_calls(text, self.names)
        msg = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [c.as_openai() for c in calls]
        return msg, self.finish_reason(reason, len(calls))

    def stream(self, index: int, text: str) -> list[dict]:
        """The deltas for choice `index`'s next piece of text (maybe none while undecided)."""
        if not self.parsing:
            return [{"content": text}]
        return self._deltas(index, self._parser(index).feed(text))

    def finish_stream(self, index: int, reason: str | None) -> tuple[list[dict], str | None]:
        """The last deltas of choice `index` and its finish_reason."""
        if not self.parsing:
            return [], reason
        parser = self._parser(index)
        deltas = self._deltas(index, parser.finish())
        return deltas, self.finish_reason(reason, parser.num_calls)

    def _parser(self, index: int) -> ToolCallParser:
        if index not in self.parsers:
            self.parsers[index] = ToolCallParser(self.names)
        return self.parsers[index]

    def _deltas(self, index: int, items: list[str | ToolCall]) -> list[dict]:
        out = []
        for x in items:
            if isinstance(x, str):
                out.append({"content": x})
                continue
            k = self.sent.get(index, 0)
            self.sent[index] = k + 1
            out.append({"tool_calls": [{"index": k, **x.as_openai()}]})
        return out
