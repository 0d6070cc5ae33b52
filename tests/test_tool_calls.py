"""Tool calling without a server: the Hermes parser (exact strings, streamed in every split), the
forcing grammar (what it accepts and rejects), the checks of `tools` / `tool_choice` / history,
and which chat templates render tools."""
import json
from pathlib import Path

import pytest
from xgrammar import Grammar
from xgrammar.testing import _is_grammar_accept_string as accepts

from draftwise.model.chat_template import ChatTemplate
from draftwise.server.errors import APIError
from draftwise.server.tool_calls import ToolCall, ToolCallParser, split_tool_calls
from draftwise.server.tool_grammar import Function, tool_call_grammar
from draftwise.server.tools import history, parse_tool_choice, parse_tools

NAMES = {"get_weather", "add"}
CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_A = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'

# text -> (content, [(name, arguments)])
TABLE = [
    ("Hello there.", "Hello there.", []),
    ("  spaced\n\n", "  spaced\n\n", []),  # no call: the text exactly as generated
    (CALL_W, None, [("get_weather", '{"city": "Paris"}')]),
    ("\n" + CALL_W + "\n", None, [("get_weather", '{"city": "Paris"}')]),
    ("Let me check.\n" + CALL_W, "Let me check.", [("get_weather", '{"city": "Paris"}')]),
    (CALL_W + "\n" + CALL_A, None, [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')]),
    (CALL_W + "\nDone.", "Done.", [("get_weather", '{"city": "Paris"}')]),
    ("A.\n" + CALL_W + "\nB.\n", "A.\n\nB.", [("get_weather", '{"city": "Paris"}')]),
    ("\n A " + CALL_W, "\n A", [("get_weather", '{"city": "Paris"}')]),  # decided before the call arrives
    ('<tool_call>{"name":"add","arguments":"{\\"a\\": 3}"}</tool_call>', None, [("add", '{"a": 3}')]),
    ('<tool_call>{"name": "add"}</tool_call>', None, [("add", "{}")]),
    ('<tool_call>[\n{"name": "add", "arguments": {"a": 1}},\n{"name": "get_weather", "arguments": {}}\n]</tool_call>',
     None, [("add", '{"a": 1}'), ("get_weather", "{}")]),  # SmolLM2's list form
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}', None, [("add", '{"a": 1}')]),  # unclosed at the end
    # not calls: stay in the text verbatim
    ('<tool_call>{"name": "add", "arguments": {"a": </tool_call>', '<tool_call>{"name": "add", "arguments": {"a": </tool_call>', []),
    ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', '<tool_call>{"name": "add", "arguments": [1]}</tool_call>', []),
    ('<tool_call>["add"]</tool_call>', '<tool_call>["add"]</tool_call>', []),
    ('<tool_call>[]</tool_call>', '<tool_call>[]</tool_call>', []),
    ('<tool_call>[{"name": "add"}, {"name": "nope"}]</tool_call>', '<tool_call>[{"name": "add"}, {"name": "nope"}]</tool_call>', []),
    ('<tool_call>{"name": "add", "arguments": {"a": 1', '<tool_call>{"name": "add", "arguments": {"a": 1', []),
    ("a < b and <tool", "a < b and <tool", []),
    # bare calls (Qwen2.5-Coder): only when the whole output is calls
    ('{"name": "add", "arguments": {"a": 1}}', None, [("add", '{"a": 1}')]),
    ('\n{"name": "add", "arguments": {}}\n{"name": "get_weather", "arguments": {}}\n', None,
     [("add", "{}"), ("get_weather", "{}")]),
    ('[{"name": "add", "arguments": {}}]', None, [("add", "{}")]),
    ('```json\n{\n  "name": "add",\n  "arguments": {"a": 1}\n}\n```', None, [("add", '{"a": 1}')]),  # Qwen2.5-Coder-1.5B
    ('```\n[{"name": "add"}]\n```\n', None, [("add", "{}")]),
    ('```json\n{"name": "add"}\n```\nThen add.', '```json\n{"name": "add"}\n```\nThen add.', []),
    ('```python\nprint(1)\n```', '```python\nprint(1)\n```', []),
    ('{"name": "add", "arguments": {}} and more', '{"name": "add", "arguments": {}} and more', []),
    ('{"name": "nope", "arguments": {}}', '{"name": "nope", "arguments": {}}', []),
    ('{"name": "add", "arguments": {"a":', '{"name": "add", "arguments": {"a":', []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('Use {"name": "add", "arguments": {}}', 'Use {"name": "add", "arguments": {}}', []),
    ("x <tool_call>bad</tool_call> " + CALL_A, "x <tool_call>bad</tool_call>", [("add", '{"a": 1, "b": 2}')]),
]


def _flat(calls: list[ToolCall]):
    return [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("text, content, calls", TABLE)
def test_split_exact(text, content, calls):
    got_content, got_calls = split_tool_calls(text, NAMES)
    assert got_content == content
    assert _flat(got_calls) == calls
    assert all(c.id.startswith("call_") for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("text, content, calls", TABLE)
@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_streamed_in_pieces_equals_whole(text, content, calls, step):
    p = ToolCallParser(NAMES)
    items = [x for i in range(0, len(text), step) for x in p.feed(text[i:i + step])] + p.finish()
    got_calls = [x for x in items if isinstance(x, ToolCall)]
    got_text = "".join(x for x in items if isinstance(x, str))
    assert _flat(got_calls) == calls
    assert (got_text or None if calls else got_text) == content


def test_stream_holds_back_a_possible_tag_until_decided():
    p = ToolCallParser(NAMES)
    assert p.feed("Hi <tool") == ["Hi"]
    assert p.feed("_call>") == []
    assert p.feed('{"name": "add", "arguments": {}}') == []
    out = p.feed("</tool_call>")
    assert len(out) == 1 and out[0].name == "add"
    p = ToolCallParser(NAMES)
    assert p.feed("a <to") == ["a"]
    assert p.feed("ast") == [" <toast"]


def test_stream_holds_what_may_be_a_bare_call_until_the_end():
    p = ToolCallParser(NAMES)
    assert p.feed('{"na') == [] and p.feed('me": "add", "arguments": {}}') == []
    out = p.finish()
    assert [c.name for c in out] == ["add"]
    p = ToolCallParser(NAMES)
    assert p.feed('{"an') == ['{"an']  # cannot be a call: streamed at once
    p = ToolCallParser(NAMES)
    assert p.feed(" ") == [] and p.feed("Hi") == [" Hi"]


ARGS = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"], "additionalProperties": False}
FUNCS = [Function("get_weather", ARGS), Function("add", {"type": "object", "properties": {}})]


def test_grammar_accepts_exactly_valid_calls():
    g = Grammar.from_ebnf(tool_call_grammar(FUNCS, parallel=False))
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    assert accepts(g, one)
    assert accepts(g, '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>')
    assert not accepts(g, one + "\n" + one)  # one call only without parallel
    assert not accepts(g, one.replace('"c"', '"k"'))  # enum
    assert not accepts(g, one.replace('"city": "Oslo", ', ""))  # required property
    assert not accepts(g, one.replace("get_weather", "other"))
    assert not accepts(g, "Sure. " + one)  # no text around a forced call
    gp = Grammar.from_ebnf(tool_call_grammar(FUNCS, parallel=True))
    assert accepts(gp, one + "\n" + one) and accepts(gp, one)
    assert not accepts(gp, "")


def test_grammar_names_the_bad_schema():
    with pytest.raises(ValueError, match=r"tools\[1\]\.function\.parameters is not a usable JSON schema"):
        tool_call_grammar([FUNCS[0], Function("bad", {"type": "object", "properties": {"x": {"type": 5}}})], False)


def _tool(name, params=None):
    fn = {"name": name}
    if params is not None:
        fn["parameters"] = params
    return {"type": "function", "function": fn}


@pytest.mark.parametrize("tools, match", [
    ([{"type": "custom", "custom": {}}], r"tools\[0\]\.type: only \"function\""),
    ([{"type": "function"}], r"tools\[0\]\.function must be an object"),
    ([_tool("has space")], r"tools\[0\]\.function\.name must be 1-64"),
    ([_tool("f"), _tool("f")], r"tools\[1\]\.function\.name: 'f' is given twice"),
    ([_tool("f", {"type": "string"})], r"tools\[0\]\.function\.parameters must be a JSON schema of type \"object\""),
    ([_tool(f"f{i}") for i in range(129)], "at most 128 tools"),
])
def test_bad_tools_are_named(tools, match):
    with pytest.raises(APIError, match=match) as e:
        parse_tools(tools)
    assert e.value.status == 400 and e.value.param == "tools"


def test_tool_choice_forms():
    fs = parse_tools([_tool("f"), _tool("g", ARGS)])
    assert fs[0].parameters == {"type": "object", "properties": {}}
    assert parse_tool_choice(None, fs) == ("auto", None)
    assert parse_tool_choice(None, []) == ("none", None)
    assert parse_tool_choice("required", fs) == ("required", None)
    assert parse_tool_choice({"type": "function", "function": {"name": "g"}}, fs) == ("named", "g")
    for bad, match in [("always", "tool_choice must be one of"), ({"type": "function", "function": {"name": "h"}},
                       "no tool named 'h'"), ({"name": "f"}, "a named tool is"), ([], "a named tool is")]:
        with pytest.raises(APIError, match=match):
            parse_tool_choice(bad, fs)
    with pytest.raises(APIError, match="needs tools"):
        parse_tool_choice("required", [])


def test_history_arguments_become_objects_and_bad_entries_are_named():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    out = history([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                   {"role": "tool", "content": "42", "tool_call_id": "call_1"}])
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert call["function"]["arguments"] == '{"x": 1}'  # the request itself is not changed
    with pytest.raises(APIError, match=r"messages\[0\]\.tool_call_id is required"):
        history([{"role": "tool", "content": "42"}])
    with pytest.raises(APIError, match=r"messages\[1\]\.tool_calls\[0\] must be"):
        history([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}])
    with pytest.raises(APIError, match=r"messages\[0\]\.tool_calls: only assistant"):
        history([{"role": "user", "content": "q", "tool_calls": [call]}])


SMOLLM2_TEMPLATE = (  # SmolLM2-135M-Instruct's template: ChatML, never reads `tools`
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOOLS_TEMPLATE = (
    "{% if tools %}# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}\n{% endfor %}"
)


def test_which_templates_render_tools():
    assert not ChatTemplate().renders_tools  # the plain template of the embedded models
    assert not ChatTemplate({"chat_template": SMOLLM2_TEMPLATE}).renders_tools
    assert not ChatTemplate({"chat_template": "{{ raise_exception('no') }}"}).renders_tools
    t = ChatTemplate({"chat_template": TOOLS_TEMPLATE})
    assert t.renders_tools
    tools = [_tool("get_weather", {"type": "object", "properties": {"q": {"description": "<b> & é"}}})]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"q": "x"}}}
    text = t.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}],
                    tools=tools)
    # transformers' tojson: key order kept, no HTML escaping, no ASCII escaping
    assert ('# Tools\n{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", '
            '"properties": {"q": {"description": "<b> & é"}}}}}\n') in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"q": "x"}}</tool_call>' in text
    assert json.loads(text.split("# Tools\n")[1].splitlines()[0])["function"]["name"] == "get_weather"


def test_the_smollm2_tools_template_renders_tools_and_nothing_else_differently():
    path = Path(__file__).resolve().parents[1] / "docs" / "chat_templates" / "smollm2_tools.jinja"
    cfg = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    shipped, ours = ChatTemplate(dict(cfg, chat_template=SMOLLM2_TEMPLATE)), ChatTemplate(dict(cfg, chat_template=path.read_text()))
    assert ours.renders_tools
    for msgs in ([{"role": "user", "content": "hi"}],
                 [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                  {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]):
        for gen in (True, False):
            assert ours.render(msgs, gen) == shipped.render(msgs, gen)
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    text = ours.render([{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "content": "3", "tool_call_id": "c"}], tools=[_tool("add")])
    assert '<tools>\n{"type": "function", "function": {"name": "add"}}\n</tools>' in text
    assert text.endswith('<|im_start|>assistant\n<tool_call>[\n{"name": "add", "arguments": {"a": 1}}\n]</tool_call>'
                         '<|im_end|>\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n'
                         '<|im_start|>assistant\n')
