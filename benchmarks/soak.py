"""Soak test of `draftwise serve`: minutes of mixed traffic against a loopback server.

    .venv/bin/python benchmarks/soak.py [--minutes 10] [--concurrency 32] [--threads 2]

Starts `draftwise serve` (the embedded pair, draft k = 4 unless told otherwise) on a free loopback
port, computes each greedy request's output alone (one request at a time), then runs
`--concurrency` closed-loop clients for `--minutes`:

- valid requests (completions streamed or not, chat; greedy, a few at temperature 1e-50 which is
  greedy in float32, and some sampled with a seed),
- `--cancel` of them cancelled by their client (a stream left after a few chunks, or a
  non-streamed request given up after a short wait),
- `--invalid` invalid requests (float32-invalid values, lone surrogates, n that can never fit,
  malformed JSON, too many stop strings, token ids outside the vocabulary), each of which must be
  a 4xx.

It checks: 0 lost responses (every valid request not cancelled answered in full), 0 corrupted
ones (every greedy completion equal to its solo output), every invalid request a 4xx, 0 leaked
K/V blocks once idle (/health), the server's RSS growth after warm-up below `--max-rss-growth`
(5%); prints a summary (and `--json PATH`) and exits 1 if a check failed. Loopback only; not a
test (it takes minutes).

Warm-up: the server's RSS grows while it meets new batch shapes; Python's own heap stays flat
(tracemalloc: a few KiB over 4 minutes). The growth is oneDNN's primitive cache (one compiled
primitive per new product shape, up to ONEDNN_PRIMITIVE_CACHE_CAPACITY = 1024 by default): two
in-process runs side by side (server and this client in one process, 3 minutes, 2 cores), RSS at
61 / 163 s: 1452 / 1592 MB by default, 1321 / 1363 MB with ONEDNN_PRIMITIVE_CACHE_CAPACITY=8.
The default warm-up is a fifth of the run, at least a minute; the summary lists RSS every 30 s.
The server inherits this process's environment (e.g. ONEDNN_PRIMITIVE_CACHE_CAPACITY).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from draftwise.lab.workload import load_workload  # noqa: E402

INVALID = [  # (path, body: dict | bytes); each must be answered 4xx
    ("/v1/completions", {"prompt": "x = 1\n", "temperature": 1e39, "min_tokens": 2}),
    ("/v1/completions", {"prompt": "x = 1\n", "repetition_penalty": 1e-50}),
    ("/v1/completions", {"prompt": "abc\ud800def"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \udc00"}]}),
    ("/v1/completions", {"prompt": "x", "n": 1000}),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": }'),
    ("/v1/completions", b'{"prompt": "a\xffb"}'),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 1000}),
    ("/v1/completions", {"prompt": [10**9, 1]}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
]


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    greedy_checked: int = 0
    corrupted: int = 0
    lost: int = 0
    cancelled: int = 0
    invalid_sent: int = 0
    invalid_4xx: int = 0
    invalid_wrong: int = 0
    examples: list = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.examples) < 10:
            self.examples.append(what)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def encode(body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()  # ASCII escapes: "\ud800" travels


async def request(c: httpx.AsyncClient, path: str, body, stream: bool, cancel_after: int | None):
    """(status, text, finish_reason, complete); cancel_after: leave after that many chunks."""
    headers = {"content-type": "application/json"}
    if not stream:
        r = await c.post(path, content=encode(body), headers=headers)
        if r.status_code != 200:
            return r.status_code, None, None, True
        ch = r.json()["choices"][0]
        text = ch["text"] if "text" in ch else ch["message"]["content"]
        return 200, text, ch["finish_reason"], True
    text, finish, done, chunks = "", None, False, 0
    body = dict(body, stream=True)
    async with c.stream("POST", path, content=encode(body), headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, None, None, True
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            obj = json.loads(line[6:])
            if "error" in obj:
                return 500, None, None, True
            for ch in obj.get("choices") or []:
                text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                finish = ch.get("finish_reason") or finish
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                return 200, text, None, False
    return 200, text, finish, done


async def soak(args, url: str, prompts: list[str], refs: dict, tally: Tally, deadline: float) -> None:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        async def worker(wid: int):
            r = random.Random(rng.random())
            while time.time() < deadline:
                tally.sent += 1
                u = r.random()
                if u < args.invalid:
                    path, body = r.choice(INVALID)
                    tally.invalid_sent += 1
                    try:
                        status = (await request(c, path, body, False, None))[0]
                    except httpx.HTTPError as e:
                        status = f"{type(e).__name__}"
                    if isinstance(status, int) and 400 <= status < 500:
                        tally.invalid_4xx += 1
                    else:
                        tally.invalid_wrong += 1
                        tally.note(f"invalid {body!r:.60} -> {status}")
                    continue
                cancel = u < args.invalid + args.cancel
                key = r.choice(list(refs))
                chat, pi, max_tokens = key
                body = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
                greedy = True
                v = r.random()
                if v < 0.05:
                    body["temperature"] = 1e-50  # greedy in float32 terms
                elif v < 0.2:
                    body.update(temperature=0.8, seed=r.randrange(1000))
                    greedy = False
                if chat:
                    body["messages"] = [{"role": "user", "content": prompts[pi]}]
                else:
                    body["prompt"] = prompts[pi]
                path = "/v1/chat/completions" if chat else "/v1/completions"
                stream = r.random() < 0.5 or cancel
                try:
                    if cancel and r.random() < 0.3:  # a non-streamed request given up
                        try:
                            await asyncio.wait_for(request(c, path, body, False, None), r.uniform(0.02, 0.3))
                        except asyncio.TimeoutError:
                            pass
                        tally.cancelled += 1
                        continue
                    status, text, finish, complete = await request(c, path, body, stream,
                                                                   r.randint(1, 4) if cancel else None)
                except httpx.HTTPError as e:
                    tally.lost += 1
                    tally.note(f"{path} {type(e).__name__}: {e}")
                    continue
                if cancel:
                    tally.cancelled += 1
                    continue
                if status != 200 or not complete or finish not in ("length", "stop"):
                    tally.lost += 1
                    tally.note(f"{path} status {status} complete {complete} finish {finish}")
                    continue
                tally.ok += 1
                if greedy:
                    tally.greedy_checked += 1
                    if text != refs[key]:
                        tally.corrupted += 1
                        tally.note(f"greedy mismatch {key}: {text[:40]!r} vs {refs[key][:40]!r}")

        await asyncio.gather(*(worker(i) for i in range(args.concurrency)))


async def solo_refs(url: str, prompts: list[str], lengths: list[int]) -> dict:
    refs = {}
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        for chat in (False, True):
            for pi, p in enumerate(prompts):
                for mt in lengths:
                    body = {"max_tokens": mt, "ignore_eos": True, "temperature": 0}
                    body.update({"messages": [{"role": "user", "content": p}]} if chat else {"prompt": p})
                    path = "/v1/chat/completions" if chat else "/v1/completions"
                    status, text, _, _ = await request(c, path, body, False, None)
                    assert status == 200, (path, status)
                    refs[(chat, pi, mt)] = text
    return refs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--warmup-minutes", type=float, default=None,
                    help="RSS baseline after this long (default: a fifth of --minutes, at least 1, at most half)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--cancel", type=float, default=0.10, help="fraction of requests cancelled by their client")
    ap.add_argument("--invalid", type=float, default=0.05, help="fraction of invalid requests")
    ap.add_argument("--prompts", type=int, default=12, help="distinct prompts (from the shipped workloads)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-rss-growth", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the summary to this file")
    ap.add_argument("serve_args", nargs="*", help="extra `draftwise serve` arguments (after --)")
    args = ap.parse_args()
    warmup = args.warmup_minutes if args.warmup_minutes is not None else min(args.minutes / 2, max(1.0, args.minutes / 5))

    prompts = []
    for name in ("code-easy", "grounded", "code-hard"):
        prompts += [r.prompt[-600:] for r in load_workload(name).requests[: args.prompts // 3 + 1]]
    prompts = prompts[: args.prompts]
    lengths = [16, 32]

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "draftwise.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--threads", str(args.threads), "--log-level", "warning", *args.serve_args]
    server = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    summary = {}
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.time() > deadline:
                raise SystemExit("soak: the server did not come up")
            time.sleep(0.2)
        t0 = time.time()
        refs = asyncio.run(solo_refs(url, prompts, lengths))
        print(f"soak: {len(refs)} solo references in {time.time() - t0:.1f} s; {args.minutes:g} min of traffic "
              f"at concurrency {args.concurrency} ({args.cancel:.0%} cancelled, {args.invalid:.0%} invalid)",
              file=sys.stderr, flush=True)

        tally = Tally()
        rss = []  # (seconds since start, bytes)
        start = time.time()
        stop = start + args.minutes * 60

        async def run():
            async def sample():
                while time.time() < stop:
                    rss.append((time.time() - start, rss_bytes(server.pid)))
                    await asyncio.sleep(5)

            sampler = asyncio.create_task(sample())
            await soak(args, url, prompts, refs, tally, stop)
            sampler.cancel()

        asyncio.run(run())
        wall = time.time() - start
        rss.append((wall, rss_bytes(server.pid)))
        h = {}
        for _ in range(200):  # idle: every block back
            h = httpx.get(url + "/health", timeout=10).json()
            if h["requests_in_server"] == 0 and h["requests_in_engine"] == 0:
                break
            time.sleep(0.1)
        leaked = {k: v["used"] for k, v in h["kv_blocks"].items() if v}
        after_warmup = [b for t, b in rss if t >= warmup * 60]
        base = after_warmup[0] if after_warmup else rss[0][1]
        growth = rss[-1][1] / base - 1
        summary = {
            "minutes": round(wall / 60, 2), "concurrency": args.concurrency, "requests": tally.sent,
            "completed": tally.ok, "greedy_checked": tally.greedy_checked, "corrupted": tally.corrupted,
            "lost": tally.lost, "cancelled": tally.cancelled, "invalid": tally.invalid_sent,
            "invalid_4xx": tally.invalid_4xx, "invalid_wrong": tally.invalid_wrong,
            "leaked_blocks": leaked, "requests_left": h["requests_in_server"] + h["requests_in_engine"],
            "rss_mb_first": round(rss[0][1] / 2**20, 1), "rss_mb_after_warmup": round(base / 2**20, 1),
            "rss_mb_end": round(rss[-1][1] / 2**20, 1), "rss_growth_after_warmup": round(growth, 4),
            "rss_mb_every_30s": [round(b / 2**20) for t, b in rss[::6]],
            "examples": tally.examples,
        }
        ok = (tally.corrupted == 0 and tally.lost == 0 and tally.invalid_wrong == 0 and not any(leaked.values())
              and summary["requests_left"] == 0 and growth < args.max_rss_growth and tally.ok > 0)
        summary["passed"] = ok
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            summary["server_exit"] = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            summary["server_exit"] = "killed"
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary.get("passed") and summary.get("server_exit") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
