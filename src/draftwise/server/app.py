"""FastAPI routes: the OpenAI endpoints, `/v1/models`, `/health`, `/metrics`; errors as envelopes.

The engine thread starts with the app (lifespan). At shutdown, uvicorn's graceful shutdown
(SIGTERM, Ctrl-C) has already waited for the open responses, for at most its
`timeout_graceful_shutdown` (`draftwise serve --shutdown-timeout`), then cancelled what was left;
the lifespan then aborts every request the engine still holds and stops the engine thread.

`RequestGuard` (guard.py) checks the API key and the body size / encoding before FastAPI parses a
body; `ServerLimits` (limits.py) bounds what one request may ask.

`/health` doubles as a debug view: requests the server and the engine still hold, queue lengths
and KV blocks used/free for the target and the draft (tests check that all blocks come back).
"""
from __future__ import annotations

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
        return APIError(e.status_code, str(e.detail), None, None).response()


def build_app(engine: LLMEngine, model_name: str, aliases: set[str] | None = None,
              max_queue: int | None = None, thread: EngineThread | None = None,
              limits: ServerLimits | None = None, api_key: str | None = None) -> FastAPI:
    """`api_key`: required as `Authorization: Bearer KEY` on /v1/* (None: open)."""
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

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "draftwise",
                "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        snap = aeng.snapshot
        return {
            "status": "ok", "model": model_name,
            "speculation": {"method": engine.spec.method or "none", "k": engine.spec.max_draft,
                            "policy": engine.spec.policy if engine.spec.method else None},
            "requests_in_server": aeng.num_in_flight, "requests_in_engine": snap.requests,
            "waiting": snap.waiting, "running": snap.running, "kv_blocks": snap.kv,
        }

    @app.get("/metrics")
    async def metrics():
        return Response(render(registry), media_type=CONTENT_TYPE)

    return app
