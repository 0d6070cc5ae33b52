"""Backends that replay a workload at one load level and return what the client saw.

- `EngineBackend`: the embedded engine in-process, driven step by step. Every `StepOutput`'s new
  tokens are timestamped when the step returns; tokens committed by one speculative round arrive
  together (one delivery). Speculation counters come from the engine's `EngineStats`. `steps` is
  the run as a generator over engine steps, timed by a clock it is given: several runs can so
  share the CPU in slices (timeslice.py), each on its own clock.
- `HTTPBackend`: any OpenAI-compatible server (`/v1/completions`, streaming), e.g. `draftwise
  serve`, vLLM or SGLang. Speculation counters are read from `/metrics` before and after the run
  when the server exposes them: draftwise's `draftwise:*` or vLLM's `vllm:spec_decode_*`.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generator

import httpx

from ..sampling import SamplingParams
from .arrivals import LoadLevel, arrival_times
from .metrics import RequestRecord, stats_delta
from .timeslice import WallClock, drain
from .workload import Request


@dataclass
class RunOutput:
    records: list[RequestRecord]
    wall: float
    engine_stats: dict = field(default_factory=dict)  # EngineStats-shaped delta ({} if unknown)


def sampling_params(req: Request, seed: int, max_tokens: int | None = None, ignore_eos: bool = True) -> SamplingParams:
    """The same params for every config: fixed length (EOS ignored; `ignore_eos=False`: the reply
    ends where the model ends it, the same length for every config of a greedy request), a
    per-request seed."""
    return SamplingParams(temperature=req.temperature, max_tokens=max_tokens or req.max_tokens,
                          seed=seed if req.temperature > 0 else None, ignore_eos=ignore_eos,
                          structured_output=req.structured_output)


class EngineBackend:
    name = "in-process"

    def __init__(self, engine):
        self.engine = engine
        self._runs = 0

    def run(self, requests: list[Request], prompts: list[list[int]], params: list[SamplingParams],
            level: LoadLevel, seed: int = 0, on_done: Callable[[], None] | None = None) -> RunOutput:
        """One run alone, on the wall clock."""
        return drain(self.steps(requests, prompts, params, level, seed, on_done, WallClock()))

    def steps(self, requests: list[Request], prompts: list[list[int]], params: list[SamplingParams],
              level: LoadLevel, seed: int = 0, on_done: Callable[[], None] | None = None,
              clock=None) -> Generator[None, None, RunOutput]:
        """The run as a generator that yields after every engine step (and every idle wait) and
        returns its `RunOutput`; every time is read from `clock` (timeslice.py: a `SliceClock`
        lets several runs share the CPU, each timed by its own slices)."""
        clock = clock or WallClock()
        eng = self.engine
        self._runs += 1
        tag = f"run{self._runs}"
        n = len(requests)
        offsets = arrival_times(n, level.value, level.burstiness, seed) if level.kind == "rate" else None
        records: dict[str, RequestRecord] = {}
        pending = deque(range(n))
        before = eng.stats.snapshot()
        t0 = clock.now()
        last = t0

        inflight = 0

        def admit(i: int, arrival: float) -> None:
            nonlocal inflight
            rid = f"{tag}-{i}"
            eng.add_request(rid, prompts[i], params[i])
            records[rid] = RequestRecord(requests[i].id, arrival, prompt_tokens=len(prompts[i]))
            inflight += 1

        while pending or eng.has_unfinished():
            now = clock.now()
            if offsets is None:
                while pending and inflight < level.value:
                    admit(pending.popleft(), now)
            else:
                while pending and t0 + offsets[pending[0]] <= now:
                    i = pending.popleft()
                    admit(i, t0 + offsets[i])
                if not eng.has_unfinished():
                    clock.wait_until(t0 + offsets[pending[0]])
                    yield
                    continue
            outs = eng.step()
            t = clock.now()
            for o in outs:
                rec = records[o.seq.request_id]
                if o.new_token_ids:
                    rec.deliveries.append((t, len(o.new_token_ids)))
                if o.finished:
                    seq = o.seq
                    rec.token_ids = list(seq.output_ids)
                    rec.text = seq.text
                    rec.finish_reason = seq.finish_reason
                    rec.committed_per_round = list(seq.stats.committed_per_round)
                    eng.release(seq.request_id)
                    inflight -= 1
                    last = t
                    if on_done:
                        on_done()
            yield
        ordered = [records[f"{tag}-{i}"] for i in range(n)]
        return RunOutput(ordered, last - t0, stats_delta(before, eng.stats.snapshot()))


# ------------------------------------------------------------------------------------- HTTP
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_prometheus(text: str, prefixes=("draftwise:", "vllm:spec_decode")) -> dict[tuple, float]:
    """{(name, ((label, value), ...)): value} for samples whose name starts with a prefix."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m or not m.group(1).startswith(prefixes):
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            continue
    return out


