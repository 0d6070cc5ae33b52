"""Workloads: JSONL files of requests, one a line: `id`, `prompt` or `messages`, `max_tokens`,
optional `temperature` (default 0 = greedy), `category` and `structured_output` (a constraint, as
`SamplingParams.structured_output`: {"json_schema": {...}}, {"regex": "..."}, {"choice": [...]}, ...).

A chat request gives `messages` ([{"role", "content"}, ...]) instead of `prompt`: the in-process
bench renders them with the target's chat template (`render_prompt`; a model without one gets the
plain template, as `serve` does), `--url` sends them to `/v1/chat/completions`.

Shipped workloads live in `draftwise/workloads/NAME.jsonl` (built by `make_workloads`);
`load_workload` takes a shipped name or a path and raises `ValueError` naming the file, line and
field of the first problem: bytes that are not UTF-8, a string with a lone surrogate (a JSON
escape such as "\\ud800"), a value `SamplingParams` rejects (it validates temperature and
max_tokens, as it does for every request).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..sampling import SamplingParams

WORKLOADS_DIR = Path(__file__).resolve().parents[1] / "workloads"


@dataclass(frozen=True)
class Request:
    id: str
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    category: str = ""
    structured_output: dict | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) pairs: a chat request

    @property
    def message_dicts(self) -> list[dict] | None:
        return [{"role": r, "content": c} for r, c in self.messages] if self.messages else None

    def render_prompt(self, chat) -> str:
        """The prompt text: `prompt`, or `messages` rendered by `chat` (a ChatTemplate)."""
        return chat.render(self.message_dicts) if self.messages else self.prompt

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Workload:
    name: str
    requests: list[Request]

    @property
    def sampled(self) -> bool:
        return any(r.temperature > 0 for r in self.requests)

    def head(self, n: int | None) -> "Workload":
        """The first n requests (all when n is None), cycling if n exceeds the workload."""
        if n is None or n == len(self.requests):
            return self
        reqs = [self.requests[i % len(self.requests)] for i in range(n)]
        if n > len(self.requests):  # repeated requests get distinct ids
            reqs = [replace(r, id=f"{r.id}#{i // len(self.requests)}") if i >= len(self.requests) else r
                    for i, r in enumerate(reqs)]
        return Workload(self.name, reqs)


def shipped_workloads() -> list[str]:
    return sorted(p.stem for p in WORKLOADS_DIR.glob("*.jsonl"))


def parse_request(obj, where: str) -> Request:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("id", "max_tokens"):
        if key not in obj:
            raise ValueError(f"{where}: missing field {key!r}")
    if ("prompt" in obj) == ("messages" in obj):
        raise ValueError(f"{where}: give exactly one of 'prompt' and 'messages'")
    unknown = set(obj) - {"id", "prompt", "messages", "max_tokens", "temperature", "category", "structured_output"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    rid, mt = obj["id"], obj["max_tokens"]
    temp, cat = obj.get("temperature", 0.0), obj.get("category", "")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise ValueError(f"{where}: 'id' must be a string, got {rid!r}")
    messages = _messages(obj["messages"], where) if "messages" in obj else None
    prompt = obj.get("prompt", "")
    if messages is None and (not isinstance(prompt, str) or not prompt):
        raise ValueError(f"{where}: 'prompt' must be a non-empty string")
    if not isinstance(cat, str):
        raise ValueError(f"{where}: 'category' must be a string, got {cat!r}")
    texts = [("id", str(rid)), ("prompt", prompt), ("category", cat)]
    texts += [(f"messages[{i}].content", c) for i, (_, c) in enumerate(messages or ())]
    for key, text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{where}: '{key}' is not valid text (lone surrogate \\u{ord(text[e.start]):04x} "
                             f"at character {e.start})") from None
    try:
        params = SamplingParams(temperature=temp, max_tokens=mt, structured_output=obj.get("structured_output"))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    temp = 0.0 if params.is_greedy else params.temperature  # below 1e-5: greedy (SamplingParams)
    return Request(str(rid), prompt, mt, float(temp), cat, params.structured_output, messages)


def _messages(value, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise ValueError(f"{where}: messages[{i}] must be an object with exactly 'role' and 'content'")
        if m["role"] not in ("system", "user", "assistant"):
            raise ValueError(f"{where}: messages[{i}].role must be system, user or assistant, got {m['role']!r}")
        if not isinstance(m["content"], str) or not m["content"]:
            raise ValueError(f"{where}: messages[{i}].content must be a non-empty string")
        out.append((m["role"], m["content"]))
    return tuple(out)


def read_jsonl(path: Path) -> list[Request]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"workload file not found: {path}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}:{line}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    reqs, seen = [], set()
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
        r = parse_request(obj, where)
        if r.id in seen:
            raise ValueError(f"{where}: duplicate id {r.id!r}")
        seen.add(r.id)
        reqs.append(r)
    if not reqs:
        raise ValueError(f"{path}: no requests")
    return reqs


def write_jsonl(path: Path, requests: list[Request]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            d = r.to_dict()
            if not d["category"]:
                del d["category"]
            if d["structured_output"] is None:
                del d["structured_output"]
            if d["messages"] is None:
                del d["messages"]
            else:
                del d["prompt"]
                d["messages"] = r.message_dicts
            f.write(json.dumps(d, ensure_ascii=False) + "\n")


def load_workload(name_or_path: str) -> Workload:
    p = Path(name_or_path)
    if p.suffix == ".jsonl" or p.exists() or "/" in name_or_path:
        return Workload(p.stem, read_jsonl(p))
    shipped = WORKLOADS_DIR / f"{name_or_path}.jsonl"
    if not shipped.is_file():
        raise ValueError(f"unknown workload {name_or_path!r}: use one of {', '.join(shipped_workloads())} or a .jsonl path")
    return Workload(name_or_path, read_jsonl(shipped))
