"""The OpenAI-compatible HTTP server: `draftwise serve`.

- `async_engine`: the engine stepping in a background thread, one asyncio queue per request;
- `protocol`: request/response bodies (pydantic) and their mapping to `SamplingParams`;
- `chat`: the chat template;
- `app`: the FastAPI routes; `errors`: the OpenAI error envelope; `metrics`: `/metrics`.
"""
from .app import build_app
from .async_engine import AsyncEngine

__all__ = ["AsyncEngine", "build_app"]
