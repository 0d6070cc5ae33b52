"""Tool calling through the server and the official `openai` client, on a tiny random model whose
chat template renders tools the way Qwen2.5's does (Hermes `<tool_call>` blocks).

A random model never writes a call by itself, which makes it the right judge of the forcing
grammar: "required" and named calls must still parse and validate against their schemas, at any
seed. "auto" output with calls in it is produced by constraining the text with `guided_choice`
(allowed beside "auto"), which tests the parser end to end, streamed and not.
"""
import json
import re

import httpx
import jsonschema
import openai
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.model.chat_template import ChatTemplate
from server_harness import ServerThread
from tiny_models import CORPUS, make_model_dir

QWEN_LIKE = (  # the structure of Qwen2.5's template, with its long prose cut short
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall: <tool_call>\\n{\"name\": <name>, \"arguments\": <args>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + "
    "'\\n</tool_response><|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "metric": {"type": "boolean"}},
           "required": ["city", "metric"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}, "b": {"type": "boolean"}},
       "required": ["a"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tool_dir(tmp_path_factory):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    extra = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "metric": true}}\n</tool_call>',
             "<|im_start|>user\nWhat is the weather?<|im_end|>\n"]
    tok.train_from_iterator(CORPUS + extra * 5, trainer)
    d = make_model_dir(tmp_path_factory.mktemp("tools") / "m", seed=3, tokenizer=tok, max_pos=1024)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "chat_template": QWEN_LIKE}))
    return d


@pytest.fixture(scope="module")
def ref(tool_dir):
    return LLM(str(tool_dir))


def rendered(ref, messages, tools=TOOLS) -> str:
    return ChatTemplate(ref.engine.target.tokenizer_config).render(messages, tools=tools)


@pytest.fixture(scope="module")
def servers(tool_dir):
    plain = LLM(str(tool_dir)).engine
    spec = LLM(str(tool_dir), draft=str(tool_dir), spec=SpecConfig(method="draft", k=4), draft_dtype="float32").engine
    with ServerThread(plain) as a, ServerThread(spec) as b:
        yield {"plain": a, "spec": b}


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def check_call(call) -> dict:
    """A returned call is well formed and its arguments are valid against its tool's schema."""
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_tools_are_rendered_into_the_prompt(servers, ref, tool_dir):
    r = client(servers["plain"]).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=1)
    text = rendered(ref, ASK)
    assert '{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city."' in text
    tok = Tokenizer.from_file(str(tool_dir / "tokenizer.json"))
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_named_tool_is_forced_and_valid_at_any_seed(servers, seed):
    r = client(servers["plain"]).chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=1.0, seed=seed, max_tokens=200)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None
    assert [c.function.name for c in ch.message.tool_calls] == ["get_weather"]
    check_call(ch.message.tool_calls[0])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_gives_one_valid_call_without_parallel(servers, seed):
    r = client(servers["plain"]).chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        temperature=1.0, seed=seed, max_tokens=200)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    check_call(ch.message.tool_calls[0])


def test_required_parallel_calls_are_each_valid(servers):
    r = client(servers["plain"]).chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=5, max_tokens=300)
    ch = r.choices[0]
    assert ch.message.tool_calls and ch.finish_reason in ("tool_calls", "length")
    for c in ch.message.tool_calls:
        check_call(c)
    assert ch.finish_reason == "length" or ch.message.content is None  # nothing but calls unless cut off


def _stream(srv, **kw):
    """(content, {index: (id, name, arguments)}, finish_reason) accumulated from delta chunks."""
    content, calls, reason = "", {}, None
    for chunk in client(srv).chat.completions.create(model="tiny", stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                cid, name, args = calls.get(tc.index, ("", "", ""))
                calls[tc.index] = (cid + (tc.id or ""), name + (tc.function.name or ""), args + (tc.function.arguments or ""))
            reason = ch.finish_reason or reason
    return content, calls, reason


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_streamed_named_call_equals_unstreamed(servers, which):
    kw = dict(messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=200)
    r = client(servers[which]).chat.completions.create(model="tiny", **kw)
    content, calls, reason = _stream(servers[which], **kw)
    assert reason == "tool_calls" == r.choices[0].finish_reason and content == ""
    (cid, name, args), = calls.values()
    assert cid.startswith("call_") and name == "get_weather"
    assert args == r.choices[0].message.tool_calls[0].function.arguments


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_greedy_forced_call_with_speculation_equals_plain(servers, choice):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=200)
    plain = client(servers["plain"]).chat.completions.create(**kw)
    spec = client(servers["spec"]).chat.completions.create(**kw)
    assert [(c.function.name, c.function.arguments) for c in spec.choices[0].message.tool_calls] == \
           [(c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls]
    assert spec.choices[0].finish_reason == plain.choices[0].finish_reason
    assert spec.model_extra["draftwise"]["proposed_tokens"] > 0  # it did speculate


def test_auto_without_a_call_is_plain_text(servers, ref):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=12)
    r = client(servers["spec"]).chat.completions.create(**kw)
    want = ref.generate(rendered(ref, ASK), SamplingParams(temperature=0, max_tokens=12))[0].text
    assert "<tool_call>" not in want  # the random model writes no call
    assert r.choices[0].message.content == want and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "length"
    assert _stream(servers["spec"], **{k: v for k, v in kw.items() if k != "model"}) == (want, {}, "length")


