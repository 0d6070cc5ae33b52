"""`draftwise serve` as a process: the official client works, and SIGTERM drains an in-flight stream."""
import os
import signal
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
        # uvicorn re-raises the captured signal once shut down: exit by SIGTERM (or 0), promptly, nothing else
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
