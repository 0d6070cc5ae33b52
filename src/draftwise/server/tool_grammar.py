"""The grammar that forces a tool call (`tool_choice` "required" or a named function).

A call is written exactly as `tool_calls.py` parses it and as the Hermes / Qwen2.5 templates show
it to the model:

    <tool_call>
    {"name": "NAME", "arguments": ARGS}
    </tool_call>

where ARGS follows the function's `parameters` JSON schema (compact separators, as for
`response_format`: a bounded form keeps even a random model from padding with whitespace).
"required" allows one call of any tool, or, with `parallel_tool_calls`, several separated by a
newline; a named function exactly one call of it. EOS is allowed only after a complete call.

The calls are assembled as an xgrammar structural tag (which keeps the rule names of several
schemas apart) and handed to the engine as EBNF text, i.e. the ordinary `{"grammar": ...}`
constraint: compiled, cached and applied to p and q under speculation like any other.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .tool_calls import CLOSE, OPEN


@dataclass(frozen=True)
class Function:
    """One function of a request's `tools`."""
    name: str
    parameters: dict  # a JSON schema of type object

    def ebnf(self) -> str:
        """The EBNF of its arguments; ValueError with xgrammar's reason when the schema is invalid."""
        import xgrammar as xgr

        try:
            return str(xgr.Grammar.from_json_schema(json.dumps(self.parameters), any_whitespace=False))
        except Exception as e:  # xgrammar raises RuntimeError with a C++ source location first
            raise ValueError(_clean(e)) from None


def _clean(e: Exception) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", msg)


def _tag(f: Function, args_ebnf: str) -> dict:
    return {"type": "tag", "begin": f'{OPEN}\n{{"name": {json.dumps(f.name)}, "arguments": ',
            "content": {"type": "grammar", "grammar": args_ebnf}, "end": f"}}\n{CLOSE}"}


def tool_call_grammar(functions: list[Function], parallel: bool) -> str:
    """EBNF text: one call of one of `functions` (several with `parallel`).
    ValueError "tools[i].function.parameters: ..." when a schema does not compile."""
    import xgrammar as xgr

    tags = []
    for i, f in enumerate(functions):
        try:
            tags.append(_tag(f, f.ebnf()))
        except ValueError as e:
            raise ValueError(f"tools[{i}].function.parameters is not a usable JSON schema: {e}") from None
    if parallel:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
               "stop_after_first": False}
    elif len(tags) == 1:
        fmt = tags[0]
    else:
        fmt = {"type": "or", "elements": tags}
    return str(xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": fmt})))