MIXED = 'Checking.\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>\n<tool_call>{"name": "nope"}</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_calls_the_model_writes(servers, stream):
    kw = dict(messages=ASK, tools=TOOLS, temperature=0, max_tokens=200, extra_body={"guided_choice": [MIXED]})
    want_text = 'Checking.\n\n<tool_call>{"name": "nope"}</tool_call>'  # the unknown function stays text
    if stream:
        content, calls, reason = _stream(servers["spec"], **kw)
        assert [(n, a) for _, n, a in calls.values()] == [("add", '{"a": 2}')]
    else:
        ch = client(servers["spec"]).chat.completions.create(model="tiny", **kw).choices[0]
        content, reason = ch.message.content, ch.finish_reason
        assert [(c.function.name, c.function.arguments) for c in ch.message.tool_calls] == [("add", '{"a": 2}')]
    assert content == want_text and reason == "tool_calls"


def test_tool_choice_none_is_not_parsed(servers):
    one = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    r = client(servers["plain"]).chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=100, extra_body={"guided_choice": [one]})
    assert r.choices[0].message.content == one and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_a_conversation_with_tool_results_renders_every_turn(servers, ref, tool_dir):
    first = client(servers["plain"]).chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=200)
    call = first.choices[0].message.tool_calls[0]
    msgs = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
    r = client(servers["plain"]).chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=4)
    hist = [dict(m, tool_calls=[{"type": "function", "function": {"name": call.function.name,
                                                                    "arguments": json.loads(call.function.arguments)}}])
            if m.get("tool_calls") else m for m in msgs]
    text = rendered(ref, hist)
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {call.function.arguments}}}\n</tool_call>' in text
    assert "<tool_response>\n{\"temp_c\": 21}\n</tool_response>" in text
    tok = Tokenizer.from_file(str(tool_dir / "tokenizer.json"))
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("body, param, match", [
    ({"functions": [{"name": "f"}]}, "functions", "deprecated form of tools"),
    ({"tools": TOOLS, "function_call": "auto"}, "function_call", "deprecated form of tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "zap"}}}, "tool_choice", "no tool named 'zap'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties":
      {"x": {"type": 7}}}}}], "tool_choice": "required"}, "tools", r"tools\[0\]\.function\.parameters is not a usable"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined with response_format"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "only \"function\" tools"),
])
def test_bad_tool_requests_are_400_and_the_server_keeps_serving(servers, body, param, match):
    srv = servers["spec"]
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert re.search(match, err["message"]), err["message"]
    ok = client(srv).chat.completions.create(model="tiny", messages=ASK, max_tokens=3)
    assert ok.choices[0].finish_reason == "length"


def test_a_template_without_tools_is_a_400_naming_it(target_dir):
    # the embedded test models (and SmolLM2-135M-Instruct) have templates that never read `tools`
    with ServerThread(LLM(str(target_dir)).engine) as srv:
        c = client(srv)
        with pytest.raises(openai.BadRequestError, match="chat template does not render tools") as e:
            c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4)
        assert e.value.body["param"] == "tools"
        past = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}
        with pytest.raises(openai.BadRequestError, match="chat template does not render tools"):
            c.chat.completions.create(model="tiny", messages=ASK + [past], max_tokens=4)
        assert c.chat.completions.create(model="tiny", messages=ASK, max_tokens=3).choices[0].finish_reason == "length"


def test_forced_tool_schemas_are_held_to_the_grammar_size_limit(servers):
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(12000)}}
    r = httpx.post(servers["plain"].url + "/v1/chat/completions", timeout=60, json={
        "messages": ASK, "max_tokens": 4, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "big", "parameters": big}}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "grammar_too_large" and err["param"] == "tools"
    assert "--max-grammar-bytes" in err["message"]
