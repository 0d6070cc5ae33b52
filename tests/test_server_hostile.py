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
                      max_stop_chars=16)
MAX_NUM_SEQS, MAX_QUEUE = 4, 4  # the server holds 8 choices at once
GREEDY = {"prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv(target_dir, draft_dir):
    engine = LLM(str(target_dir), draft=str(draft_dir), spec=SpecConfig(method="draft", k=3),
                 max_num_seqs=MAX_NUM_SEQS).engine
    with ServerThread(engine, max_queue=MAX_QUEUE, limits=LIMITS, api_key=KEY) as s:
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
