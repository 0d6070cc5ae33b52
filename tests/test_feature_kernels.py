"""The target's features (the residual stream after listed layers: what a drafter on the target's
features reads) from the one-call kernels against the layer-by-layer path: `dw_forward`
(`native_logits`) and `dw_decoder` (`_fused_forward`) copy them out (`DecoderArgs.feat`), and the
logits and the features are the same bits as `_layer_by_layer`'s, for a lone sequence, paged
batches (equal blocks, packed ragged ones, a rollback) and tree rows."""
import random

import pytest
import torch

from draftwise.model import cpu_kernels
from draftwise.model.llama import LlamaModel
from draftwise.model.runner import ModelRunner
from draftwise.model.tree_attention import TreeSpec
from test_cpu_kernels import BIG, load_with_distinct_norms
from tiny_models import make_model_dir

LAYERS = (0, 2)  # of 3: the middle layer not listed
SHAPE = dict(BIG, layers=3, vocab_size=1024)  # products in dw_gemm, a head packed for it


@pytest.fixture
def kernels_on():
    cpu_kernels.set_enabled(True)
    if cpu_kernels.kernels() is None:
        pytest.skip("fused kernels unavailable (no C compiler)")
    yield
    cpu_kernels.set_enabled(True)


def feature_rounds(loaded, layers=LAYERS) -> list[torch.Tensor]:
    """Logits and features of every call: a lone sequence's prefill chunk, decode step and
    verification blocks (one rolled back) on consecutive slots; then three sequences on interleaved
    (paged) blocks: prompts, single tokens, equal blocks, a packed ragged batch, and two trees beside
    a chain."""
    rng = random.Random(5)
    V = loaded.config.vocab_size
    out = []

    def run(runner, *a, **kw):
        logits, feats = runner.run(*a, feature_layers=layers, **kw)
        out.extend([logits, feats])

    runner = ModelRunner(loaded, num_blocks=12, block_size=8)
    runner.kv.reserve(0, 60)
    ids = [rng.randrange(1, V) for _ in range(50)]
    run(runner, [0], [ids[:12]], [0], [12])
    run(runner, [0], [[ids[12]]], [12], [1])
    run(runner, [0], [ids[13:18]], [13], [5])
    run(runner, [0], [ids[15:20]], [15], [5])  # positions 15.. again: rolled back
    runner = ModelRunner(loaded, num_blocks=48, block_size=4)
    seqs = {s: [rng.randrange(1, V) for _ in range(40)] for s in range(3)}
    for step in range(8):  # interleave the block tables
        for s in seqs:
            runner.kv.reserve(s, 4 * (step + 1))
    n = {0: 7, 1: 12, 2: 5}
    for s in seqs:
        run(runner, [s], [seqs[s][: n[s]]], [0], [1])
    b = list(seqs)
    run(runner, b, [[seqs[s][n[s]]] for s in b], [n[s] for s in b], [1] * 3)
    n = {s: n[s] + 1 for s in b}
    run(runner, b, [seqs[s][n[s]: n[s] + 3] for s in b], [n[s] for s in b], [3] * 3)
    k = {0: 2, 1: 4, 2: 1}  # packed: 7 rows
    run(runner, b, [seqs[s][n[s]: n[s] + k[s]] for s in b], [n[s] for s in b], [k[s] for s in b])
    n = {s: n[s] + k[s] for s in b}
    trees, feeds = [], []
    for s, m in ((0, 5), (1, 3), (2, 2)):
        feeds.append([seqs[s][n[s] - 1]] + [rng.randrange(1, V) for _ in range(m)])
        parents = (-1,) + tuple(rng.randrange(-1, i) + 1 for i in range(m))
        trees.append(None if s == 2 else TreeSpec(n[s] - 1, parents))
    run(runner, b, feeds, [n[s] - 1 for s in b], [len(f) for f in feeds], trees=trees)
    return out


