"""Hostile but realistic requests: each is answered with a clear 4xx (or served, where
the value is legal), and after each the server is whole: /health answers, a greedy request gives
exactly the text it gave before, and every K/V block is free.

Engine-level poisoning (an exception inside a step, a NaN distribution) is tested with the
engine's failure isolation (tests/test_failure_isolation.py, tests/test_server_errors.py).
"""
import asyncio
import json
import time

import httpx
import pytest

from draftwise import LLM, SpecConfig
from draftwise.server.limits import ServerLimits
from server_harness import ServerThread

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = ServerLimits(max_request_bytes=64 * 1024, max_prompt_chars=5000, max_prompts=4, max_n=8, max_stop=4,
                      max_stop_chars=16, max_grammar_bytes=32 * 1024, grammar_compile_timeout=1)
MAX_NUM_SEQS, MAX_QUEUE = 4, 4  # the server holds 8 choices at once
GREEDY = {"prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv(target_dir, draft_dir):
    engine = LLM(str(target_dir), draft=str(draft_dir), spec=SpecConfig(method="draft", k=3),
                 max_num_seqs=MAX_NUM_SEQS).engine
    with ServerThread(engine, max_queue=MAX_QUEUE, limits=LIMITS, api_key=KEY, warm_grammar_worker=True) as s:
        r = post(s, "/v1/completions", GREEDY)
        assert r.status_code == 200, r.text
        s.reference = r.json()["choices"][0]["text"]
        yield s


def post(srv, path, body, headers=AUTH):
    """`body` as JSON with ASCII escapes (so a lone surrogate travels as "\\ud800", as any JSON
    client would send it), or raw bytes (NaN, Infinity)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(srv.url + path, content=content, headers=dict(headers, **{"content-type": "application/json"}),
                      timeout=60)


def assert_whole(srv):
    """The server still serves: /health, the greedy reference text, every K/V block free."""
    h = srv.wait_idle()
    assert h["status"] == "ok" and h["requests_in_server"] == 0 and h["requests_in_engine"] == 0
    r = post(srv, "/v1/completions", GREEDY)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == srv.reference
    h = srv.wait_idle()
    assert h["kv_blocks"]["target"]["used"] == 0 and h["kv_blocks"]["draft"]["used"] == 0


def error(r, status, param="-") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "-":
        assert err["param"] == param, err
    return err


def counter(srv, name, outcome) -> float:
    for ln in httpx.get(srv.url + "/metrics").text.splitlines():
        if ln.startswith(name + "{") and f'outcome="{outcome}"' in ln:
            return float(ln.split()[-1])
    return 0.0


CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
SUR = "abc\ud800def"


def msgs(content):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4}


@pytest.mark.parametrize("path,body,status,param,text", [
    # sampling values that are 0 or inf in float32
    (CMPL, {"prompt": "x = 1\n", "max_tokens": 8, "temperature": 1e39, "min_tokens": 2}, 400, "temperature", "float32"),
    (CMPL, {"prompt": "x = 1\n", "max_tokens": 8, "repetition_penalty": 1e-50}, 400, "repetition_penalty", None),
    (CMPL, {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    (CMPL, b'{"prompt": "x", "logit_bias": {"5": NaN}}', 400, "logit_bias", None),
    (CMPL, b'{"prompt": "x", "temperature": NaN}', 400, "temperature", None),
    (CMPL, b'{"prompt": "x", "presence_penalty": Infinity}', 400, "presence_penalty", None),
    (CMPL, {"prompt": "x", "temperature": 10**400}, 422, "temperature", None),
    (CMPL, {"prompt": "x", "seed": 2**70}, 400, "seed", None),
    (CMPL, {"prompt": "x", "max_tokens": 10**20}, 400, "prompt", "maximum context length"),
    (CMPL, {"prompt": [10**12, 3]}, 400, "prompt", "outside the vocabulary"),
    (CMPL, {"prompt": [-1]}, 400, "prompt", "outside the vocabulary"),
    # text that is not valid Unicode
    (CMPL, {"prompt": SUR}, 400, "prompt", "lone surrogate \\ud800 at character 3"),
    (CMPL, {"prompt": ["ok", SUR]}, 400, "prompt", "prompt[1]"),
    (CMPL, {"prompt": "x", "stop": [SUR]}, 400, "stop", "stop[0]"),
    (CMPL, {"prompt": "x", "model": SUR}, 400, "model", None),
    (CHAT, msgs(SUR), 400, "messages", "messages[0].content"),
    (CHAT, msgs([{"type": "text", "text": SUR}]), 400, "messages", "messages[0].content[0].text"),
    # limits
    (CMPL, {"prompt": "x" * 5001}, 400, "prompt", "--max-prompt-chars"),
    (CMPL, {"prompt": ["x", "y" * 5001]}, 400, "prompt[1]", "--max-prompt-chars"),
    (CHAT, msgs("x" * 5001), 400, "messages", "--max-prompt-chars"),
    (CMPL, {"prompt": ["a"] * 5}, 400, "prompt", "--max-prompts"),
    (CMPL, {"prompt": "x", "n": 1000}, 400, "n", "--max-n"),
    (CHAT, dict(msgs("x"), n=1000), 400, "n", "--max-n"),
    (CMPL, {"prompt": ["a", "b", "c"], "n": 3}, 400, "n", "can never fit"),
    (CMPL, {"prompt": "x", "stop": ["s"] * 5}, 400, "stop", "--max-stop"),
    (CMPL, {"prompt": "x", "stop": "s" * 17}, 400, "stop", "--max-stop-chars"),
    (CHAT, dict(msgs("x"), stop=["s"] * 100_000), 413, None, "--max-request-bytes"),
    # malformed bodies
    (CMPL, {"prompt": "x", "temperature": "hot"}, 422, "temperature", None),
    (CMPL, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    # constraints over the size limit (checked before anything parses them)
    (CMPL, {"prompt": "x", "guided_regex": "a" * 40_000}, 400, "guided_regex", "--max-grammar-bytes"),
    (CHAT, dict(msgs("x"), response_format={"type": "json_schema", "json_schema": {"name": "big", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}}}),
     400, "response_format", "--max-grammar-bytes"),
    # chat messages the server cannot take
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", "unknown role 'wizard'"),
    (CHAT, msgs([{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]),
     400, "messages", "messages[0].content[1]: content parts of type 'image_url' are not supported"),
    (CHAT, msgs([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]), 400, "messages",
     "'input_audio'"),
    # tool calling the model cannot do, or asked for in a form the server does not take
    (CHAT, dict(msgs("x"), tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
     400, "tools", "does not render tools"),
    (CHAT, dict(msgs("x"), functions=[{"name": "f", "parameters": {"type": "object"}}]), 400, "functions", "tools"),
    (CHAT, dict(msgs("x"), tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="sometimes"),
     400, "tool_choice", None),
    (CHAT, dict(msgs("x"), tools="f"), 422, "tools", "valid list"),
    # speculation per request: invalid values
    (CMPL, {"prompt": "x", "speculation": {"max_draft": -1}}, 400, "speculation", "speculation.max_draft"),
    (CMPL, {"prompt": "x", "speculation": {"max_draft": 1.5}}, 400, "speculation", "speculation.max_draft"),
    (CMPL, {"prompt": "x", "speculation": {"enabled": "no"}}, 400, "speculation", "speculation.enabled"),
    (CMPL, {"prompt": "x", "speculation": {"enabled": False, "max_draft": 2}}, 400, "speculation", "enabled is false"),
    (CMPL, {"prompt": "x", "speculation": {"k": 2}}, 400, "speculation", "unknown field 'k'"),
    (CHAT, dict(msgs("x"), speculation="off"), 400, "speculation", "must be an object"),
])
def test_hostile_request(srv, path, body, status, param, text):
    before = counter(srv, "draftwise:requests_total", "rejected")
    err = error(post(srv, path, body), status, param)
    if text:
        assert text in err["message"], err
    assert counter(srv, "draftwise:requests_total", "rejected") == before + 1  # counted once
    assert_whole(srv)


def test_float32_zero_temperature_is_greedy(srv):
    """temperature 1e-50 (0 in float32) once made NaN logits and killed the streams beside it; now
    it samples greedily (below 1e-5, as vLLM): the same text as temperature 0."""
    for extra in ({"temperature": 1e-50}, {"temperature": 1e-50, "min_tokens": 3}, {"top_p": 1e-50, "seed": 3}):
        r = post(srv, CMPL, dict(GREEDY, **extra))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == srv.reference, (extra, r.text)
    assert_whole(srv)


def test_raw_bodies(srv):
    url = srv.url + CMPL
    h = dict(AUTH, **{"content-type": "application/json"})
    err = error(httpx.post(url, content=b'{"prompt": "x", "max_tokens": }', headers=h), 422, None)
    assert "not valid JSON" in err["message"] and "at character" in err["message"]
    err = error(httpx.post(url, content=b'{"prompt": "a\xff\xfeb"}', headers=h), 400, None)
    assert "not valid UTF-8 (byte 0xff at offset 13)" in err["message"]
    err = error(httpx.post(url, content=b"{" + b" " * 70_000 + b"}", headers=h), 413, None)
    assert "--max-request-bytes" in err["message"]

    def chunks():  # no Content-Length: counted while reading
        for _ in range(100):
            yield b" " * 1024

    error(httpx.post(url, content=chunks(), headers=h), 413, None)
    error(httpx.post(url, content=b"", headers=h), 422)
    assert_whole(srv)


def test_api_key(srv):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
        err = error(post(srv, CMPL, {"prompt": "x"}, headers=headers), 401, None)
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    assert error(httpx.get(srv.url + "/v1/models"), 401)
    assert httpx.get(srv.url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(srv.url + "/health").status_code == 200  # open
    assert httpx.get(srv.url + "/metrics").status_code == 200  # open
    assert_whole(srv)


def test_transient_overload_is_429_with_retry_after(srv):
    """8 long choices fill the server (4 running + 4 queued): a ninth is a 429 with Retry-After that
    goes once they leave; the long ones, cancelled by their clients, free everything."""
    long = {"prompt": "def", "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=60) as c:
            async def hold():
                async with c.stream("POST", CMPL, json=long) as r:
                    async for _ in r.aiter_lines():
                        pass

            tasks = [asyncio.create_task(hold()) for _ in range(MAX_NUM_SEQS + MAX_QUEUE)]
            deadline = time.time() + 20
            while (await c.get("/health")).json()["requests_in_server"] < 8:
                assert time.time() < deadline
                await asyncio.sleep(0.02)
            r = await c.post(CMPL, json={"prompt": "x", "max_tokens": 2})
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return r

    r = asyncio.run(run())
    err = error(r, 429, None)
    assert err["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"
    assert_whole(srv)


def test_metrics_count_each_request_once(srv):
    req = lambda o: counter(srv, "draftwise:requests_total", o)  # noqa: E731
    choice = lambda o: counter(srv, "draftwise:request_choices_total", o)  # noqa: E731
    before = req("length"), choice("length")
    r = post(srv, CMPL, {"prompt": "def", "n": 3, "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200
    assert (req("length"), choice("length")) == (before[0] + 1, before[1] + 3)
    body = {"prompt": "def", "n": 2, "max_tokens": 2, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url + CMPL, json=body, headers=AUTH, timeout=60) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert (req("length"), choice("length")) == (before[0] + 2, before[1] + 5)
    assert_whole(srv)


def test_health_answers_while_a_long_prompt_tokenizes(srv):
    """Tokenization runs off the event loop: /health, sent while prompts near the character limit
    are in flight, is answered, and those prompts are tokenized (then rejected for the context
    length). How fast /health answers meanwhile is a benchmark's question, not this test's."""
    async def run():
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=60) as c:
            big = [asyncio.create_task(c.post(CMPL, json={"prompt": ["a b c " * 833] * 4})) for _ in range(4)]
            h = await c.get("/health")
            return [await t for t in big], h

    rs, h = asyncio.run(run())
    assert h.status_code == 200
    assert all(r.status_code == 400 and "maximum context length" in r.json()["error"]["message"] for r in rs)
    assert_whole(srv)


def test_every_body_parse_failure_has_one_shape(srv):
    """Not JSON, JSON nested beyond the parser's depth, the wrong types: each a 422 in the OpenAI
    envelope with a code, and the server serves on."""
    deep = b'{"prompt": "x", "stop": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    readable = b'{"prompt": "x", "structured_outputs": {"json": ' + b"[" * 600 + b"]" * 600 + b"}}"  # json.loads can
    for body, code in ((b"prompt=x", "invalid_json"), (b'{"prompt": "x",', "invalid_json"), (deep, "invalid_json"),
                       (readable, "invalid_request_body"),
                       (b'{"prompt": {"a": 1}}', "invalid_request_body"), (b"[1, 2]", "invalid_request_body")):
        err = error(post(srv, CMPL, body), 422)
        assert err["code"] == code and err["type"] == "invalid_request_error", (body[:40], err)
    assert_whole(srv)


def test_models_retrieve(srv):
    """`GET /v1/models/{id}`: the model under its name, else a 404 in OpenAI's shape (the openai
    client's `models.retrieve`)."""
    import openai

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found" and "gpt-4" in e.value.body["message"]
    error(httpx.get(srv.url + "/v1/models/tiny"), 401)  # behind the API key like the rest of /v1


def nested_schema(depth: int) -> dict:
    """Objects nested `depth` deep: small, but xgrammar's parse time grows with the cube of the depth."""
    s = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


async def _greedy_stream(c) -> str:
    text = ""
    async with c.stream("POST", CMPL, json=dict(GREEDY, stream=True)) as r:
        async for ln in r.aiter_lines():
            if ln.startswith("data: {"):
                text += "".join(ch["text"] for ch in json.loads(ln[6:])["choices"])
    return text


def test_slow_compile_leaves_health_and_streams_alone(srv):
    """A constraint whose parse alone outlasts --grammar-compile-timeout (1 s here) compiles in the
    worker process: /health answers while it is in flight (and says so), four greedy streams beside
    it return their solo text, and the request gets a 400 naming the limit when the worker is
    stopped."""
    body = dict(msgs("x"), response_format={"type": "json_schema",
                                            "json_schema": {"name": "deep", "schema": nested_schema(400)}})

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=60) as c:
            slow = asyncio.create_task(c.post(CHAT, json=body))
            streams = [asyncio.create_task(_greedy_stream(c)) for _ in range(4)]
            seen = []
            while not slow.done():
                h = (await c.get("/health")).json()
                seen.append((h["grammar"]["compiling"], slow.done()))
                await asyncio.sleep(0.02)
            return await slow, await asyncio.gather(*streams), seen

    r, texts, seen = asyncio.run(run())
    assert any(compiling >= 1 and not done for compiling, done in seen), seen  # answered mid-compile
    err = error(r, 400, "response_format")
    assert "--grammar-compile-timeout" in err["message"] and err["code"] == "grammar_too_complex"
    assert texts == [srv.reference] * 4
    assert srv.health()["grammar"]["compiling"] == 0
    assert_whole(srv)


