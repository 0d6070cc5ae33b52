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

import torch  # noqa: E402

# Tests share two cores with other work; one intra-op thread avoids OpenMP oversubscription.
torch.set_num_threads(1)
