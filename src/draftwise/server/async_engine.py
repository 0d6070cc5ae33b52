"""The engine in a background thread; each request is an asyncio queue of outputs.

`LLMEngine` is not thread-safe, so exactly one thread (the engine thread) touches it. The event
loop validates a request (the serving layer calls `check_request`, which only reads constants), then sends commands (add, abort)
through a thread-safe queue and wakes the thread. The thread drains the commands, runs one
`step()`, and hands every request's new output to its queue with one `call_soon_threadsafe` per
step. After each step it publishes a `Snapshot` (counters, queue lengths, KV blocks) that
`/health` and `/metrics` read without a lock.

Streaming text is held back while it could be the start of a stop string (the engine cuts a stop
string from the text once it is complete, so text already sent could not be taken back).

Failure isolation is the engine's (engine/isolation.py): a step returns the sequences it failed
like any other finished ones, with `seq.error` set; their streams end with the error (HTTP 500)
and the others go on. Should `step()` itself raise (a bug outside the isolated phases), every
sequence the engine holds is failed with the error (the running ones, or all if none runs) and the server keeps serving.
Shutdown: `shutdown()` lets the thread finish every in-flight request, then joins it.

Thread affinity: `draftwise serve` builds the engine (loads the weights) inside the same
`EngineThread` that later runs the loop. Tensors then live in that thread's allocator arena and
torch's intra-op (OpenMP) thread team belongs to it alone. Measured at 2 threads on the 2-core
machine (`benchmarks/serving_throughput.py --threads 2 --requests 8`, draft K = 4, concurrency 1):
an engine built in the main thread and stepped in this one served 73.5% of `LLM.generate`'s rate;
built in place, 98.4%.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field

from ..engine import LLMEngine
from ..engine.sequence import Sequence, Status, TokenLogprob
from ..sampling import SamplingParams
from .heap import HeapTrimmer

log = logging.getLogger("draftwise.server")


@dataclass
class RequestOutput:
    """One delivery to a request's stream: what was added since the previous one."""

    request_id: str
    token_ids: list[int]  # newly committed tokens
    text: str  # new text (may lag the tokens: incomplete characters, possible stop-string starts)
    logprobs: list[TokenLogprob] | None  # of the new tokens, when requested
    finished: bool
    finish_reason: str | None = None  # "stop", "length", "abort"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far
    stats: dict | None = None  # RequestStats.to_dict(), when finished
    error: str | None = None  # the engine failed on this request (answered with HTTP 500)
    ttft: float | None = None  # seconds from arrival in the engine to the first token, when finished
    e2e: float | None = None  # seconds from arrival in the engine to the end, when finished


class RequestStream:
    """The event-loop side of one engine request: iterate it to get its `RequestOutput`s.

    Several streams may share one queue (the choices of one HTTP request): the owner of the
    queue then reads it directly and tells outputs apart by `request_id`.
    """

    def __init__(self, request_id: str, queue: asyncio.Queue | None = None):
        self.request_id = request_id
        self.finished = False
        self.queue: asyncio.Queue[RequestOutput] = queue if queue is not None else asyncio.Queue()

    def put(self, out: RequestOutput) -> None:
        self.finished = self.finished or out.finished
        self.queue.put_nowait(out)

    async def __aiter__(self):
        while True:
            out = await self.queue.get()
            yield out
            if out.finished:
                return


@dataclass
class Snapshot:
    """Engine state as of the end of the last step, for /health and /metrics."""

    stats: dict = field(default_factory=dict)
    waiting: int = 0
    running: int = 0
    requests: int = 0  # sequences the engine still holds
    kv: dict = field(default_factory=dict)  # "target"/"draft" -> {"total", "used", "free"}


@dataclass
class _Tracked:
    seq: Sequence
    sent_tokens: int = 0
    sent_text: int = 0


def stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class EngineThread(threading.Thread):
    """One long-lived thread that runs the jobs given to it in order: `call(fn)` runs `fn` there
    and returns its result (or raises its exception) in the caller; the thread ends after a
    job submitted with `last=True`."""

    def __init__(self):
        super().__init__(name="draftwise-engine", daemon=True)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while True:
            fn, done, box, last = self._jobs.get()
            try:
                box.append(fn())
            except BaseException as e:  # handed back to the caller of call()
                box.append(e)
                box.append(None)
            done.set()
            if last:
                return

    def submit(self, fn, last: bool = False) -> tuple[threading.Event, list]:
        done, box = threading.Event(), []
        self._jobs.put((fn, done, box, last))
        return done, box

    def call(self, fn):
        done, box = self.submit(fn)
        done.wait()
        if len(box) == 2:
            raise box[0]
        return box[0]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int | None = None, thread: EngineThread | None = None,
                 heap_trim_interval_s: float = 10.0):
        self.engine = engine
        self.heap = HeapTrimmer(heap_trim_interval_s)  # freed memory back to the OS (server/heap.py)
        self.max_queue = max_queue
        self.outcomes: dict[str, int] = {}  # finished requests by outcome (event-loop side)
        self.on_finish: list = []  # callables(RequestOutput) run in the event loop (metrics)
        self.snapshot = Snapshot()
        self._streams: dict[str, RequestStream] = {}  # event-loop side
        self._tracked: dict[str, _Tracked] = {}  # engine-thread side
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._max_num_seqs = engine.config.max_num_seqs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = thread  # run the loop here (else a new thread)
        self._publish()

    # ------------------------------------------------------------ event-loop side
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if isinstance(self._thread, EngineThread):
            self._thread.submit(self._run, last=True)
        else:
            self._thread = threading.Thread(target=self._run, name="draftwise-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        """Finish every in-flight request, then stop the engine thread."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def num_in_flight(self) -> int:
        """Engine requests the server has accepted and not yet answered in full."""
        return len(self._streams)

    @property
    def num_queued(self) -> int:
        """Requests waiting to run: those beyond `max_num_seqs`, or the engine's waiting queue
        (requests held back for lack of KV blocks), whichever is larger."""
        return max(0, len(self._streams) - self._max_num_seqs, self.snapshot.waiting)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    sink: asyncio.Queue | None = None, compiled=None) -> RequestStream:
        """Enqueue one request the caller has validated (`LLMEngine.check_request`, done once per
        prompt by the serving layer before any choice is added) and fitted to the queue limit;
        `compiled`: its constraint's compiled grammar (the engine thread never compiles one)."""
        if self._stopping:
            raise RuntimeError("the server is shutting down")
        stream = RequestStream(request_id, sink)
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, list(prompt_ids), params, compiled))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        if request_id in self._streams:
            self._commands.put(("abort", request_id))
            self._wake.set()

    def record(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def _deliver(self, batch: list[RequestOutput]) -> None:
        for out in batch:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]
                self.record("error" if out.error else out.finish_reason or "unknown")
                for hook in self.on_finish:
                    hook(out)

    # ------------------------------------------------------------ engine-thread side
    def _run(self) -> None:
        eng = self.engine
        while True:
            batch = self._drain_commands()
            if eng.has_unfinished():
                batch += self._step()
            self._publish()
            self._send(batch)
            self.heap.maybe_trim()
            if eng.has_unfinished() or not self._commands.empty():
                continue
            if self._stopping:
                return
            self.heap.maybe_trim(idle=True)
            self._wake.wait()
            self._wake.clear()

    def _send(self, batch: list[RequestOutput]) -> None:
        if batch and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._deliver, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _drain_commands(self) -> list[RequestOutput]:
        out = []
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return out
            rid = cmd[1]
            if cmd[0] == "add":
                try:
                    seq = self.engine.add_request(rid, cmd[2], cmd[3], cmd[4])
                except Exception as e:  # validated already; a race or a bug: fail this request only
                    out.append(RequestOutput(rid, [], "", None, True, error=str(e)))
                    continue
                self._tracked[rid] = _Tracked(seq)
            elif cmd[0] == "abort" and rid in self._tracked:
                t = self._tracked.pop(rid)
                self.engine.abort(rid)
                out.append(self._output(t, finished=True, reason="abort"))

    def _step(self) -> list[RequestOutput]:
        try:
            outputs = self.engine.step()
        except Exception as e:  # outside the engine's isolated phases: fail the running sequences
            log.exception("engine step failed")
            message = f"internal error while generating: {type(e).__name__}: {e}"
            held = [t.seq for t in self._tracked.values()]
            victims = [seq for seq in held if seq.status is Status.RUNNING] or held
            outputs = [self.engine.fail(seq, message) for seq in victims]
        batch = []
        for o in outputs:
            t = self._tracked.get(o.seq.request_id)
            if t is None:
                continue
            out = self._output(t, finished=o.finished, reason=o.seq.finish_reason)
            if o.finished:
                del self._tracked[o.seq.request_id]
                self.engine.release(o.seq.request_id)
            batch.append(out)
        return batch

    def _output(self, t: _Tracked, finished: bool, reason: str | None) -> RequestOutput:
        seq = t.seq
        text = seq.text
        end = len(text)
        if not finished and seq.params.stop:
            end -= stop_holdback(text, seq.params.stop)
        new_text = text[t.sent_text : end] if end > t.sent_text else ""
        t.sent_text = max(t.sent_text, end)
        n = len(seq.output_ids)
        new_ids = seq.output_ids[t.sent_tokens : n]
        lps = seq.logprobs[t.sent_tokens : n] if seq.logprobs is not None else None
        t.sent_tokens = n
        out = RequestOutput(
            seq.request_id, new_ids, new_text, lps, finished, reason if finished else None,
            num_prompt_tokens=len(seq.prompt_ids), num_output_tokens=n,
            stats=seq.stats.to_dict() if finished else None, error=seq.error if finished else None,
        )
        if finished:
            if seq.first_token_time is not None:
                out.ttft = seq.first_token_time - seq.arrival_time
            out.e2e = (seq.finish_time or seq.first_token_time or seq.arrival_time) - seq.arrival_time
        return out

    def _publish(self) -> None:
        eng = self.engine
        occ = eng.occupancy()
        self.snapshot = Snapshot(stats=eng.stats.snapshot(), waiting=occ["waiting"], running=occ["running"],
                                 requests=occ["requests"], kv=occ["kv"])

    # ------------------------------------------------------------ event-loop side (shutdown)
    def abort_all(self, reason: str) -> int:
        """Abort every request the server still holds (e.g. shutdown past its bound); returns how many."""
        ids = list(self._streams)
        for rid in ids:
            self.abort(rid)
        if ids:
            log.warning("aborting %d request(s): %s", len(ids), reason)
        return len(ids)
