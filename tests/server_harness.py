"""Run the draftwise server in-process (uvicorn in a thread, loopback, free port) for tests."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

from draftwise.server import build_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """`with ServerThread(engine, "tiny") as srv: srv.url ...`; stops (gracefully) on exit."""

    def __init__(self, engine, model_name: str = "tiny", max_queue: int | None = None, **app_kwargs):
        self.app = build_app(engine, model_name, max_queue=max_queue, **app_kwargs)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                             timeout_graceful_shutdown=10)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def engine(self):
        """The AsyncEngine (its `.engine` is the LLMEngine)."""
        return self.app.state.engine

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_idle(self, timeout: float = 20) -> dict:
        """Poll /health until no request is left anywhere; returns the last answer."""
        deadline = time.time() + timeout
        while True:
            h = self.health()
            if (h["requests_in_server"] == 0 and h["requests_in_engine"] == 0
                    and h["running"] == 0 and h["waiting"] == 0) or time.time() > deadline:
                return h
            time.sleep(0.05)
