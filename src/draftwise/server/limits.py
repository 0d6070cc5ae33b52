"""What one request may ask of the server (`draftwise serve` flags), and the checks against it.

A request outside these limits can never be served, however idle the server is: it is answered
400 (413 for a body over `max_request_bytes`), which clients do not retry. A request that fits
but finds the server full (more choices than `max_num_seqs` running plus `max_queue` waiting) is
answered 429 with `Retry-After`, which clients do retry.

| limit | flag | default |
|---|---|---|
| request body | `--max-request-bytes` | 4 MiB |
| characters per prompt (before tokenizing) or per chat conversation | `--max-prompt-chars` | 1,000,000 |
| prompts per request | `--max-prompts` | 64 |
| `n` (choices per prompt) | `--max-n` | 64 |
| stop strings per request, characters per stop string | `--max-stop`, `--max-stop-chars` | 32, 512 |
| a structured-output constraint's text (a schema as JSON, a choice as EBNF) | `--max-grammar-bytes` | 256 KiB |
| its parse + compile, in the worker process | `--grammar-compile-timeout` (s), `--grammar-memory-mib` | 10 s, 512 MiB |

Prompts x n also has to fit `max_num_seqs + max_queue` (what the server holds at once).
A constraint within the compile limits is compiled once more in the server's own process (its
memory then grows by about what the worker measured): server/constraints.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import APIError

RETRY_AFTER_S = 1  # a full queue drains within seconds; the openai client honours Retry-After


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int = 4 * 2**20
    max_prompt_chars: int = 1_000_000
    max_prompts: int = 64
    max_n: int = 64
    max_stop: int = 32
    max_stop_chars: int = 512
    max_grammar_bytes: int = 256 * 1024
    grammar_compile_timeout: int = 10  # seconds
    grammar_memory_mib: int = 512

    def __post_init__(self) -> None:
        for name, v in vars(self).items():
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")

    def check_prompt_chars(self, n_chars: int, param: str) -> None:
        if n_chars > self.max_prompt_chars:
            raise APIError(400, f"{param} has {n_chars} characters; this server accepts at most "
                                f"{self.max_prompt_chars} (--max-prompt-chars)", param, "prompt_too_long")

    def check_request(self, num_prompts: int, n: int, stop: list[str], capacity: int | None) -> None:
        """Limits on prompts, n and stop strings; `capacity`: choices the server can hold at once."""
        if num_prompts > self.max_prompts:
            raise APIError(400, f"prompt: {num_prompts} prompts in one request; this server accepts at most "
                                f"{self.max_prompts} (--max-prompts)", "prompt", "too_many_prompts")
        if n > self.max_n:
            raise APIError(400, f"n must be at most {self.max_n} on this server (--max-n), got {n}", "n",
                           "invalid_value")
        if len(stop) > self.max_stop:
            raise APIError(400, f"stop: {len(stop)} stop strings; this server accepts at most {self.max_stop} "
                                f"(--max-stop)", "stop", "invalid_value")
        longest = max((len(s) for s in stop), default=0)
        if longest > self.max_stop_chars:
            raise APIError(400, f"stop: a stop string of {longest} characters; this server accepts at most "
                                f"{self.max_stop_chars} (--max-stop-chars)", "stop", "invalid_value")
        choices = num_prompts * n
        if capacity is not None and choices > capacity:
            raise APIError(400, f"n: {num_prompts} prompt(s) x n={n} = {choices} choices can never fit: this "
                                f"server holds at most {capacity} at once (--max-num-seqs + --max-queue)", "n",
                           "invalid_value")


def queue_full(queued: int, limit: int) -> APIError:
    return APIError(429, f"The server's queue is full ({queued} requests waiting, limit {limit}); retry later.",
                    None, "queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
