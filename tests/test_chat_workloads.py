"""The chat workloads (chat-grounded, chat-open): messages in the JSONL, rendered with the model's
chat template by the in-process bench (the plain template when the model has none), sent to
/v1/chat/completions by `bench --url`."""
import json
import shutil

import pytest

from draftwise import LLM
from draftwise.cli.main import main
from draftwise.lab.make_workloads import chat_candidates, chat_messages
from draftwise.lab.workload import Request, load_workload, parse_request, read_jsonl, write_jsonl
from draftwise.model.chat_template import ChatTemplate
from server_harness import ServerThread

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}" \
           "{% if add_generation_prompt %}<assistant>{% endif %}"


@pytest.fixture(scope="module")
def chat_model_dir(target_dir, tmp_path_factory):
    """The tiny target with a chat template in chat_template.jinja."""
    d = tmp_path_factory.mktemp("chat") / "m"
    shutil.copytree(target_dir, d)
    (d / "chat_template.jinja").write_text(TEMPLATE)
    return d


def test_shipped_chat_workloads_are_messages():
    grounded, open_ = load_workload("chat-grounded"), load_workload("chat-open")
    for wl in (grounded, open_):
        assert len(wl.requests) == 24 and not wl.sampled
        assert all(r.messages and r.messages[0][0] == "user" and not r.prompt for r in wl.requests)
        assert len({r.messages for r in wl.requests}) == 24  # no request twice
    # grounded requests carry a passage (a function's source or a module docstring); open ones do not
    assert all(len(r.messages[0][1]) > 250 for r in grounded.requests)
    assert sum("```python" in r.messages[0][1] for r in grounded.requests) >= 12
    assert all(len(r.messages[0][1]) < 300 and "```" not in r.messages[0][1] for r in open_.requests)


def test_chat_candidates_and_asks_rotate():
    src = ('"""' + "A module docstring that is long enough to be a passage. " * 8 + '"""\n\n'
           "def parse(text, strict=False):\n    \"\"\"Parse the text into a list of words and return it.\"\"\"\n"
           + "".join(f"    x{i} = {i}\n" for i in range(8)) + "    return text.split()\n")
    c = chat_candidates([("pkg/mod.py", src)])
    assert [(fid, kind) for fid, kind, _ in c["chat-grounded"]] == [("pkg.mod:doc", "doc"), ("pkg.mod:3:parse", "function")]
    assert [(fid, kind) for fid, kind, _ in c["chat-open"]] == [("pkg.mod:3:parse", "open")]
    fid, kind, fields = c["chat-grounded"][1]
    asks = {chat_messages(i, kind, fields)[0][1].split("\n\n")[0] for i in range(8)}
    assert len(asks) == 4  # four asks over a function, in rotation
    assert all(chat_messages(i, kind, fields)[0][1].endswith("    return text.split()\n```") for i in range(4))
    assert "Parse the text into a list of words" in chat_messages(0, *c["chat-open"][0][1:])[0][1]


def test_messages_parse_round_trip_and_errors(tmp_path):
    r = parse_request({"id": "a", "messages": [{"role": "system", "content": "Be terse."},
                                               {"role": "user", "content": "Hi"}], "max_tokens": 4}, "x:1")
    assert r.messages == (("system", "Be terse."), ("user", "Hi")) and r.prompt == ""
    assert r.render_prompt(ChatTemplate({"chat_template": TEMPLATE})) == \
        "<system>Be terse.</system><user>Hi</user><assistant>"
    assert r.render_prompt(ChatTemplate({})) == "system: Be terse.\nuser: Hi\nassistant:"  # the plain template
    plain = Request("b", "def f():", 4)
    assert plain.render_prompt(ChatTemplate({"chat_template": TEMPLATE})) == "def f():"
    p = tmp_path / "w.jsonl"
    write_jsonl(p, [r, plain])
    assert read_jsonl(p) == [r, plain]
    assert "prompt" not in json.loads(p.read_text().splitlines()[0])
    for bad, msg in [
        ({"id": "a", "prompt": "x", "messages": [{"role": "user", "content": "y"}], "max_tokens": 4}, "exactly one"),
        ({"id": "a", "max_tokens": 4}, "exactly one"),
        ({"id": "a", "messages": [], "max_tokens": 4}, "non-empty list"),
        ({"id": "a", "messages": [{"role": "robot", "content": "y"}], "max_tokens": 4}, "messages[0].role"),
        ({"id": "a", "messages": [{"role": "user", "content": ""}], "max_tokens": 4}, "messages[0].content"),
        ({"id": "a", "messages": [{"role": "user"}], "max_tokens": 4}, "exactly 'role' and 'content'"),
        ({"id": "a", "messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 4}, "lone surrogate"),
    ]:
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            parse_request(bad, "x:1")


def _bench(model_dir, out, workload="chat-grounded"):
    return main(["bench", "--model", str(model_dir), "--workload", workload, "--configs", "none,ngram:k=4",
                 "--concurrency", "1,2", "--num-requests", "3", "--max-tokens", "8", "--out", str(out)])


def test_bench_chat_grounded_end_to_end(chat_model_dir, target_dir, tmp_path, capsys):
    assert _bench(chat_model_dir, tmp_path / "chat") == 0
    wl = json.loads((tmp_path / "chat" / "results.json").read_text())["workloads"][0]
    assert wl["name"] == "chat-grounded" and wl["chat_template"] == "model"
    for r in wl["runs"]:
        assert r["completed"] == 3 and r["output_tokens"] == 3 * 8
        assert r["correctness"]["mismatching_requests"] == 0
    assert "no chat template" not in capsys.readouterr().err
    # a model without a chat template: the plain one, said on the console and in the results
    assert _bench(target_dir, tmp_path / "plain", "chat-open") == 0
    assert "has no chat template" in capsys.readouterr().err
    wl = json.loads((tmp_path / "plain" / "results.json").read_text())["workloads"][0]
    assert wl["chat_template"] == "plain" and all(r["completed"] == 3 for r in wl["runs"])
    # prompts differ with the template: the model's template makes them longer here
    assert main(["bench", "--model", str(chat_model_dir), "--workload", "grounded", "--configs", "none",
                 "--concurrency", "1", "--num-requests", "1", "--max-tokens", "2", "--out", str(tmp_path / "g")]) == 0
    assert json.loads((tmp_path / "g" / "results.json").read_text())["workloads"][0]["chat_template"] is None


def test_bench_url_sends_chat_requests(chat_model_dir, tmp_path):
    wl = tmp_path / "chat.jsonl"
    wl.write_text("".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": p}], "max_tokens": 6})
                          + "\n" for i, p in enumerate(["def add(a, b):", "class Point:"])))
    engine = LLM(str(chat_model_dir)).engine
    with ServerThread(engine, "tiny") as srv:
        rc = main(["bench", "--url", srv.url, "--workload", str(wl), "--concurrency", "2",
                   "--out", str(tmp_path / "out")])
    assert rc == 0
    runs = json.loads((tmp_path / "out" / "results.json").read_text())["workloads"][0]["runs"]
    assert runs[0]["completed"] == 2 and runs[0]["errors"] == 0 and runs[0]["output_tokens"] == 2 * 6
