"""What a server under `bench --url` says about itself, for the settings of results.json.

The bench cannot know the model, draft or dtype of a remote server; it must not record its own
defaults for them. It asks instead:

- `/v1/models` (any OpenAI-compatible server): the served model's id, `owned_by` ("draftwise",
  "vllm", ...), and where given `max_model_len` and `root` (vLLM: the model's path);
- `/health`, where `owned_by` is "draftwise": the speculative method, k and policy it runs, and
  the models it loaded (target, draft, dtypes, quantization, device);
- `/metrics`: whose speculation counters it exports (`draftwise:*` or `vllm:spec_decode_*`), and
  whether any proposal was made yet.

Whatever the server does not say is recorded as "unknown".
"""
from __future__ import annotations

import httpx

from .backends import SPEC_COUNTERS, parse_prometheus

UNKNOWN = "unknown"


def _get_json(client: httpx.Client, url: str) -> dict | None:
    try:
        r = client.get(url)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _metrics(client: httpx.Client, url: str) -> dict | None:
    """{"exporter": "draftwise" | "vllm", "proposed_tokens": N} from /metrics, None without counters."""
    try:
        r = client.get(f"{url}/metrics")
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    samples = parse_prometheus(r.text)
    for exporter, name in zip(("draftwise", "vllm"), SPEC_COUNTERS["draft_tokens"]):
        found = [v for (n, _), v in samples.items() if n == name]
        if found:
            return {"exporter": exporter, "proposed_tokens": int(sum(found))}
    return None


def describe_server(url: str, model: str | None = None) -> dict:
    """The server at `url` as it describes itself (see the module docstring); `model`: the served
    model bench asks for (None: the first listed, as HTTPBackend picks it)."""
    url = url.rstrip("/").removesuffix("/v1")
    with httpx.Client(timeout=10.0) as client:
        listing = _get_json(client, f"{url}/v1/models") or {}
        cards = [c for c in listing.get("data") or [] if isinstance(c, dict)]
        card = next((c for c in cards if c.get("id") == model), cards[0] if cards and model is None else {})
        out = {"url": url, "model": card.get("id", model or UNKNOWN), "owned_by": card.get("owned_by", UNKNOWN)}
        for key in ("max_model_len", "root"):
            if card.get(key) is not None:
                out[key] = card[key]
        health = (_get_json(client, f"{url}/health") or {}) if out["owned_by"] == "draftwise" else {}
        out["speculation"] = health.get("speculation") or UNKNOWN
        out["models"] = health.get("models") if isinstance(health.get("models"), dict) else {}
        out["metrics"] = _metrics(client, url)
    return out


def server_settings(server: dict, reference: dict | None) -> dict:
    """The model / draft / dtype entries of a bench's settings for a server run: what the server
    said, "unknown" for what it did not (never the local defaults)."""
    spec = server["speculation"]
    method = spec.get("method", UNKNOWN) if isinstance(spec, dict) else UNKNOWN
    models = server.get("models") or {}

    def said(key):  # what a draftwise server's /health says it loaded, else unknown
        return models[key] if key in models else UNKNOWN

    draft = said("draft")
    return {"model": server["model"], "method": method,
            "k": spec.get("k") if isinstance(spec, dict) and method != "none" else None,
            "draft": draft, "dtype": said("dtype"),
            "draft_dtype": said("draft_dtype") if draft is not None else None,
            "quantization": said("quantization"), "device": said("device"),
            "server": server, "reference_server": reference}
