"""The chat template from each of its three sources: `tokenizer_config.json`, `chat_template.jinja`
(transformers 5's layout; it wins when both exist) and a GGUF's `tokenizer.chat_template` (through
`import-gguf`); without any, the documented plain template."""
from __future__ import annotations

import json
import shutil

import pytest

from draftwise.model import load_model
from draftwise.model.chat_template import ChatTemplate
from gguf_files import write_gguf

MESSAGES = [{"role": "user", "content": "Say hi."}]
CONFIG_TEMPLATE = "{% for m in messages %}[config] {{ m.content }}{% endfor %}"
JINJA_TEMPLATE = "{% for m in messages %}[jinja] {{ m.content }}{% endfor %}{% if add_generation_prompt %} ->{% endif %}"


@pytest.fixture
def model_dir(tmp_path, target_dir):
    return shutil.copytree(target_dir, tmp_path / "m")


def render(path) -> tuple[str, bool]:
    chat = ChatTemplate(load_model(path, load_tokenizer=False, fuse=False).tokenizer_config)
    return chat.render(MESSAGES), chat.is_plain


def test_plain_without_a_template(model_dir):
    assert render(model_dir) == ("user: Say hi.\nassistant:", True)


def test_from_tokenizer_config(model_dir):
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=CONFIG_TEMPLATE)))
    assert render(model_dir) == ("[config] Say hi.", False)


def test_from_chat_template_jinja(model_dir):
    (model_dir / "chat_template.jinja").write_text(JINJA_TEMPLATE)
    assert render(model_dir) == ("[jinja] Say hi. ->", False)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=CONFIG_TEMPLATE)))
    assert render(model_dir) == ("[jinja] Say hi. ->", False)  # the .jinja file wins, as in transformers


def test_from_gguf_metadata(tmp_path):
    from draftwise.model.gguf_import import import_gguf

    write_gguf(tmp_path / "m.gguf", "qwen2", "F32", layers=1)
    d = import_gguf(tmp_path / "m.gguf", tmp_path / "m")
    text, plain = render(d)
    assert not plain and text == "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    write_gguf(tmp_path / "none.gguf", "qwen2", "F32", layers=1, chat_template=None)
    assert render(import_gguf(tmp_path / "none.gguf", tmp_path / "none"))[1] is True