# counter names (as scraped, with `_total`) of the same quantities in draftwise and vLLM
SPEC_COUNTERS = {
    "rounds": ("draftwise:spec_decode_num_rounds_total", "vllm:spec_decode_num_drafts_total"),
    "draft_tokens": ("draftwise:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
    "accepted_tokens": ("draftwise:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"),
}
PER_POSITION = ("draftwise:spec_decode_num_accepted_tokens_per_pos_total",
                "vllm:spec_decode_num_accepted_tokens_per_pos_total")
PHASE_SECONDS = "draftwise:step_seconds_total"  # label phase = propose | verify | other
COMMITTED_HIST = "draftwise:spec_decode_committed_per_round_bucket"  # cumulative, label le


def spec_stats_from_metrics(before: dict, after: dict) -> dict:
    """An EngineStats-shaped delta from two scrapes ({} when the server exposes no counters)."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}

    def by(name: str, label: str | None = None) -> dict:
        """Sum over every other label, keyed by `label`'s value (or None)."""
        out = {}
        for (n, labels), v in delta.items():
            if n == name:
                key = dict(labels).get(label) if label else None
                out[key] = out.get(key, 0.0) + v
        return out

    found = {key: next((by(n)[None] for n in names if by(n)), None) for key, names in SPEC_COUNTERS.items()}
    if found["rounds"] is None or found["accepted_tokens"] is None:
        return {}
    out = {k: int(v or 0) for k, v in found.items()}
    out["committed_tokens"] = out["rounds"] + out["accepted_tokens"]  # accepted + one recovered/bonus per round
    for name in PER_POSITION:
        pos = by(name, "position")
        if pos:
            out["accepted_per_position"] = [int(pos[p]) for p in sorted(pos, key=int)]
    phases = by(PHASE_SECONDS, "phase")
    for phase in ("propose", "verify", "other"):
        if phase in phases:
            out[f"{phase}_seconds"] = phases[phase]
    cum = {float(le): v for le, v in by(COMMITTED_HIST, "le").items() if le not in (None, "+Inf")}
    prev, hist = 0.0, {}
    for le in sorted(cum):
        if cum[le] - prev:
            hist[int(le)] = int(cum[le] - prev)
        prev = cum[le]
    if hist:
        out["committed_per_round"] = hist
    return out


class HTTPBackend:
    """Streams `/v1/completions` (`/v1/chat/completions` for a chat request) from an
    OpenAI-compatible server at `url`."""

    name = "http"

    def __init__(self, url: str, model: str | None = None, timeout: float = 600.0):
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        self.timeout = timeout
        with httpx.Client(timeout=30.0) as c:
            if model is None:
                r = c.get(f"{self.url}/v1/models")
                r.raise_for_status()
                data = r.json().get("data") or []
                if not data:
                    raise ValueError(f"{self.url}/v1/models lists no model; pass --served-model")
                model = data[0]["id"]
        self.model = model

    def scrape(self) -> dict:
        try:
            r = httpx.get(f"{self.url}/metrics", timeout=10.0)
            return parse_prometheus(r.text) if r.status_code == 200 else {}
        except httpx.HTTPError:
            return {}

    def run(self, requests, prompts, params, level: LoadLevel, seed: int = 0, on_done=None) -> RunOutput:
        before = self.scrape()
        records, wall = asyncio.run(self._run(requests, params, level, seed, on_done))
        return RunOutput(records, wall, spec_stats_from_metrics(before, self.scrape()))

    async def _run(self, requests, params, level, seed, on_done):
        n = len(requests)
        records = [RequestRecord(r.id, 0.0) for r in requests]
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits) as client:
            t0 = time.perf_counter()

            async def one(i: int, arrival: float) -> None:
                await self._stream(client, requests[i], params[i], records[i], arrival)
                if on_done:
                    on_done()

            if level.kind == "concurrency":
                queue = deque(range(n))

                async def worker():
                    while queue:
                        await one(queue.popleft(), time.perf_counter())

                await asyncio.gather(*(worker() for _ in range(int(level.value))))
            else:
                offsets = arrival_times(n, level.value, level.burstiness, seed)

                async def delayed(i):
                    await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
                    await one(i, t0 + offsets[i])

                await asyncio.gather(*(delayed(i) for i in range(n)))
        last = max((r.deliveries[-1][0] for r in records if r.deliveries), default=t0)
        return records, last - t0

    async def _stream(self, client, req: Request, p: SamplingParams, rec: RequestRecord, arrival: float) -> None:
        rec.arrival = arrival
        body = {"model": self.model, "max_tokens": p.max_tokens, "temperature": p.temperature,
                "stream": True, "ignore_eos": p.ignore_eos, "stream_options": {"include_usage": True}}
        if req.messages:  # the chunk's token list gives tokens per delivery
            body.update(messages=req.message_dicts, logprobs=True, top_logprobs=0)
        else:
            body.update(prompt=req.prompt, logprobs=0)
        route = "chat/completions" if req.messages else "completions"
        if p.seed is not None:
            body["seed"] = p.seed
        if p.structured_output:  # vLLM's structured_outputs names a JSON schema "json"
            (kind, value), = p.structured_output.items()
            body["structured_outputs"] = {"json" if kind == "json_schema" else kind: value}
        usage_tokens = None
        try:
            async with client.stream("POST", f"{self.url}/v1/{route}", json=body) as resp:
                if resp.status_code != 200:
                    rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    t = time.perf_counter()
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"].get("completion_tokens")
                    for ch in chunk.get("choices") or []:
                        text = ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                        lp = ch.get("logprobs") or {}
                        tokens = lp.get("tokens") or [c.get("token", "") for c in lp.get("content") or []]
                        rec.token_texts += tokens
                        ntok = len(tokens) or (1 if text else 0)
                        if ntok:
                            rec.deliveries.append((t, ntok))
                            rec.text += text
                        if ch.get("finish_reason"):
                            rec.finish_reason = ch["finish_reason"]
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            rec.error = f"{type(e).__name__}: {e}"
            return
        if usage_tokens is not None and rec.deliveries:  # chunks may carry several tokens each
            extra = usage_tokens - rec.output_tokens
            if extra > 0:
                t, k = rec.deliveries[-1]
                rec.deliveries[-1] = (t, k + extra)
