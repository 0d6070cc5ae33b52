import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_model_dir, make_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer(320)


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory, tokenizer):
    return make_model_dir(tmp_path_factory.mktemp("target"), seed=0, tokenizer=tokenizer, layers=2, hidden=64)


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory, tokenizer):
    """A different, smaller random model: some proposals accepted, most not."""
    return make_model_dir(tmp_path_factory.mktemp("draft"), seed=1, tokenizer=tokenizer, layers=1, hidden=32, heads=2, kv_heads=1, inter=64)


@pytest.fixture(scope="session")
def q4k_model(tmp_path_factory):
    """A 2-layer qwen2 file with Q4_K projections (hidden 256, intermediate 512), imported keeping its
    blocks and sub-scales (test_q4k_superblocks.py, test_amx_products.py)."""
    from draftwise.model.gguf_import import import_gguf
    from gguf_files import write_gguf

    root = tmp_path_factory.mktemp("q4k")
    f = root / "m.gguf"
    write_gguf(f, "qwen2", "Q4_K", seed=5, hidden=256, inter=512)
    return import_gguf(f, root / "kept", keep_quantized=True)

import torch  # noqa: E402

# Tests share two cores with other work; one intra-op thread avoids OpenMP oversubscription.
torch.set_num_threads(1)
