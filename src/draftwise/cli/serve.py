"""`draftwise serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

    draftwise serve [--model DIR] [--draft DIR] [--method draft|ngram|none] [--k N]
                    [--host 127.0.0.1] [--port 8000] [--max-num-seqs N] [--max-queue N]

Ctrl-C / SIGTERM: uvicorn stops accepting connections and waits for the open responses (the
engine keeps stepping until they finish), then the engine thread stops and the process exits.
"""
from __future__ import annotations

import sys
from pathlib import Path

from .common import add_model_args, spec_from_args


def add_parser(sub):
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences running at once (default 64)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting beyond the running ones before answering 429 (default 256)")
    p.add_argument("--max-model-len", type=int, default=None, help="cap the context length")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache blocks per model (default: sized)")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: directory name)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def run(args) -> int:
    import torch
    import uvicorn

    from ..llm import LLM
    from ..paths import default_target
    from ..server import build_app
    from ..server.async_engine import EngineThread

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else default_target()
    threads = args.threads or torch.get_num_threads()
    worker = EngineThread()  # loads the models and later runs the engine loop (see async_engine)

    def build():
        torch.set_num_threads(threads)
        return LLM(args.model, draft=args.draft, spec=spec_from_args(args), dtype=args.dtype,
                   device=args.device, draft_dtype=args.draft_dtype, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                   num_kv_blocks=args.num_kv_blocks)

    llm = worker.call(build)
    name = args.served_model_name or model_dir.name
    app = build_app(llm.engine, name, aliases={str(model_dir), str(model_dir.resolve())}, max_queue=args.max_queue,
                    thread=worker)
    spec = llm.engine.spec
    print(f"draftwise serve: {name} ({model_dir}), speculation={spec.method or 'none'}"
          f"{f' k={spec.k}' if spec.method else ''}, http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=None)
    return 0