def test_same_constraint_compiles_once(srv):
    """Two requests with the same new constraint at once, then a third: one compile (and one run in
    the worker) for all three; an invalid one is answered from its first try."""
    body = {"prompt": "x", "max_tokens": 3, "temperature": 0, "guided_regex": "(yes|no)[0-9]{2}"}

    async def pair():
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=60) as c:
            return await asyncio.gather(c.post(CMPL, json=body), c.post(CMPL, json=body))

    before = srv.health()["grammar"]
    rs = list(asyncio.run(pair())) + [post(srv, CMPL, body)]
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    after = srv.health()["grammar"]
    assert after["compiled"] == before["compiled"] + 1 and after["probes"] == before["probes"] + 1
    assert after["cache_hits"] >= before["cache_hits"] + 2
    bad = {"prompt": "x", "guided_regex": "(unclosed"}
    for _ in range(2):
        error(post(srv, CMPL, bad), 400, "guided_regex")
    assert srv.health()["grammar"]["probes"] == after["probes"] + 1
    assert_whole(srv)


def test_speculation_off_or_capped_per_request(srv):
    """`speculation` per request on a speculative server (k=3): off proposes nothing while the
    neighbours in its batch go on speculating; a cap of 1 proposes at most one token a round; the
    greedy text is the same either way, and `draftwise` says what ran."""
    off, capped = dict(GREEDY, speculation={"enabled": False}), dict(GREEDY, speculation={"max_draft": 1})

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=60) as c:
            rs = await asyncio.gather(c.post(CMPL, json=off), c.post(CMPL, json=GREEDY), c.post(CMPL, json=capped),
                                      c.post(CMPL, json=GREEDY))
            chat = await c.post(CHAT, json=dict(msgs("hi"), temperature=0, speculation={"enabled": False}))
            return [r.json() for r in rs], chat.json()

    (r_off, r_on, r_cap, _), chat = asyncio.run(run())
    assert [r["choices"][0]["text"] for r in (r_off, r_on, r_cap)] == [srv.reference] * 3
    s_off, s_on, s_cap = (r["draftwise"] for r in (r_off, r_on, r_cap))
    assert (s_off["method"], s_off["k"], s_off["proposed_tokens"]) == ("none", 0, 0) and s_off["rounds"] > 0
    assert r_off["choices"][0]["draftwise"]["proposed_tokens"] == 0
    assert (s_on["method"], s_on["k"]) == ("draft", 3) and s_on["proposed_tokens"] > s_on["rounds"]
    assert s_cap["k"] == 1 and 0 < s_cap["proposed_tokens"] <= s_cap["rounds"]
    assert chat["draftwise"]["proposed_tokens"] == 0 and chat["draftwise"]["k"] == 0
    assert_whole(srv)


def test_stream_cut_at_shutdown_ends_with_an_error_then_done(target_dir, caplog):
    """A stream still open when the shutdown timeout runs out ends with an error event and
    `data: [DONE]`, a complete response (no "ASGI callable returned without completing response")."""
    engine = LLM(str(target_dir), multi_step=1).engine
    step = engine.step

    def slow_step():  # 200 tokens take seconds: the stream outlives the shutdown timeout
        time.sleep(0.02)
        return step()

    engine.step = slow_step
    server = ServerThread(engine)
    server.server.config.timeout_graceful_shutdown = 0.3
    body = {"prompt": "def", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with server, httpx.stream("POST", server.url + CMPL, json=body, timeout=60) as r:
        lines = []
        for ln in r.iter_lines():
            if ln.startswith("data: "):
                lines.append(ln)
                if len(lines) == 2:
                    server.server.should_exit = True  # as SIGTERM does
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][6:])["error"]
    assert err["code"] == "shutting_down" and "--shutdown-timeout" in err["message"]
    assert all("choices" in json.loads(ln[6:]) for ln in lines[:-2]) and len(lines) < 200
    assert "without completing response" not in caplog.text
