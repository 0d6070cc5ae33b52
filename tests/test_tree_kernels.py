"""Tree attention on the fused CPU kernels (kernels/attention.c, `tree_attention.kernel_trees`)
against the PyTorch path's per-row mask (model/tree_attention.py), and against each tree row's
path fed as a chain: the same bits, which is what keeps greedy tree verification equal to plain
decoding."""
import random

import pytest
import torch

from draftwise.model import cpu_kernels, load_model
from draftwise.model.llama import LlamaModel
from draftwise.model.runner import ModelRunner
from draftwise.model.tree_attention import TreeSpec, kernel_trees
from tiny_models import make_model_dir

CASES = {
    "llama-gqa": dict(),
    "mistral-window": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=5),
}


@pytest.fixture
def kernels_switch():
    yield cpu_kernels.set_enabled
    cpu_kernels.set_enabled(True)


def need_kernels():
    if cpu_kernels.kernels() is None:
        pytest.skip("fused kernels unavailable (no C compiler)")


def random_parents(rng: random.Random, n: int) -> tuple[int, ...]:
    """A random tree of n nodes: node i under -1 (the context) or an earlier node."""
    return tuple(rng.randrange(-1, i) for i in range(n))


def path_of(parents, node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def tree_rounds(loaded, seed: int) -> list[torch.Tensor]:
    """Three sequences, prefilled, then: a batch of two verification trees ([last committed, nodes])
    beside a causal chain; a drafter-like call whose rows hang under tree keys fed by an earlier
    call (the zone starts before the call's first row) beside a causal catch-up."""
    rng = random.Random(seed)
    V = loaded.config.vocab_size
    runner = ModelRunner(loaded, num_blocks=48, block_size=4)
    ctx = {0: rng.randrange(3, 14), 1: rng.randrange(3, 14), 2: rng.randrange(3, 14)}
    ids = {s: [rng.randrange(1, V) for _ in range(40)] for s in ctx}
    for step in range(10):  # interleaved block tables (paged, not consecutive)
        for s in ctx:
            runner.kv.reserve(s, 4 * (step + 1))
    out = [runner.run([s], [ids[s][: ctx[s] - 1]], [0], [1]) for s in ctx]
    # verification: root = the last committed token, nodes under it
    specs, feeds, starts, nlog = [], [], [], []
    for s, n in ((0, 7), (1, 9), (2, 4)):
        root = ctx[s] - 1
        feeds.append([ids[s][root]] + [rng.randrange(1, V) for _ in range(n)])
        starts.append(root)
        nlog.append(n + 1)
        specs.append(None if s == 2 else TreeSpec(root, (-1,) + tuple(p + 1 for p in random_parents(rng, n))))
    out.append(runner.run(list(ctx), feeds, starts, nlog, trees=specs))
    # a drafter's second depth: new rows under nodes fed before (sequence 0), a catch-up (sequence 2)
    z0 = specs[0]
    fed = len(feeds[0])
    under = [rng.randrange(-1, fed) for _ in range(3)]
    spec = TreeSpec(z0.base, z0.parents + tuple(under))
    new = [rng.randrange(1, V) for _ in range(3)]
    catch = ids[2][ctx[2] - 1 + 5 : ctx[2] - 1 + 8]
    out.append(runner.run([0, 2], [new, catch], [z0.base + fed, ctx[2] - 1 + 5], [3, 2], trees=[spec, None]))
    return out


@pytest.mark.parametrize("whole", [True, False], ids=["one-call", "per-layer"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_tree_attention_matches_pytorch_path(name, dtype, whole, tmp_path, tokenizer, kernels_switch,
                                                   monkeypatch):
    kernels_switch(True)
    need_kernels()
    if not whole:
        monkeypatch.setattr(LlamaModel, "_layer_pointers", lambda self: ())
    path = make_model_dir(tmp_path, seed=8, tokenizer=tokenizer, **CASES[name])
    fused_trees = []
    real = LlamaModel._decoder_args

    def spy(self, B, T, pos_ptr, kv_cache, meta, max_position):
        fused_trees.append(meta.kernel_trees is not None)
        return real(self, B, T, pos_ptr, kv_cache, meta, max_position)

    monkeypatch.setattr(LlamaModel, "_decoder_args", spy)
    for seed in range(3):
        fused_trees.clear()
        on = tree_rounds(load_model(path, dtype=dtype, load_tokenizer=False), seed)
        assert fused_trees.count(True) == 2, "both tree calls take the fused path"
        kernels_switch(False)
        off = tree_rounds(load_model(path, dtype=dtype, load_tokenizer=False), seed)
        kernels_switch(True)
        for a, b in zip(on, off):
            scale = b.abs().max().item()
            tol = 1e-5 * max(1.0, scale) if dtype == "float32" else 0.02 * scale
            assert (a - b).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tree_rows_are_bitwise_their_paths_as_chains(dtype, tmp_path, tokenizer, kernels_switch):
    """Each node's logits on the fused path are the bits of the last row of a chain block over its
    path (the same scores, summed in the same order), and a chain given as a tree (parents i - 1)
    is the chain's bits."""
    kernels_switch(True)
    need_kernels()
    path = make_model_dir(tmp_path, seed=9, tokenizer=tokenizer, **CASES["mistral-window"])
    loaded = load_model(path, dtype=dtype, load_tokenizer=False)
    rng = random.Random(3)
    V = loaded.config.vocab_size
    context = [rng.randrange(1, V) for _ in range(11)]
    n = 10
    parents = random_parents(rng, n)
    nodes = [rng.randrange(1, V) for _ in range(n)]

    def fresh() -> ModelRunner:
        runner = ModelRunner(loaded, num_blocks=16, block_size=4)
        runner.kv.reserve(0, len(context) + n)
        runner.run([0], [context[:-1]], [0], [1])
        return runner

    root = len(context) - 1
    spec = TreeSpec(root, (-1,) + tuple(p + 1 for p in parents))
    tree = fresh().run([0], [[context[-1], *nodes]], [root], [n + 1], trees=[spec])
    for node in range(n):
        chain = [context[-1]] + [nodes[i] for i in path_of(parents, node)]
        got = fresh().run([0], [chain], [root], [1])
        assert torch.equal(tree[node + 1], got[0]), node
    as_tree = fresh().run([0], [[context[-1], *nodes]], [root], [n + 1], trees=[TreeSpec(root, tuple(range(-1, n)))])
    assert torch.equal(as_tree, fresh().run([0], [[context[-1], *nodes]], [root], [n + 1]))


def test_kernel_layout():
    trees = [TreeSpec(4, (-1, 0, 0, 1)), None, TreeSpec(2, (-1, -1))]
    assert kernel_trees(trees, [8, 5, 3]) == [3, -1, 8, 4, -1, 0, 0, 1, 2, -1]
    assert kernel_trees([None, None], [3, 4]) is None
    with pytest.raises(ValueError):
        kernel_trees([TreeSpec(4, (-1, 0))], [7])


def test_greedy_tree_verification_on_raw_logits_equals_the_general_path(monkeypatch):
    """Rows greedy on raw logits take one argmax per slot (`tree_verify._verify_argmax`): the
    tokens, accepted paths and p rows are those of process_logits + tree_rejection_sample, for
    trees and chains in one batch, a tree whose sibling is accepted, and a row with a NaN slot."""
    from types import SimpleNamespace

    from draftwise import SamplingParams
    from draftwise.engine import tree_verify
    from draftwise.engine.sequence import Sequence
    from draftwise.proposers import DraftBlock

    V = 50
    g = torch.Generator().manual_seed(5)
    blocks = [DraftBlock([7, 9, 3, 4], None, parents=(-1, -1, 1, 2)), DraftBlock([5, 6], None),
              DraftBlock([1, 2, 8], None, parents=(-1, 0, 0)), DraftBlock([], None)]
    logits = torch.randn(sum(1 + len(b.token_ids) for b in blocks), V, generator=g)
    logits[0, 9] = logits[2, 3] = 9.0  # tree 0: its second root child, then that child's child accepted
    logits[5, 5] = 9.0  # the chain: its first proposal accepted
    logits[8, 5] = float("nan")  # tree 2: a NaN slot, nothing committed
    seqs = [SimpleNamespace(seq=Sequence(f"r{i}", [1, 2], SamplingParams(temperature=0))) for i in range(4)]
    fast = tree_verify.verify_with_trees(seqs, blocks, logits, [0], V)
    monkeypatch.setattr(tree_verify, "_takes_argmax", lambda seq: False)
    slow = tree_verify.verify_with_trees(seqs, blocks, logits, [0], V)
    assert fast.tokens == slow.tokens and fast.accepted == slow.accepted and fast.valid == slow.valid
    assert fast.paths == slow.paths and fast.paths[0] == [1, 2] and fast.valid[2] is False
    assert fast.tokens[1][0] == 5 and fast.accepted[1] >= 1
    for b in range(4):
        if fast.valid[b]:
            assert torch.equal(fast.committed(b).logits.argmax(-1), slow.committed(b).logits.argmax(-1))
