"""Load: 64 concurrent streams finish with exactly max_tokens tokens while 10 others are cancelled
mid-stream; afterwards no request is left anywhere and every KV block (target and draft) is free."""
import asyncio
import json

import httpx

from draftwise import LLM, SpecConfig
from server_harness import ServerThread

N_OK, N_CANCEL, MAX = 64, 10, 24


async def _stream(client, url, i, max_tokens, cancel_after=None):
    body = {"model": "tiny", "prompt": [1 + i % 50, 2 + i % 7, 3], "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.8, "seed": i, "stream": True, "logprobs": 0, "stream_options": {"include_usage": True}}
    tokens, usage, done, chunks = 0, None, False, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            if obj["choices"]:
                tokens += len(obj["choices"][0]["logprobs"]["tokens"])
                chunks += 1
            else:
                usage = obj["usage"]
            if cancel_after is not None and chunks >= cancel_after:
                return None  # leaving the context closes the connection mid-stream
    return tokens, usage, done


async def _load(url):
    limits = httpx.Limits(max_connections=N_OK + N_CANCEL + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        ok = [_stream(client, url, i, MAX) for i in range(N_OK)]
        cancel = [_stream(client, url, 100 + i, 200, cancel_after=2) for i in range(N_CANCEL)]
        return await asyncio.gather(*ok, *cancel)


def test_64_streams_and_10_cancellations(target_dir, draft_dir):
    engine = LLM(str(target_dir), draft=str(draft_dir), spec=SpecConfig(method="draft", k=4)).engine
    with ServerThread(engine) as srv:
        results = asyncio.run(_load(srv.url))
        for tokens, usage, done in results[:N_OK]:
            assert done and tokens == MAX and usage["completion_tokens"] == MAX
        assert all(r is None for r in results[N_OK:])
        h = srv.wait_idle()
        assert h["requests_in_server"] == 0 and h["requests_in_engine"] == 0
        assert h["waiting"] == 0 and h["running"] == 0
        for which in ("target", "draft"):
            assert h["kv_blocks"][which]["used"] == 0
            assert h["kv_blocks"][which]["free"] == h["kv_blocks"][which]["total"]
        assert not engine.seqs and not engine.runner.kv.tables and not engine.proposer.kv.tables
        metrics = httpx.get(srv.url + "/metrics").text
        assert f'draftwise:requests_total{{model_name="tiny",outcome="length"}} {float(N_OK)}' in metrics
        assert f'draftwise:requests_total{{model_name="tiny",outcome="abort"}} {float(N_CANCEL)}' in metrics
