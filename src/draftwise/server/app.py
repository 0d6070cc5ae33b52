"""FastAPI routes: the OpenAI endpoints, `/v1/models`, `/health`, `/metrics`; errors as envelopes.

The engine thread starts with the app (lifespan). At shutdown, uvicorn's graceful shutdown
(SIGTERM, Ctrl-C) has already waited for the open responses, for at most its
`timeout_graceful_shutdown` (`draftwise serve --shutdown-timeout`), then cancelled what was left;
the lifespan then aborts every request the engine still holds and stops the engine thread.

`RequestGuard` (guard.py) checks the API key and the body size / encoding before FastAPI parses a
body; `ServerLimits` (limits.py) bounds what one request may ask.

`/health` doubles as a debug view: requests the server and the engine still hold, queue lengths,
KV blocks used/free for the target and the draft (tests check that all blocks come back) and the
constraint compiles (in flight, compiled, cached, cache hits). `GET /v1/models/{id}` answers the
served model under any of its names, else 404 (`model_not_found`).
A body FastAPI cannot decode (not JSON, nested too deeply) is a 422 `invalid_json`; one of the
wrong shape a 422 `invalid_request_body`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import LLMEngine
from .async_engine import AsyncEngine, EngineThread
from ..model.chat_template import ChatTemplate
from .errors import APIError
from .guard import RequestGuard
from .limits import ServerLimits
from .metrics import CONTENT_TYPE, Outcomes, make_registry, render
from .protocol import ChatCompletionRequest, CompletionRequest
from .serving import OpenAIServing

log = logging.getLogger("draftwise.server")


def _add_error_handlers(app: FastAPI, outcomes: Outcomes) -> None:
    """Every error answers with the OpenAI envelope and is counted once."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        outcomes.record("rejected" if e.status < 500 else "error")
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        outcomes.record("rejected")
        errs = e.errors()
        if errs and errs[0].get("type") == "json_invalid":  # loc is ("body", character offset)
            first = errs[0]
            pos = first.get("loc", (None, None))[-1]
            err = (first.get("ctx") or {}).get("error", "")
            msg = f"the request body is not valid JSON{f' ({err})' if err else ''} at character {pos}"
            return APIError(422, msg, None, "invalid_json").response()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body') or 'body'}: {er.get('msg')}"
                        for er in errs) or "malformed request body"
        return APIError(422, msg, param, "invalid_request_body").response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):  # a bug in one request: 500, keep serving
        log.exception("request failed")
        outcomes.record("error")
        return APIError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):  # unknown route, unparsable body
        if request.url.path.startswith("/v1/"):
            outcomes.record("rejected" if e.status_code < 500 else "error")
        if e.status_code == 400 and e.__cause__ is not None:  # FastAPI could not decode the body at all
            why = "nested too deeply" if isinstance(e.__cause__, RecursionError) else type(e.__cause__).__name__
            return APIError(422, f"the request body is not valid JSON ({why})", None, "invalid_json").response()
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return APIError(e.status_code, str(e.detail), None, code).response()


def build_app(engine: LLMEngine, model_name: str, aliases: set[str] | None = None,
              max_queue: int | None = None, thread: EngineThread | None = None,
              limits: ServerLimits | None = None, api_key: str | None = None,
              warm_grammar_worker: bool = False, loaded: dict | None = None) -> FastAPI:
    """`api_key`: required as `Authorization: Bearer KEY` on /v1/* (None: open);
    `warm_grammar_worker`: start the constraint compile worker with the server, not on the first
    constraint (it takes seconds to import xgrammar); `loaded`: the models loaded (`LLM.models`),
    shown by /health so that a client (bench --url) can record it."""
    limits = limits or ServerLimits()
    aeng = AsyncEngine(engine, max_queue=max_queue, thread=thread)
    outcomes = Outcomes()
    serving = OpenAIServing(aeng, model_name, aliases or set(), ChatTemplate(engine.target.tokenizer_config),
                            limits, outcomes)
    registry = make_registry(aeng, model_name, outcomes)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aeng.start()
        if warm_grammar_worker and engine.tokenizer is not None:
            asyncio.get_running_loop().run_in_executor(None, serving.constraints.warm)
        yield
        aeng.abort_all("shutdown")  # what the bounded drain left (nothing after a normal one)
        await aeng.shutdown()
        serving.close()

    app = FastAPI(title="draftwise", lifespan=lifespan)
    app.state.engine = aeng
    app.state.serving = serving
    app.state.outcomes = outcomes
    app.add_middleware(RequestGuard, limits=limits, api_key=api_key, on_reject=lambda: outcomes.record("rejected"))

    _add_error_handlers(app, outcomes)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "draftwise",
            "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        serving.check_model(model_id)  # 404 in the OpenAI envelope for another name
        return card

    @app.get("/health")
    async def health():
        snap = aeng.snapshot
        return {
            "status": "ok", "model": model_name,
            "speculation": {"method": engine.spec.method or "none", "k": engine.spec.max_draft,
                            "policy": engine.spec.policy if engine.spec.method else None,
                            "lookup": engine.spec.lookup},
            "requests_in_server": aeng.num_in_flight, "requests_in_engine": snap.requests,
            "waiting": snap.waiting, "running": snap.running, "kv_blocks": snap.kv,
            "grammar": serving.constraints.health(), "models": loaded or {},
        }

    @app.get("/metrics")
    async def metrics():
        return Response(render(registry), media_type=CONTENT_TYPE)

    return app
