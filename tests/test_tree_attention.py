"""Tree attention (model/tree_attention.py): every node of a tree block sees its context and its
ancestors only, at the position its path gives it, and `move_kv` leaves an accepted path's K/V as
a fresh prefill of that path would."""
import pytest
import torch

from draftwise.model import load_model
from draftwise.model.runner import ModelRunner
from draftwise.model.tree_attention import TreeSpec

CONTEXT = [5, 9, 14, 3, 22, 7, 11]
# root (the last context token) + a depth-3 tree: 0 and 1 under the root, 2 under 0, 3 and 4 under 2, 5 under 1
NODE_PARENTS = (-1, -1, 0, 2, 2, 1)
NODE_TOKENS = (17, 4, 30, 8, 19, 25)


def path_tokens(node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(NODE_TOKENS[node])
        node = NODE_PARENTS[node]
    return out[::-1]


def tree_spec(start: int) -> TreeSpec:
    """The zone: the root at key `start`, node i at key start + 1 + i."""
    return TreeSpec(start, (-1,) + tuple(p + 1 for p in NODE_PARENTS))


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_tree_logits_equal_each_path_alone(target_dir, monkeypatch, kernels):
    monkeypatch.setenv("DRAFTWISE_KERNELS", kernels)
    loaded = load_model(target_dir, load_tokenizer=False)
    runner = ModelRunner(loaded, num_blocks=32, block_size=4)
    start = len(CONTEXT) - 1
    runner.kv.reserve(1, start)
    runner.run([1], [CONTEXT[:-1]], [0], [1])
    feed = [CONTEXT[-1], *NODE_TOKENS]
    runner.kv.reserve(1, start + len(feed))
    got = runner.run([1], [feed], [start], [len(feed)], trees=[tree_spec(start)])  # [1 + n, V]
    with torch.no_grad():
        for node in range(-1, len(NODE_TOKENS)):
            ids = CONTEXT + (path_tokens(node) if node >= 0 else [])
            fresh = loaded.model.logits(torch.tensor([ids]))[0, -1]
            assert (got[node + 1] - fresh).abs().max() <= 1e-4, node


def test_tree_beside_a_chain_in_one_batch(target_dir):
    """A ragged batch: one sequence's rows form a tree, the other's are a causal chain."""
    loaded = load_model(target_dir, load_tokenizer=False)
    runner = ModelRunner(loaded, num_blocks=32, block_size=4)
    chain = [2, 8, 13, 21, 6]
    start = len(CONTEXT) - 1
    runner.kv.reserve(1, start + 1 + len(NODE_TOKENS))
    runner.kv.reserve(2, len(chain))
    runner.run([1], [CONTEXT[:-1]], [0], [1])
    got = runner.run([1, 2], [[CONTEXT[-1], *NODE_TOKENS], chain], [start, 0], [1 + len(NODE_TOKENS), len(chain)],
                     trees=[tree_spec(start), None])
    with torch.no_grad():
        for node in range(-1, len(NODE_TOKENS)):
            ids = CONTEXT + (path_tokens(node) if node >= 0 else [])
            assert (got[node + 1] - loaded.model.logits(torch.tensor([ids]))[0, -1]).abs().max() <= 1e-4
        fresh = loaded.model.logits(torch.tensor([chain]))[0]
    assert (got[1 + len(NODE_TOKENS):] - fresh).abs().max() <= 1e-4


def test_moved_path_kv_equals_fresh_prefill(target_dir):
    loaded = load_model(target_dir, load_tokenizer=False)
    runner = ModelRunner(loaded, num_blocks=32, block_size=4)
    start = len(CONTEXT) - 1
    feed = [CONTEXT[-1], *NODE_TOKENS]
    runner.kv.reserve(1, start + len(feed))
    runner.run([1], [CONTEXT[:-1]], [0], [1])
    runner.run([1], [feed], [start], [1], trees=[tree_spec(start)])
    path = [1, 5]  # the accepted nodes: 4 then 25
    runner.move_kv(1, [start + 1 + n for n in path], [start + 1 + j for j in range(len(path))])
    committed = CONTEXT + [NODE_TOKENS[n] for n in path]
    runner.kv.truncate(1, len(committed))
    fresh = ModelRunner(loaded, num_blocks=32, block_size=4)
    fresh.kv.reserve(1, len(committed))
    fresh.run([1], [committed], [0], [1])
    n = len(committed)
    a = runner.cache[:, :, runner.kv.slots([1], [n])[0]]
    b = fresh.cache[:, :, fresh.kv.slots([1], [n])[0]]
    assert (a - b).abs().max() <= 1e-5
    # and the next token's logits from the moved cache equal a fresh forward of the path
    runner.kv.reserve(1, n + 1)
    nxt = runner.run([1], [[12]], [n], [1])[0]
    with torch.no_grad():
        assert (nxt - loaded.model.logits(torch.tensor([committed + [12]]))[0, -1]).abs().max() <= 1e-4
