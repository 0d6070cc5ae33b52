"""The OpenAI error envelope: `{"error": {"message", "type", "param", "code"}}` with its status."""
from __future__ import annotations

import re

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_server_error", 503: "service_unavailable"}


def printable(text: str) -> str:
    """`text` with lone surrogates escaped (`\\ud800`), so that it can be encoded as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    """An error answered to one request: HTTP status + envelope fields (+ headers, e.g. Retry-After)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        message = printable(message)  # may quote the request's own (invalid) text
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_PARAM = re.compile(r"^(\w+)")


def from_value_error(e: ValueError, prompt_param: str = "prompt") -> APIError:
    """A `SamplingParams` / engine `ValueError` -> 400; their messages start with the parameter name."""
    msg = str(e)
    if msg.startswith("This model's maximum context length"):
        return APIError(400, msg, prompt_param, "context_length_exceeded")
    if msg.startswith("prompt"):
        return APIError(400, msg, prompt_param, "invalid_value")
    m = _PARAM.match(msg)
    return APIError(400, msg, m.group(1) if m else None, "invalid_value")
