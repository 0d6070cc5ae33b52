"""Server-sent events: the `data:` lines, and a streaming response that ends properly when cut.

At shutdown, uvicorn waits `--shutdown-timeout` seconds for open responses, then cancels what is
left. A plain `StreamingResponse` then stops mid-body: the client sees a broken stream with no
reason and uvicorn logs "ASGI callable returned without completing response". `EventStream`
catches the cancellation, sends an `{"error": ...}` event and `data: [DONE]` and ends the body
(shielded from the cancellation, bounded in time), then lets the cancellation go on. A client
that has left gets nothing: sending to it fails quietly.
"""
from __future__ import annotations

import json

import anyio
from starlette.responses import StreamingResponse

from .errors import APIError

SEND_TIMEOUT_S = 2.0  # the final bytes to a client that reads slowly; then the connection goes


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


def cut_event() -> str:
    """The end of a stream cut at shutdown: an error event, then [DONE]."""
    err = APIError(503, "the server is shutting down: this stream was cut when --shutdown-timeout ran out",
                   None, "shutting_down")
    return sse(err.body()) + DONE


class EventStream(StreamingResponse):
    media_type = "text/event-stream"

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                if not isinstance(chunk, (bytes, memoryview)):
                    chunk = chunk.encode(self.charset)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(SEND_TIMEOUT_S):
                try:
                    await send({"type": "http.response.body", "body": cut_event().encode(), "more_body": False})
                except Exception:  # the client has gone
                    pass
            raise
        await send({"type": "http.response.body", "body": b"", "more_body": False})
