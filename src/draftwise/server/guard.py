"""An ASGI middleware in front of the routes: the API key and the request body, checked before
FastAPI parses anything.

On `/v1/*` (not `/health`, `/metrics`):
- with an API key (`draftwise serve --api-key KEY` or `DRAFTWISE_API_KEY`), a request without
  `Authorization: Bearer KEY` is answered 401 with the OpenAI envelope (`invalid_api_key`);
- a body over `ServerLimits.max_request_bytes` is answered 413 as soon as its `Content-Length` (or,
  for a chunked body, the bytes read so far) says so, without reading the rest;
- a body that is not UTF-8 is answered 400 naming the byte offset.
The body read here is handed on to the app unchanged; later `receive()` calls (disconnect
detection) go to the server. A request cancelled by a shutdown past its bound ends here with one
log line (the routes have already aborted its engine requests).
"""
from __future__ import annotations

import asyncio
import hmac
import logging

from .errors import APIError
from .limits import ServerLimits

log = logging.getLogger("draftwise.server")


class RequestGuard:
    def __init__(self, app, limits: ServerLimits, api_key: str | None = None, on_reject=None):
        self.app = app
        self.limits = limits
        self.api_key = api_key.encode() if api_key else None
        self.on_reject = on_reject  # callable(): a request answered here (counted as rejected)

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not (path == "/v1" or path.startswith("/v1/")):
            return await self.app(scope, receive, send)
        if self.api_key is not None and not self._authorized(scope):
            return await self._reject(APIError(401, "Incorrect or missing API key: send the header "
                                                    "'Authorization: Bearer KEY'.", None, "invalid_api_key",
                                               headers={"WWW-Authenticate": "Bearer"}), scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        limit = self.limits.max_request_bytes
        too_big = APIError(413, f"the request body is larger than this server accepts ({limit} bytes, "
                                f"--max-request-bytes)", None, "request_too_large")
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            return await self._reject(too_big, scope, receive, send)
        body, more = bytearray(), True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > limit:
                return await self._reject(too_big, scope, receive, send)
        body = bytes(body)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return await self._reject(APIError(400, f"the request body is not valid UTF-8 (byte 0x{body[e.start]:02x} "
                                                    f"at offset {e.start})", None, "invalid_text"),
                                      scope, receive, send)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        try:
            return await self.app(scope, replay, send)
        except asyncio.CancelledError:  # only uvicorn cancels a request: shutdown past its bound
            log.warning("%s %s cancelled: the shutdown timeout was exceeded", scope["method"], path)

    def _authorized(self, scope) -> bool:
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def _reject(self, err: APIError, scope, receive, send) -> None:
        if self.on_reject is not None:
            self.on_reject()
        await err.response()(scope, receive, send)
