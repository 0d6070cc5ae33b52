"""EngineThread: jobs run in one thread, in order; results and exceptions reach the caller."""
import threading

import pytest

from draftwise.server.async_engine import EngineThread


def test_jobs_run_in_one_thread_and_return_results():
    t = EngineThread()
    names = [t.call(lambda: threading.current_thread().name) for _ in range(3)]
    assert names == ["draftwise-engine"] * 3
    assert t.call(lambda: 6 * 7) == 42
    done, box = t.submit(lambda: "bye", last=True)
    t.join(timeout=5)
    assert not t.is_alive() and done.is_set() and box == ["bye"]


def test_exception_is_raised_in_the_caller_and_thread_survives():
    t = EngineThread()
    with pytest.raises(ValueError, match="bad model"):
        t.call(lambda: (_ for _ in ()).throw(ValueError("bad model")))
    assert t.call(lambda: None) is None
    t.submit(lambda: None, last=True)
    t.join(timeout=5)
