"""Request bodies of the OpenAI API (pydantic) and their mapping to `SamplingParams`.

Fields the OpenAI API lacks are accepted as extra body fields, as vLLM does: `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`. Unknown fields are ignored.
Structured output: OpenAI `response_format` (`json_object`, `json_schema`), vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs` (json, regex, choice,
grammar, json_object): at most one of them, mapped to `SamplingParams.structured_output`; an
invalid one is a 400 naming the field the request used. `speculation` (draftwise's own:
`{"enabled": false}`, `{"max_draft": N}`) maps to `SamplingParams.max_draft`.
Chat messages: `message_error` finds an unknown role or a content part that is not text (400).
A body pydantic cannot parse (wrong types, missing `prompt`) is a 422; values of the right type
but out of range are checked by `SamplingParams` and answered 400 naming the parameter.
`invalid_text` finds a string that is not valid Unicode text (a lone surrogate such as the JSON
escape `"\\ud800"`, which cannot be tokenized or echoed back): 400 naming where it is.
"""
from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict

from ..sampling import SamplingParams


def invalid_text(obj, where: str = "") -> str | None:
    """The first string in a request body (a model, list or dict) that cannot be encoded as UTF-8,
    as "WHERE: ..." (e.g. "messages[0].content: lone surrogate \\ud800 at character 3"); None if all are."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"{where or 'body'}: not valid Unicode text (lone surrogate \\u{ord(obj[e.start]):04x} at character {e.start})"
        return None
    if isinstance(obj, BaseModel):
        items = ((k, getattr(obj, k)) for k in type(obj).model_fields)
        return next((m for k, v in items if (m := invalid_text(v, f"{where}.{k}" if where else k))), None)
    if isinstance(obj, (list, tuple)):
        if obj and isinstance(obj[0], int):  # token ids: nothing to check, and lists may be long
            return None
        return next((m for i, v in enumerate(obj) if (m := invalid_text(v, f"{where}[{i}]"))), None)
    if isinstance(obj, dict):
        for k, v in obj.items():
            m = invalid_text(k, f"{where} key") or invalid_text(v, f"{where}[{k!r}]")
            if m:
                return m
    return None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    # extra body fields (vLLM-style)
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    # structured output (OpenAI and vLLM-style)
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None
    # speculation for this request (draftwise): {"enabled": false} or {"max_draft": N}
    speculation: Any = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the offending parameter."""
        bias = None
        if self.logit_bias is not None:
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    bias[int(k)] = v
                except ValueError:
                    raise ValueError(f"logit_bias: token id must be an integer >= 0, got {k!r}") from None
        field, constraint = self.structured_output()
        try:
            return self._sampling_params(max_tokens, logprobs, bias, constraint)
        except ValueError as e:
            if field and str(e).startswith("structured_output"):
                raise ValueError(f"{field}: {e}") from None
            raise

    def _sampling_params(self, max_tokens, logprobs, bias, constraint) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=bias, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            logprobs=logprobs, n=self.n, structured_output=constraint, max_draft=speculation_cap(self.speculation),
        )

    def structured_output(self) -> tuple[str | None, dict | None]:
        """(the request's field, `SamplingParams.structured_output`); ValueError naming the field."""
        given = {name: v for name in _CONSTRAINT_FIELDS if (v := getattr(self, name)) is not None}
        if self.response_format is not None and self.response_format.get("type", "text") == "text":
            given.pop("response_format")
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)}: give at most one structured-output constraint")
        if not given:
            return None, None
        (name, v), = given.items()
        if name == "response_format":
            return name, _response_format(v)
        if name == "structured_outputs":
            return name, _structured_outputs(v)
        return name, {_GUIDED[name]: v}


_CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                      "structured_outputs")
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                       "json_object": "json_object"}


def _response_format(rf: dict) -> dict:
    kind = rf.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise ValueError("response_format.json_schema must be an object with a \"schema\"")
        return {"json_schema": js["schema"]}
    raise ValueError(f"response_format.type must be one of text, json_object, json_schema, got {kind!r}")


def _structured_outputs(so: dict) -> dict:
    given = {k: v for k, v in so.items() if k in _STRUCTURED_OUTPUTS and v not in (None, False)}
    if len(given) != 1:
        raise ValueError(f"structured_outputs must set exactly one of {', '.join(_STRUCTURED_OUTPUTS)}")
    (k, v), = given.items()
    return {_STRUCTURED_OUTPUTS[k]: v}


def speculation_cap(value) -> int | None:
    """The request's `speculation` object -> `SamplingParams.max_draft`: {"enabled": false} -> 0,
    {"max_draft": N} -> N, {} or {"enabled": true} -> None (the server's k)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"speculation must be an object such as {{\"enabled\": false}} or {{\"max_draft\": 2}}, "
                         f"got {value!r}")
    unknown = sorted(set(value) - {"enabled", "max_draft"})
    if unknown:
        raise ValueError(f"speculation: unknown field {unknown[0]!r} (enabled, max_draft)")
    enabled, cap = value.get("enabled", True), value.get("max_draft")
    if not isinstance(enabled, bool):
        raise ValueError(f"speculation.enabled must be true or false, got {enabled!r}")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
        raise ValueError(f"speculation.max_draft must be an integer >= 0 (0: no speculation), got {cap!r}")
    if not enabled:
        if cap:
            raise ValueError(f"speculation: enabled is false but max_draft is {cap}")
        return 0
    return cap


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class TextPart(BaseModel):
    """A content part: any `type` parses (so that `message_error` can name an unsupported one)."""
    model_config = ConfigDict(extra="ignore")
    type: str = "text"
    text: str | None = None


ROLES = ("system", "user", "assistant", "tool", "developer")


def message_error(messages: list["ChatMessage"]) -> str | None:
    """What the server cannot take in `messages` (an unknown role, a content part that is not
    text), as "messages[i]...: why"; None if nothing."""
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            return f"messages[{i}].role: unknown role {m.role!r} (one of {', '.join(ROLES)})"
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if part.type != "text":
                return (f"messages[{i}].content[{j}]: content parts of type {part.type!r} are not supported "
                        "(this server's models read text only: send \"text\" parts)")
            if part.text is None:
                return f"messages[{i}].content[{j}]: a \"text\" part needs a \"text\" string"
    return None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list | None = None  # an assistant turn's calls; checked by tools.history
    tool_call_id: str | None = None  # a tool message: the call it answers

    def as_dict(self) -> dict:
        c = self.content
        if isinstance(c, list):
            c = "".join(p.text or "" for p in c)
        d = {"role": self.role, "content": c or ""}
        if self.name:
            d["name"] = self.name
        if self.tool_calls is not None:
            d["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # extra: render the assistant turn's opening
    # tool calling (tools.py); the legacy fields are declared to be rejected, not ignored
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    functions: list | None = None
    function_call: str | dict | None = None
