"""Constraints parsed and compiled in another process, under a time and a memory limit.

A thread cannot be stopped nor held to a memory budget: one constraint (a 1 MB JSON schema) once
took a server to 21 GB and the kernel killed it with every request in it. A process can. The
worker (`python -m draftwise.sampling.compile_worker`) imports xgrammar once (seconds: it pulls in
torch and transformers), then forks a child for each constraint: the child sets `RLIMIT_AS` to its
address space + the budget, parses and compiles, sends back how it went and exits; the worker
kills a child whose time is up. A bad constraint thus costs one child, never the worker nor the
server, and each compile starts from a clean copy of the worker (no heap left over).

`CompileWorker.probe` answers whether a constraint parses and compiles within the limits
(`Probe`), not the compiled grammar itself: xgrammar's `CompiledGrammar` crosses a process
boundary only as JSON (`serialize_json`), and for a 500-property schema that compiles in 0.05 s
the JSON is 80 MB, 3.2 s to write and 1.3 s plus 1.2 GB to read back. The caller compiles a
constraint that passed again in its own process (server/constraints.py; parse and compile
release the GIL), which costs what the probe cost and is bounded by it.

The worker and its children run at a lower CPU priority than the engine.
"""
from __future__ import annotations

import os
import pickle
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from .constraints import clean_error, parse_constraint

START_TIMEOUT_S = 300.0  # the worker imports torch: seconds on an idle machine, more on a busy one
REPLY_SLACK_S = 30.0  # beyond a probe's own limit, before the worker itself is taken for hung
NICE = 10
_HEADER = struct.Struct(">I")


@dataclass(frozen=True)
class Probe:
    """How a constraint's compile went in the worker: `reason` "ok", or why not: "invalid" (it
    does not parse: `message` says why), "timeout", "memory", or "crash" (the child died:
    `message` says how)."""

    reason: str
    message: str = ""
    seconds: float = 0.0  # parse + compile in the child (the time limit, for a timeout)
    compiled_bytes: int = 0  # CompiledGrammar.memory_size_bytes

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


# ---------------------------------------------------------------- messages (both sides)
def _send(f, obj) -> None:
    data = pickle.dumps(obj)
    f.write(_HEADER.pack(len(data)) + data)
    f.flush()


def _read_exact(f, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _recv(f):
    """One message; `f` unbuffered where it is also watched by select (buffered bytes are invisible to it)."""
    (n,) = _HEADER.unpack(_read_exact(f, _HEADER.size))
    return pickle.loads(_read_exact(f, n))


# ---------------------------------------------------------------- the worker process
def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _compile_one(compiler, kind: str, text: str, memory_bytes: int) -> tuple:
    """In the child: (reason, message, seconds, bytes) of one parse + compile under the budget."""
    resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + memory_bytes, resource.RLIM_INFINITY))
    t0 = time.perf_counter()
    try:
        compiled = compiler.compile_grammar(parse_constraint(kind, text, cached=False))
        return "ok", "", time.perf_counter() - t0, compiled.memory_size_bytes
    except MemoryError:
        return "memory", "", time.perf_counter() - t0, 0
    except (ValueError, RuntimeError) as e:  # xgrammar reports std::bad_alloc as a RuntimeError
        msg = str(e) if isinstance(e, ValueError) else clean_error(e)
        return ("memory" if "bad_alloc" in msg else "invalid"), msg, time.perf_counter() - t0, 0


def _fork_job(compiler, kind: str, text: str, memory_bytes: int) -> tuple[int, int]:
    """Fork a child that compiles and writes its result to a pipe; (pid, the pipe's read end)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing but the compile, then exit without cleanup
        try:
            os.close(r)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)  # the worker's pipes to the server stay the worker's
            os.dup2(null, 1)
            reply = _compile_one(compiler, kind, text, memory_bytes)
            os.write(w, pickle.dumps(reply))
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def _ended(pid: int, fd: int) -> tuple:
    """A child's result once its pipe is readable (it has written and exited, or died)."""
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    if chunks:
        return pickle.loads(b"".join(chunks))
    how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit code {os.WEXITSTATUS(status)}"
    return "crash", f"the compiler died ({how})", 0.0, 0


