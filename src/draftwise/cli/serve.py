"""`draftwise serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

    draftwise serve [--model DIR] [--draft DIR] [--method draft|ngram|none] [--k N]
                    [--host 127.0.0.1] [--port 8000] [--max-num-seqs N] [--max-queue N]
                    [--api-key KEY] [--shutdown-timeout S] [--max-request-bytes N] ...

Ctrl-C / SIGTERM: uvicorn stops accepting connections and waits for the open responses (the
engine keeps stepping until they finish) for at most --shutdown-timeout seconds; what is left
then is cancelled and aborted, the engine thread stops and the process exits with status 0. A
second signal exits at once (status 128 + the signal).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .common import add_model_args, add_multi_step_arg, draft_load_args, positive_int, spec_from_args


def _non_negative(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return v


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in [0, 65535], got {text!r}")
    return int(text)


def _queue(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return int(text)


LIMIT_FLAGS = [
    ("--max-request-bytes", "largest request body in bytes, else 413 (default 4 MiB)"),
    ("--max-prompt-chars", "characters per prompt or chat conversation, checked before tokenizing (default 1000000)"),
    ("--max-prompts", "prompts per completions request (default 64)"),
    ("--max-n", "largest n (default 64)"),
    ("--max-stop", "stop strings per request (default 32)"),
    ("--max-stop-chars", "characters per stop string (default 512)"),
    ("--max-grammar-bytes", "largest structured-output constraint (a schema as JSON, a choice as EBNF) in bytes, "
                            "else 400 (default 262144)"),
    ("--grammar-compile-timeout", "seconds a constraint may take to parse and compile, else 400 (default 10)"),
    ("--grammar-memory-mib", "memory a constraint's compile may take, in MiB, else 400 (default 512)"),
]


def add_parser(sub):
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API", description=__doc__.splitlines()[0])
    add_model_args(p)
    add_multi_step_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="port to bind (default 8000)")
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="sequences running at once (default 64)")
    p.add_argument("--max-queue", type=_queue, default=256,
                   help="requests waiting beyond the running ones before answering 429 (default 256)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="cap the context length (default: the target's, or the draft model's if shorter, "
                        "or what the K/V pools hold if less: see --kv-cache-memory)")
    p.add_argument("--num-kv-blocks", type=positive_int, default=None,
                   help="KV cache blocks per model (default: sized from --kv-cache-memory)")
    p.add_argument("--api-key", default=os.environ.get("DRAFTWISE_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $DRAFTWISE_API_KEY; "
                        "/health and /metrics stay open)")
    p.add_argument("--shutdown-timeout", type=_non_negative, default=30.0,
                   help="seconds SIGTERM waits for open responses before aborting them (default 30)")
    # request limits (server/limits.py: ServerLimits holds the defaults; None = its default)
    for flag, doc in LIMIT_FLAGS:
        p.add_argument(flag, type=positive_int, default=None, help=doc)
    p.add_argument("--served-model-name", default=None,
                   help="model name in the API (default: the --model directory's name; without --model, the "
                        "embedded target's)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default info)")
    return p


def run(args) -> int:
    from ..server.heap import limit_arenas

    limit_arenas(2)  # before any thread allocates (server/heap.py): per-thread arenas kept growing RSS
    import torch
    import uvicorn

    from ..llm import LLM
    from ..paths import default_target, resolve_model
    from ..server import build_app
    from ..server.async_engine import EngineThread
    from ..server.limits import ServerLimits

    if args.threads:
        torch.set_num_threads(args.threads)
    given = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag, _ in LIMIT_FLAGS}
    limits = ServerLimits(**{k: v for k, v in given.items() if v is not None})
    spec = spec_from_args(args)
    model_dir = resolve_model(args.model) if args.model else default_target()
    threads = args.threads or torch.get_num_threads()
    worker = EngineThread()  # loads the models and later runs the engine loop (see async_engine)

    def build():
        torch.set_num_threads(threads)
        return LLM(args.model, draft=args.draft, spec=spec, dtype=args.dtype,
                   device=args.device, draft_dtype=args.draft_dtype, quantization=args.quantization,
                   **draft_load_args(args), max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                   num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
                   enable_prefix_caching=args.prefix_caching, recurrent_rollback=args.recurrent_rollback,
                   multi_step=args.multi_step)

    llm = worker.call(build)
    name = args.served_model_name or model_dir.name
    app = build_app(llm.engine, name, aliases={str(model_dir), str(model_dir.resolve())}, max_queue=args.max_queue,
                    thread=worker, limits=limits, api_key=args.api_key, warm_grammar_worker=True,
                    loaded=llm.models)
    spec = llm.engine.spec
    print(f"draftwise serve: {name} ({model_dir}), speculation={spec.method or 'none'}"
          f"{f' k={spec.k}' if spec.method else ''}{f' lookup={spec.lookup}' if spec.lookup else ''}"
          f", http://{args.host}:{args.port}/v1"
          f"{' (API key required)' if args.api_key else ''}", file=sys.stderr, flush=True)
    # the pools are resident from the start (engine/kv_sizing.py): say what they take, and the context
    print(f"draftwise serve: {llm.engine.kv_plan.describe()}", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    _server_class()(config).run()
    return 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """A first SIGTERM / SIGINT drains (bounded by timeout_graceful_shutdown) and lets `run`
        return, so the process exits 0 (uvicorn would re-raise the signal: status 143); a second
        one exits at once."""

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:
                print("draftwise serve: second signal, exiting now", file=sys.stderr, flush=True)
                os._exit(128 + sig)
            print(f"draftwise serve: shutting down (waiting up to {self.config.timeout_graceful_shutdown:g} s "
                  "for open responses; a second signal exits at once)", file=sys.stderr, flush=True)
            self.should_exit = True

    return Server
