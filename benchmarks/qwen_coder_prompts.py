"""Code chat requests for the Qwen2.5-Coder pair (make qwen-coder), rendered with the model's own
chat template: "complete this function", "write a function that ...", "fix this bug".

    from qwen_coder_prompts import PROMPTS, chat_ids
    ids = chat_ids(TARGET, llm.tokenizer, PROMPTS[0])   # token ids of the rendered chat prompt

Shared by benchmarks/qwen_coder_quality.py and benchmarks/qwen_coder_speed.py so that both
measure the same requests.
"""
from __future__ import annotations

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"

PROMPTS = [
    "Complete this function:\n\n```python\ndef merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
    "    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n```",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Fix this bug:\n\n```python\ndef average(xs):\n    total = 0\n    for x in xs:\n        total += x\n"
    "    return total / len(xs) + 1\n```",
    "Write a Python class LRUCache with get(key) and put(key, value), both O(1).",
    "Complete this function:\n\n```python\ndef is_palindrome(s: str) -> bool:\n"
    "    \"\"\"True when s reads the same backwards, ignoring case and non-letters.\"\"\"\n```",
    "Write a function that parses a line of CSV with quoted fields into a list of strings.",
]

# The prefill prompt: a longer "fix this bug" request, 182 tokens once rendered.
LONG_PROMPT = (
    "Fix the bug in this function:\n\n```python\n"
    "def binary_search(items, target):\n    \"\"\"Return the index of target in the sorted list items, or -1.\"\"\"\n"
    "    lo, hi = 0, len(items)\n    while lo < hi:\n        mid = (lo + hi) // 2\n"
    "        if items[mid] == target:\n            return mid\n        if items[mid] < target:\n"
    "            lo = mid\n        else:\n            hi = mid\n    return -1\n\n\n"
    "def test_binary_search():\n    assert binary_search([1, 3, 5, 7], 5) == 2\n"
    "    assert binary_search([1, 3, 5, 7], 4) == -1\n```"
)


def render(model: str, text: str) -> str:
    """`text` as one user message to `model` (a name under models/ or a directory), rendered with
    its chat template and the generation prompt (the template adds Qwen's default system message)."""
    import json

    from draftwise.model.chat_template import ChatTemplate
    from draftwise.paths import resolve_model

    cfg = json.loads((resolve_model(model) / "tokenizer_config.json").read_text())
    return ChatTemplate(cfg).render([{"role": "user", "content": text}])


def chat_ids(model: str, tokenizer, text: str) -> list[int]:
    """The token ids of `render(model, text)`."""
    return tokenizer.encode(render(model, text), add_special_tokens=False).ids