def paths(monkeypatch) -> dict[str, int]:
    """Counts of the calls each path made: the one-call step, the decoder call, layer by layer."""
    seen = {"native": 0, "layers": 0}
    native, layers = LlamaModel.native_logits, LlamaModel._layer_by_layer

    def native_spy(self, *a, **kw):
        got = native(self, *a, **kw)
        seen["native"] += got is not None
        return got

    def layers_spy(self, *a, **kw):
        seen["layers"] += 1
        return layers(self, *a, **kw)

    monkeypatch.setattr(LlamaModel, "native_logits", native_spy)
    monkeypatch.setattr(LlamaModel, "_layer_by_layer", layers_spy)
    return seen


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_call_features_equal_layer_by_layer_bitwise(dtype, threads, tmp_path, tokenizer, kernels_on, monkeypatch):
    path = make_model_dir(tmp_path, seed=6, tokenizer=tokenizer, **SHAPE)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # the decoder's team (or none)
    seen = paths(monkeypatch)
    one = load_with_distinct_norms(path, dtype)
    whole = feature_rounds(one)
    if not one.model._decoder_plan:  # e.g. an AVX-512 CPU: oneDNN keeps the float32 products
        pytest.skip("this CPU's products are oneDNN's: the per-layer path only")
    calls = len(whole) // 2
    assert seen == {"native": calls, "layers": 0}, "every call one kernel call (dw_forward)"
    monkeypatch.setattr(LlamaModel, "native_logits", lambda self, *a, **kw: None)
    seen.update(native=0, layers=0)
    decoder = feature_rounds(load_with_distinct_norms(path, dtype))
    assert seen["layers"] == 0, "every call dw_decoder"
    monkeypatch.setattr(LlamaModel, "_layer_pointers", lambda self: ())
    by_layer = feature_rounds(load_with_distinct_norms(path, dtype))
    assert seen["layers"] == calls
    H = one.config.hidden_size
    for i, (a, b, c) in enumerate(zip(whole, decoder, by_layer)):
        if i % 2:  # features [fed rows, 2 H] in the model's dtype
            assert a.dtype == getattr(torch, dtype) and a.shape[1] == len(LAYERS) * H
            assert a.abs().max() > 0
        assert torch.equal(a, c) and torch.equal(b, c), f"call {i // 2}, {'features' if i % 2 else 'logits'}"


def test_one_call_features_follow_the_listed_layers(tmp_path, tokenizer, kernels_on):
    """Each listed layer's columns are that layer's output: a single layer's features are the
    matching columns of a longer list's, and the logits do not depend on the list."""
    path = make_model_dir(tmp_path, seed=6, tokenizer=tokenizer, **SHAPE)
    both = feature_rounds(load_with_distinct_norms(path, "float32"), (0, 2))
    H = BIG["hidden"]
    for layers, cols in (((2,), slice(H, 2 * H)), ((0,), slice(0, H))):
        one = feature_rounds(load_with_distinct_norms(path, "float32"), layers)
        for i, (a, b) in enumerate(zip(one, both)):
            assert torch.equal(a, b[:, cols] if i % 2 else b)


def test_features_without_kernels_agree(tmp_path, tokenizer, kernels_on):
    """The PyTorch path (kernels off: padded batches, tree rows under a per-row mask) returns the
    same rows' features, up to float rounding."""
    path = make_model_dir(tmp_path, seed=6, tokenizer=tokenizer, **SHAPE)
    on = feature_rounds(load_with_distinct_norms(path, "float32"))
    cpu_kernels.set_enabled(False)
    off = feature_rounds(load_with_distinct_norms(path, "float32"))
    assert len(on) == len(off)
    for a, b in zip(on, off):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-4 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_steps_return_the_features_of_every_fed_token(dtype, tmp_path, tokenizer, kernels_on):
    """A lone row's greedy steps in one call (`ModelRunner.greedy_steps`, multi-step plain decoding)
    with features: the tokens and the features of the fed tokens (the feed, then each proposal but
    the last) are bitwise those of one `run` a step, on consecutive and on paged slots."""
    path = make_model_dir(tmp_path, seed=6, tokenizer=tokenizer, **SHAPE)
    loaded = load_with_distinct_norms(path, dtype)
    if not loaded.model._decoder() or loaded.model._native_io() is None:
        pytest.skip("this CPU's products are oneDNN's: no one-call steps")
    V = loaded.config.vocab_size
    feed = [3, 17, 250, 9]
    for paged in (False, True):
        runner = ModelRunner(loaded, num_blocks=24, block_size=4)
        if paged:  # another sequence's blocks between this one's
            for n in range(4, 40, 4):
                runner.kv.reserve(1, n)
                runner.kv.reserve(0, n)
        runner.kv.reserve(0, 40)
        runner.run([0], [[5, 6, 7]], [0], [1])
        toks, _, feats = runner.greedy_steps(0, feed, 3, 5, feature_layers=LAYERS)
        assert feats.shape == (len(feed) + 4, len(LAYERS) * BIG["hidden"]) and feats.dtype == getattr(torch, dtype)
        want_feats, fed, start = [], list(feed), 3
        for t in toks:
            logits, f = runner.run([0], [fed], [start], [1], feature_layers=LAYERS)
            assert int(logits[0].argmax()) == t and 0 <= t < V
            want_feats.append(f)
            start += len(fed)
            fed = [t]
        assert torch.equal(feats, torch.cat(want_feats)[: len(feed) + 4])
