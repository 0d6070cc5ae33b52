"""The chat template: messages -> one prompt string.

When the model has a chat template (`chat_template.jinja` in its directory, which wins as in
transformers 5, else the `chat_template` of `tokenizer_config.json`: a Jinja2 string, or a list of
`{"name", "template"}` from which "default" is taken; `load_model` puts either in the tokenizer
config, and `import-gguf` writes the GGUF's `tokenizer.chat_template` there) it is rendered as
Hugging Face does: in a sandbox, with `messages`, `add_generation_prompt`, `bos_token`,
`eos_token`, `raise_exception`, `tools` (the request's tool definitions, None without) and
transformers' `tojson` filter (not Jinja's HTML-safe one: tool schemas keep their key order and
`<`, `>`). Otherwise the plain template below is used, one line per message:

    system: You are terse.
    user: Say hi.
    assistant:

i.e. `"{role}: {content}\\n"` per message, then `"assistant:"` when a reply is wanted. The rendered
text is tokenized without adding special tokens (a template that wants a BOS writes it).

It lives in model/ (it reads only the tokenizer config) because both `server/` (chat requests) and
`lab/` (the chat workloads) render it.
"""
from __future__ import annotations

import json
from functools import cached_property

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _token_str(v) -> str:
    if isinstance(v, dict):
        return v.get("content", "") or ""
    return v or ""


def _raise(msg: str):
    raise jinja2.TemplateError(msg)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, tokenizer_config: dict | None = None):
        cfg = tokenizer_config or {}
        source = cfg.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        self.is_plain = not source
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        self.template = env.from_string(source or PLAIN_TEMPLATE)
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """Raises ValueError when the template rejects the conversation."""
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, tools=tools,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"messages: the chat template rejected them: {e}") from None

    @cached_property
    def renders_tools(self) -> bool:
        """Whether the model would see `tools`: a probe function's name appears in a rendering."""
        probe = {"type": "function", "function": {"name": "draftwise_probe_tool", "description": "",
                                                  "parameters": {"type": "object", "properties": {}}}}
        try:
            return "draftwise_probe_tool" in self.render([{"role": "user", "content": "hi"}], True, [probe])
        except Exception:  # a template that cannot take the probe cannot take tools either
            return False
