"""`draftwise serve` as a process: the official client works, SIGTERM drains an in-flight stream and
exits 0, a drain that cannot finish (a client that stops reading) is bounded by --shutdown-timeout,
and a second SIGTERM exits at once."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai

from server_harness import free_port


def test_serve_cli_and_sigterm_drains(target_dir, draft_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "draftwise.cli.main", "serve", "--model", str(target_dir), "--draft", str(draft_dir),
           "--method", "draft", "--k", "2", "--port", str(port), "--threads", "1", "--max-num-seqs", "8",
           "--served-model-name", "tiny", "--log-level", "warning"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.1)
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5 and r.model_extra["draftwise"]["k"] == 2

        # SIGTERM while a long stream is in flight: it still completes, then the process exits
        body = {"model": "tiny", "prompt": "def", "max_tokens": 200, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        lines = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and not lines:
                    proc.send_signal(signal.SIGTERM)
                if line.startswith("data: "):
                    lines.append(line)
        assert lines[-1] == "data: [DONE]"
        assert '"completion_tokens":200' in lines[-2]
        assert proc.wait(timeout=30) == 0  # a drained shutdown is a normal exit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start_server(target_dir, *extra):
    port = free_port()
    cmd = [sys.executable, "-m", "draftwise.cli.main", "serve", "--model", str(target_dir), "--method", "none",
           "--port", str(port), "--threads", "1", "--log-level", "critical", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, port
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.time() < deadline, "server did not come up"
        time.sleep(0.1)


def stuck_client(port) -> socket.socket:
    """A stream of ~10 MB (64 choices x 200 tokens with 20 logprobs each) to a client that never
    reads: the server's writes block once the socket buffers are full."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect(("127.0.0.1", port))
    body = json.dumps({"prompt": "def", "max_tokens": 200, "ignore_eos": True, "stream": True, "logprobs": 20,
                       "n": 64}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return s


def test_sigterm_drain_is_bounded_and_second_sigterm_exits_at_once(target_dir):
    proc, port = start_server(target_dir, "--shutdown-timeout", "1.5")
    try:
        s = stuck_client(port)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        # the client still reads nothing, so only --shutdown-timeout can end the drain: a normal exit
        assert proc.wait(timeout=30) == 0
        s.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    proc, port = start_server(target_dir, "--shutdown-timeout", "60")
    try:
        s = stuck_client(port)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert proc.poll() is None  # draining (the stuck stream)
        proc.send_signal(signal.SIGTERM)
        # exit status 128 + SIGTERM, not the 0 of a drain ended by the 60 s bound: the second signal cut it
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert "second signal" in proc.stderr.read()
        s.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
