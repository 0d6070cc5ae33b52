"""Error cases answer their status with the OpenAI envelope; failures and disconnects free everything."""
import asyncio
import time

import httpx
import pytest

from draftwise import LLM, SpecConfig
from server_harness import ServerThread

POISON = 7  # a prompt starting with this token makes the engine's verification raise (see below)
SLOW = 8  # ... and with this one, each verification of its batch takes 10 ms longer


@pytest.fixture(scope="module")
def srv(target_dir, draft_dir):
    engine = LLM(str(target_dir), draft=str(draft_dir), spec=SpecConfig(method="draft", k=3)).engine
    real_verify = engine.verify

    def verify(scheduled, blocks):  # failure injection: one request's step raises
        if any(s.seq.prompt_ids[0] == POISON for s in scheduled):
            raise RuntimeError("injected failure")
        if any(s.seq.prompt_ids[0] == SLOW for s in scheduled):
            time.sleep(0.01)
        return real_verify(scheduled, blocks)

    engine.verify = verify
    with ServerThread(engine, max_queue=2) as s:
        yield s


def post(srv, path, body, **kw):
    return httpx.post(srv.url + path, json=body, timeout=60, **kw)


def envelope(r, status, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize("body,param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"logprobs": 50}, "logprobs"),
    ({"min_tokens": 20, "max_tokens": 4}, "min_tokens"),
])
def test_invalid_sampling_values_400(srv, body, param):
    err = envelope(post(srv, "/v1/completions", {"prompt": "def", **body}), 400, param)
    assert param in err["message"]


def test_chat_invalid_values_400(srv):
    envelope(post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                 "top_logprobs": 2}), 400, "top_logprobs")
    envelope(post(srv, "/v1/chat/completions", {"messages": []}), 400, "messages")


def test_context_length_400(srv):
    err = envelope(post(srv, "/v1/completions", {"prompt": "def add", "max_tokens": 1000}), 400)
    assert err["message"].startswith("This model's maximum context length is 256 tokens; you requested")
    assert err["code"] == "context_length_exceeded"
    msgs = [{"role": "user", "content": "x " * 300}]
    err = envelope(post(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 5}), 400, "messages")
    assert "maximum context length" in err["message"]


def test_unknown_model_404(srv):
    err = envelope(post(srv, "/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404, "model")
    assert "gpt-4" in err["message"]
    envelope(post(srv, "/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}),
             404, "model")


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 3}, "prompt"),  # prompt missing
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": "x", "stream": "maybe"}, "stream"),
])
def test_malformed_body_422(srv, body, param):
    envelope(post(srv, "/v1/completions", body), 422, param)


def test_not_json_422(srv):
    r = httpx.post(srv.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    envelope(r, 422)


def test_never_fits_is_400_not_429(srv):
    # max_queue=2: on an idle server, choices up to max_num_seqs + 2 fit; more can never fit (400, not
    # a 429 that clients retry). The transient 429 (with Retry-After): tests/test_server_hostile.py.
    cap = srv.engine.engine.config.max_num_seqs + 2
    err = envelope(post(srv, "/v1/completions", {"prompt": ["def", "x"], "n": cap // 2 + 1, "max_tokens": 2}), 400, "n")
    assert "can never fit" in err["message"]
    assert post(srv, "/v1/completions", {"prompt": "def", "n": 3, "max_tokens": 2}).status_code == 200


def test_failure_in_one_request_is_500_and_server_keeps_serving(srv):
    err = envelope(post(srv, "/v1/completions", {"prompt": [POISON, 3, 4], "max_tokens": 5}), 500)
    assert "injected failure" in err["message"]
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": [POISON, 3], "stream": True}, timeout=60)
    envelope(r, 500)
    r = post(srv, "/v1/completions", {"prompt": [5, 3, 4], "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    h = srv.wait_idle()
    assert h["requests_in_engine"] == 0 and h["kv_blocks"]["target"]["used"] == 0
    assert h["kv_blocks"]["draft"]["used"] == 0
    assert 'outcome="error"' in httpx.get(srv.url + "/metrics").text


def test_disconnect_aborts_and_frees_blocks(srv):
    def aborted():
        for ln in httpx.get(srv.url + "/metrics").text.splitlines():
            if ln.startswith("draftwise:requests_total") and 'outcome="abort"' in ln:
                return float(ln.split()[-1])
        return 0.0

    before = aborted()
    body = {"prompt": [SLOW, 3], "max_tokens": 250, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    with pytest.raises(httpx.ReadTimeout):  # streaming, leaving after the first chunk
        with httpx.stream("POST", srv.url + "/v1/completions", json=dict(body, stream=True),
                          timeout=httpx.Timeout(60, read=0.3)) as r:
            for _ in r.iter_lines():
                raise httpx.ReadTimeout("leave")
    deadline = time.time() + 20
    while aborted() < before + 2 and time.time() < deadline:
        time.sleep(0.05)
    assert aborted() == before + 2
    h = srv.wait_idle()
    assert h["requests_in_server"] == 0 and h["requests_in_engine"] == 0
    assert h["kv_blocks"]["target"]["used"] == 0 and h["kv_blocks"]["draft"]["used"] == 0


def test_failure_among_others_fails_only_that_request(srv):
    """Four greedy requests decode together; a fifth, failing one joins them: only it gets the 500,
    the others (requeued and re-admitted one by one to find the culprit) finish unchanged."""
    bodies = [{"prompt": [SLOW if i == 0 else 20 + i, 3, 4, 5], "max_tokens": 60, "ignore_eos": True,
               "temperature": 0} for i in range(4)]

    async def run(with_poison: bool):
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            tasks = [asyncio.create_task(c.post("/v1/completions", json=b)) for b in bodies]
            bad = None
            if with_poison:
                await asyncio.sleep(0.3)  # the four are decoding by now
                bad = await c.post("/v1/completions", json={"prompt": [POISON, 1], "max_tokens": 5})
            return [await t for t in tasks], bad

    want, _ = asyncio.run(run(False))
    got, bad = asyncio.run(run(True))
    envelope(bad, 500)
    assert [r.status_code for r in got] == [200] * 4
    assert [r.json()["choices"][0]["text"] for r in got] == [r.json()["choices"][0]["text"] for r in want]
    assert all(r.json()["usage"]["completion_tokens"] == 60 for r in got)
    h = srv.wait_idle()
    assert h["kv_blocks"]["target"]["used"] == 0 and h["kv_blocks"]["draft"]["used"] == 0
    assert srv.engine.engine.scheduler.admission_limit is None  # isolation over