def _kill(pid: int, fd: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(fd)


def main() -> None:
    """The worker: reads (id, kind, text, memory_bytes, seconds) from stdin, answers (id, reply)."""
    os.nice(NICE)
    import xgrammar as xgr

    stdin, stdout = sys.stdin.buffer.raw, sys.stdout.buffer
    info = xgr.TokenizerInfo.deserialize_json(_recv(stdin))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _send(stdout, ("ready",))
    jobs: dict[int, tuple] = {}  # read end -> (id, pid, deadline, seconds)
    while True:
        now = time.monotonic()
        wait = max(0.0, min(j[2] for j in jobs.values()) - now) if jobs else None
        ready, _, _ = select.select([stdin, *jobs], [], [], wait)
        for fd in ready:
            if fd is stdin:
                try:
                    job_id, kind, text, memory_bytes, seconds = _recv(stdin)
                except EOFError:  # the server is gone
                    for r, (_, pid, _, _) in jobs.items():
                        _kill(pid, r)
                    return
                pid, r = _fork_job(compiler, kind, text, memory_bytes)
                jobs[r] = (job_id, pid, time.monotonic() + seconds, seconds)
            else:
                job_id, pid, _, _ = jobs.pop(fd)
                _send(stdout, (job_id, _ended(pid, fd)))
        now = time.monotonic()
        for r in [r for r, j in jobs.items() if j[2] <= now]:
            job_id, pid, _, seconds = jobs.pop(r)
            _kill(pid, r)
            _send(stdout, (job_id, ("timeout", "", seconds, 0)))


# ---------------------------------------------------------------- the server's side
class _Waiter:
    def __init__(self):
        self.done = threading.Event()
        self.reply: tuple | None = None


class CompileWorker:
    """The worker process (started on first use or by `start`, restarted if it dies); `probe` may
    be called from several threads at once (their compiles run side by side, each in a child)."""

    def __init__(self, tokenizer_info_json: str):
        self.info = tokenizer_info_json
        self.proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # start / send
        self._waiters: dict[int, _Waiter] = {}
        self._next_id = 0
        self._ready = threading.Event()

    def start(self) -> None:
        with self._lock:
            if self.proc is None or self.proc.poll() is not None:
                self._spawn()
        if not self._ready.wait(START_TIMEOUT_S):
            self.close()
            raise RuntimeError("the grammar compile worker did not start")

    def _spawn(self) -> None:
        self._ready = threading.Event()
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        _send(self.proc.stdin, self.info)
        threading.Thread(target=self._read, args=(self.proc, self._ready), name="draftwise-grammar-reader",
                         daemon=True).start()

    def _read(self, proc: subprocess.Popen, ready: threading.Event) -> None:
        """Hand each reply to its waiter; when the worker dies, every waiter gets a crash."""
        try:
            if _recv(proc.stdout) == ("ready",):
                ready.set()
            while True:
                job_id, reply = _recv(proc.stdout)
                w = self._waiters.pop(job_id, None)
                if w is not None:
                    w.reply = reply
                    w.done.set()
        except (EOFError, OSError, pickle.UnpicklingError):
            pass
        with self._lock:
            lost = [w for w in self._waiters.values() if not w.done.is_set()] if self.proc is proc else []
        for w in lost:
            w.reply = ("crash", f"the compile worker died (exit code {proc.poll()})", 0.0, 0)
            w.done.set()

    def probe(self, kind: str, text: str, seconds: float, memory_bytes: int) -> Probe:
        """Parse and compile (kind, text) in a child within `seconds` and `memory_bytes` (of
        address space beyond the worker's own)."""
        self.start()
        w = _Waiter()
        with self._lock:
            self._next_id += 1
            job_id = self._next_id
            self._waiters[job_id] = w
            try:
                _send(self.proc.stdin, (job_id, kind, text, memory_bytes, seconds))
            except OSError:
                w.reply = ("crash", "the compile worker is gone", 0.0, 0)
                w.done.set()
        if not w.done.wait(seconds + REPLY_SLACK_S):  # the worker itself hangs: replace it
            self.close()
            w.reply = ("timeout", "", seconds, 0)
        self._waiters.pop(job_id, None)
        return Probe(*w.reply)

    def close(self) -> None:
        with self._lock:
            proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                f.close()


_SHARED: dict[str, CompileWorker] = {}
_SHARED_LOCK = threading.Lock()


def shared_worker(tokenizer_info_json: str) -> CompileWorker:
    """One worker per tokenizer for the whole process (servers built one after another, as tests
    do, share it: it starts once). It ends with the process (its stdin closes)."""
    with _SHARED_LOCK:
        w = _SHARED.get(tokenizer_info_json)
        if w is None:
            w = _SHARED[tokenizer_info_json] = CompileWorker(tokenizer_info_json)
        return w


if __name__ == "__main__":
    main()
