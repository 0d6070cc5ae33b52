"""Liveness while a server compiles hostile constraints: `draftwise serve` (the embedded models)
gets a 1 MB JSON schema and a 20,000-option guided_choice while /health is polled every 20 ms
and 4 greedy streams run side by side. Prints one JSON object: the two answers, the slowest
/health, whether every stream gave its solo text, and the server's peak RSS against its steady
state (its compile worker's, apart).

    python benchmarks/grammar_liveness.py [-- extra serve flags, e.g. --max-grammar-bytes 4194304]
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import httpx

PORT = 8931
URL = f"http://127.0.0.1:{PORT}"
CONTROL_S = 20.0  # the same polling and streams without the constraints, first
STREAM = {"prompt": "def fibonacci(n):", "max_tokens": 96, "temperature": 0, "ignore_eos": True}


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return 0.0


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    kids = [int(p) for p in out]
    return kids + [d for k in kids for d in descendants(k)]


def big_schema() -> dict:
    props = {f"field_{i}": {"type": "string", "description": "x" * 20} for i in range(12_000)}
    return {"type": "object", "properties": props, "required": list(props)}


async def stream_text(c: httpx.AsyncClient) -> str:
    text = ""
    async with c.stream("POST", "/v1/completions", json=dict(STREAM, stream=True)) as r:
        async for ln in r.aiter_lines():
            if ln.startswith("data: {"):
                text += "".join(ch.get("text", "") for ch in json.loads(ln[6:])["choices"])
    return text


async def run(pid: int) -> dict:
    async with httpx.AsyncClient(base_url=URL, timeout=600) as c:
        solo = (await c.post("/v1/completions", json=STREAM)).json()["choices"][0]["text"]
        await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "guided_regex": "[a-z]+"})  # warm
        steady = rss_mib(pid)
        schema = {"prompt": "Describe:", "max_tokens": 8,
                  "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": big_schema()}}}
        choice = {"prompt": "Pick:", "max_tokens": 8, "guided_choice": [f"option number {i}" for i in range(20_000)]}
        peaks = {"server": steady, "worker": 0.0}
        done = threading.Event()

        def watch():  # RSS every 20 ms: the server, and its compile worker with its children
            while not done.is_set():
                peaks["server"] = max(peaks["server"], rss_mib(pid))
                peaks["worker"] = max(peaks["worker"], sum(rss_mib(p) for p in descendants(pid)))
                time.sleep(0.02)

        threading.Thread(target=watch, daemon=True).start()
        control = await phase(c, solo, [asyncio.create_task(asyncio.sleep(CONTROL_S))])
        t0 = time.perf_counter()
        heavy = [asyncio.create_task(c.post("/v1/completions", json=b)) for b in (schema, choice)]
        loaded = await phase(c, solo, heavy)
        answers = [await t for t in heavy]
        done.set()
        return {
            "seconds": round(time.perf_counter() - t0, 1),
            "answers": [(r.status_code, r.json().get("error", {}).get("message", "ok")[:160]) for r in answers],
            "with_constraints": loaded, "control_without": control,
            "rss_steady_mib": round(steady), "rss_peak_mib": round(peaks["server"]),
            "worker_rss_peak_mib": round(peaks["worker"]),
        }


async def phase(c: httpx.AsyncClient, solo: str, until: list[asyncio.Task]) -> dict:
    """/health every 20 ms and rounds of 4 greedy streams until every task in `until` is done."""
    health, texts, streaming = [], [], [True]

    async def poll():  # until the last round of streams is over too
        while streaming[0]:
            s = time.perf_counter()
            assert (await c.get("/health")).status_code == 200
            health.append(time.perf_counter() - s)
            await asyncio.sleep(0.02)

    async def streams():
        while not all(t.done() for t in until):
            texts.extend(await asyncio.gather(*(stream_text(c) for _ in range(4))))
        streaming[0] = False

    await asyncio.gather(poll(), streams())
    health.sort()
    return {"health_polls": len(health), "health_max_ms": round(1000 * health[-1], 1),
            "health_p50_ms": round(1000 * health[len(health) // 2], 1),
            "health_p99_ms": round(1000 * health[int(0.99 * (len(health) - 1))], 1),
            "streams": len(texts), "streams_equal_solo": all(t == solo for t in texts),
            "load_average": os.getloadavg()[0]}


def main() -> None:
    extra = sys.argv[1:]
    cmd = [sys.executable, "-m", "draftwise.cli.main", "serve", "--port", str(PORT), "--log-level", "warning", *extra]
    server = subprocess.Popen(cmd)
    try:
        deadline = time.time() + 300
        while True:
            try:
                if httpx.get(URL + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        result = asyncio.run(run(server.pid))
        result["serve_flags"] = extra
        result["cpu"] = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
        result["cpus"] = os.cpu_count()
        print(json.dumps(result))
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
