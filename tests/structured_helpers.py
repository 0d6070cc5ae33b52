"""Structured output's shared fixtures: a byte-level BPE with the full byte alphabet (JSON
punctuation has tokens), a tiny target and draft trained on it, the constraints the tests use and
`matches`, which says whether a text satisfies one."""

import json
import re

import jsonschema
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from draftwise import LLM, SpecConfig
from tiny_models import CORPUS, make_model_dir


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["add", "sub", "mul"]}},
    "required": ["ok", "kind"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,5}x"
CHOICE = ["yes", "no", "maybe so"]
CONSTRAINTS = {"choice": {"choice": CHOICE}, "regex": {"regex": REGEX}, "json_schema": {"json_schema": SCHEMA}}
PROMPTS = ["def add(a, b):", "import os", "class Point:", "for i in"]


def matches(kind: str, text: str) -> bool:
    if kind == "choice":
        return text in CHOICE
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS + ['{"ok": true, "kind": "add"}', '{"name": "f", "args": [1, 2]}'] * 5, trainer)
    d = tmp_path_factory.mktemp("so")
    target = make_model_dir(d / "target", seed=0, tokenizer=tok, layers=2, hidden=64)
    draft = make_model_dir(d / "draft", seed=1, tokenizer=tok, layers=1, hidden=32, heads=2, kv_heads=1, inter=64)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def llms(pair):
    target, draft = pair
    return {
        "plain": LLM(target),
        "draft": LLM(target, draft=draft, spec=SpecConfig(method="draft", k=4)),
        "ngram": LLM(target, spec=SpecConfig(method="ngram", k=4)),
    }
