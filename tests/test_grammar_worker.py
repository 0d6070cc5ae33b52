"""The constraint compile worker (sampling/compile_worker.py): each constraint parsed and compiled
in a child process under a time and a memory limit; a child over either is stopped, the worker
goes on. And the in-process cache (sampling/constraints.py): one compile per constraint."""
import json
import threading

import pytest

from draftwise.sampling.compile_worker import shared_worker
from draftwise.sampling.constraints import Compiler, compiler_for

MIB = 2**20


@pytest.fixture(scope="module")
def worker(tokenizer):
    w = shared_worker(compiler_for(tokenizer, 320, [0]).info.serialize_json())
    w.start()
    return w


def choice(n: int) -> str:
    return "root ::= " + " | ".join(json.dumps(f"option number {i}") for i in range(n))


def test_a_probe_says_ok_invalid_or_over_memory(worker):
    ok = worker.probe("regex", "[a-z]{2,4}", 10, 256 * MIB)
    assert ok.ok and ok.compiled_bytes > 0
    bad = worker.probe("regex", "(ab", 10, 256 * MIB)
    assert bad.reason == "invalid" and "structured_output.regex is invalid" in bad.message
    assert worker.probe("choice", choice(2000), 10, 4 * MIB).reason == "memory"  # needs ~10 MiB
    assert worker.probe("choice", choice(2000), 10, 256 * MIB).ok


def test_a_probe_past_its_time_is_stopped_and_the_worker_goes_on(worker):
    s = {"type": "string"}
    for _ in range(400):  # parses for minutes (cubic in the depth)
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    pid = worker.proc.pid
    results = {}

    def slow():
        results["slow"] = worker.probe("json_schema", json.dumps(s), 1, 256 * MIB)

    t = threading.Thread(target=slow)
    t.start()
    results["fast"] = worker.probe("regex", "[0-9]+", 10, 256 * MIB)  # beside it, not behind it
    t.join()
    assert results["slow"].reason == "timeout" and results["fast"].ok
    assert worker.proc.pid == pid and worker.probe("regex", "x+", 10, 256 * MIB).ok


def test_the_cache_compiles_each_constraint_once(tokenizer):
    c = Compiler(tokenizer, 320, [0])
    grammars = []
    threads = [threading.Thread(target=lambda: grammars.append(c.compile("regex", "[a-c]{3}"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.num_compiles == 1 and all(g is grammars[0] for g in grammars)
    assert c.lookup("regex", "[a-c]{3}") is grammars[0] and c.lookup("regex", "[a-d]") is None
    with pytest.raises(ValueError, match="structured_output.regex is invalid"):
        c.compile("regex", "(ab")
    assert c.cached_bytes == grammars[0].memory_size_bytes
