"""The fused CPU kernels (model/kernels/) against the PyTorch path they replace."""
import shutil

import pytest
import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.model.runner import ModelRunner
from draftwise.model import cpu_kernels, load_model
from draftwise.model.llama import LlamaModel
from tiny_models import make_model_dir

CASES = {
    "llama-gqa": dict(),
    "llama-mha-tied": dict(kv_heads=4, tie_word_embeddings=True),
    "mistral-window": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=5),
    "qwen2-bias": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
}


@pytest.fixture
def kernels_switch():
    """Yields set_enabled; restores the default (on) afterwards."""
    yield cpu_kernels.set_enabled
    cpu_kernels.set_enabled(True)


def test_kernels_build_where_a_compiler_exists(kernels_switch):
    kernels_switch(True)
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine")
    assert cpu_kernels.kernels() is not None
    kernels_switch(False)
    assert cpu_kernels.kernels() is None


def load_with_distinct_norms(path, dtype, quantization=None):
    """The test models' RMSNorm weights are all ones; distinct ones catch a kernel reading the
    wrong norm."""
    loaded = load_model(path, dtype=dtype, load_tokenizer=False, quantization=quantization)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in loaded.model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    return loaded


def native_logits_calls(monkeypatch) -> list[bool]:
    """Whether each call of LlamaModel.native_logits took the one-call native path (not None)."""
    taken: list[bool] = []
    real = LlamaModel.native_logits

    def spy(self, *a, **kw):
        out = real(self, *a, **kw)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(LlamaModel, "native_logits", spy)
    return taken


def run_rounds(loaded, calls: list) -> list[torch.Tensor]:
    """Prefill in two chunks, single-token steps, a verification block, then a rollback (a block
    rewritten from an earlier position over stale K/V): the access pattern of speculative decoding."""
    runner = ModelRunner(loaded, num_blocks=12, block_size=8)
    runner.kv.reserve(0, 80)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, loaded.config.vocab_size, (70,), generator=g).tolist()
    out = [runner.run([0], [ids[:12]], [0], [12]), runner.run([0], [ids[12:52]], [12], [40])]
    for t in range(52, 55):
        out.append(runner.run([0], [[ids[t]]], [t], [1]))
    out.append(runner.run([0], [ids[55:60]], [55], [5]))
    out.append(runner.run([0], [ids[57:66]], [57], [9]))  # positions 57.. again: rolled back
    out.append(runner.run([0], [[ids[66]]], [66], [1]))
    calls.append(len(out))
    return out


@pytest.mark.parametrize("whole", [True, False], ids=["one-call", "per-layer"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_layer_matches_pytorch_path(name, dtype, whole, tmp_path, kernels_switch, monkeypatch, tokenizer):
    """The tiny models' projections are all small: all layers run in one `dw_decoder` call, or
    (as for a target with oneDNN-packed products) layer by layer."""
    if not whole:
        monkeypatch.setattr(LlamaModel, "_layer_pointers", lambda self: ())
    kernels_switch(True)
    if cpu_kernels.kernels() is None:
        pytest.skip("fused kernels unavailable (no C compiler)")
    path = make_model_dir(tmp_path, seed=3, tokenizer=tokenizer, **CASES[name])
    fused_calls = []
    real = LlamaModel._fused_forward

    def spy(self, *a, **kw):
        fused_calls.append(a[0].shape[1])
        return real(self, *a, **kw)

    monkeypatch.setattr(LlamaModel, "_fused_forward", spy)
    loaded = load_with_distinct_norms(path, dtype)
    on = run_rounds(loaded, [])
    assert bool(loaded.model._decoder_plan) == whole
    assert fused_calls == [12, 40, 1, 1, 1, 5, 9, 1], "every call of this lone sequence takes the fused path"
    kernels_switch(False)
    fused_calls.clear()
    off = run_rounds(load_with_distinct_norms(path, dtype), [])
    assert fused_calls == []
    for a, b in zip(on, off):
        scale = b.abs().max().item()
        if dtype == "float32":
            assert (a - b).abs().max().item() <= 1e-5 * max(1.0, scale)
        else:  # a product may round to the neighbouring bfloat16 value: compare in its ulps
            assert (a - b).abs().max().item() <= 0.02 * scale


# a target-sized layer: every projection at least PACK_MIN_NUMEL elements (dw_gemm's packing, or
# int8), the o projection too (448 x 448)
BIG = dict(hidden=448, heads=7, kv_heads=1, inter=896, layers=2)


@pytest.mark.parametrize("variant", ["float32", "bfloat16", "int8", "int4"])
def test_one_call_step_equals_layer_by_layer_bitwise(variant, tmp_path, tokenizer, kernels_switch, monkeypatch):
    """A target whose products are dw_gemm's (float32 / bfloat16), dw_linear_q8's (int8) or dw_linear_q4's (int4): the
    whole step in one dw_decoder call gives bitwise the logits of the per-layer path (the same
    kernels, in the same order), for a lone sequence and for batches (padded and packed)."""
    kernels_switch(True)
    if cpu_kernels.kernels() is None:
        pytest.skip("fused kernels unavailable (no C compiler)")
    path = make_model_dir(tmp_path, seed=6, tokenizer=tokenizer, **BIG)
    dtype, quant = ("float32", variant) if variant in ("int8", "int4") else (variant, None)

    def load():
        return load_with_distinct_norms(path, dtype, quant)

    one = load()
    a = run_rounds(one, []) + run_batch_rounds(load())
    if not one.model._decoder_plan:  # e.g. an AVX-512 CPU: oneDNN keeps the float32 products
        pytest.skip("this CPU's products are oneDNN's: the per-layer path only")
    kinds = list(one.model._decoder_plan[1])
    assert set(kinds) == ({3} if quant == "int8" else {4} if quant else {1} if dtype == "float32" else {2}), kinds
    monkeypatch.setattr(LlamaModel, "_layer_pointers", lambda self: ())
    b = run_rounds(load(), []) + run_batch_rounds(load())
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_whole_step_with_embeddings_and_head_equals_separate_calls(dtype, tied, tmp_path, tokenizer, kernels_switch,
                                                                   monkeypatch):
    """dw_forward (the embeddings, every layer and the head of the rows that need logits, in one
    call: `LlamaModel.native_logits`) gives bitwise the logits of the decoder call beside
    PyTorch's embedding, row selection and compute_logits, for a lone sequence on consecutive and
    on paged slots and for batches (padded and packed); a token outside the vocabulary still gets
    the step-by-step path's error."""
    kernels_switch(True)
    if cpu_kernels.kernels() is None:
        pytest.skip("fused kernels unavailable (no C compiler)")
    # a vocabulary large enough for a head packed for dw_gemm (the tiny tokenizer's is not)
    path = make_model_dir(tmp_path, seed=6, tokenizer=tokenizer, vocab_size=1024, tie_word_embeddings=tied, **BIG)
    taken = native_logits_calls(monkeypatch)

    def rounds(loaded):
        out = run_rounds(loaded, []) + run_batch_rounds(load_with_distinct_norms(path, dtype))
        runner = ModelRunner(loaded, num_blocks=12, block_size=8)  # a lone sequence on paged slots
        runner.kv.reserve(1, 8)
        runner.kv.reserve(0, 8)
        runner.kv.reserve(1, 16)
        runner.kv.reserve(0, 24)
        assert runner.kv.contiguous_start(0, 20) is None
        ids = list(range(3, 23))
        out += [runner.run([0], [ids[:15]], [0], [2]), runner.run([0], [ids[15:20]], [15], [5])]
        with pytest.raises(Exception):
            runner.run([0], [[1024]], [20], [1])
        return out

    one = load_with_distinct_norms(path, dtype)
    a = rounds(one)
    if not one.model._decoder_plan:  # e.g. an AVX-512 CPU: oneDNN keeps the float32 products
        pytest.skip("this CPU's products are oneDNN's: the per-layer path only")
    assert one.model._native_io() is not None
    assert taken.count(True) == len(a) and taken.count(False) == 1  # the out-of-vocabulary token: None
    monkeypatch.setattr(LlamaModel, "native_logits", lambda self, *a, **kw: None)
    b = rounds(load_with_distinct_norms(path, dtype))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_qk_norm_models_keep_the_pytorch_path(tmp_path, tokenizer, monkeypatch, kernels_switch):
    kernels_switch(True)
    if cpu_kernels.kernels() is None:  # without kernels the fused path is never taken: nothing to check
        pytest.skip("fused kernels unavailable (no C compiler)")
    path = make_model_dir(tmp_path, seed=3, tokenizer=tokenizer, architectures=["Qwen3ForCausalLM"],
                          model_type="qwen3", head_dim=16)
    monkeypatch.setattr(LlamaModel, "_fused_forward", lambda *a, **k: pytest.fail("fused path used for qk-norm"))
    run_rounds(load_model(path, load_tokenizer=False), [])


def test_speculative_equals_plain_with_and_without_kernels(target_dir, draft_dir, kernels_switch):
    """Greedy output is the same with the fused kernels on or off, plain and speculative."""
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [list(range(5 + i, 17 + i)) for i in range(4)]
    outs = {}
    for enabled in (True, False):
        kernels_switch(enabled)
        plain = LLM(target_dir)
        spec = LLM(target_dir, draft=draft_dir, spec=SpecConfig(method="draft", k=4))
        outs[enabled] = ([o.token_ids for o in plain.generate(prompts, sp)],
                         [spec.generate(p, sp)[0].token_ids for p in prompts])
    assert outs[True][0] == outs[True][1] == outs[False][0] == outs[False][1]


@pytest.mark.parametrize("whole", [True, False], ids=["one-call", "per-layer"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_block_and_single_token_forwards_agree_exactly(dtype, whole, tmp_path, tokenizer, kernels_switch,
                                                        monkeypatch):
    """A token's logits are bitwise the same whether it is fed alone or inside a verification
    block: the kernels compute every row in a fixed order (attention switches to 16-key blocks
    for many queries and keeps the per-key order). This is what makes greedy speculative decoding
    agree with plain decoding on the kernel path, without near-tie exceptions."""
    kernels_switch(True)
    if cpu_kernels.kernels() is None:
        pytest.skip("fused kernels unavailable (no C compiler)")
    if not whole:
        monkeypatch.setattr(LlamaModel, "_layer_pointers", lambda self: ())
    path = make_model_dir(tmp_path, seed=5, tokenizer=tokenizer, **CASES["mistral-window"])
    loaded = load_with_distinct_norms(path, dtype)
    ids = torch.randint(1, loaded.config.vocab_size, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = {}
    for mode in ("block", "single"):
        runner = ModelRunner(loaded, num_blocks=8, block_size=8)
        runner.kv.reserve(0, 32)
        runner.run([0], [ids[:12]], [0], [1])
        if mode == "block":
            rows[mode] = runner.run([0], [ids[12:20]], [12], [8])
        else:
            rows[mode] = torch.cat([runner.run([0], [[ids[t]]], [t], [1]) for t in range(12, 20)])
    assert torch.equal(rows["block"], rows["single"])


def run_batch_rounds(loaded) -> list[torch.Tensor]:
    """Three sequences of different lengths whose blocks interleave in the cache (paged, not
    consecutive): single-token steps, equal-length blocks and unequal (padded) ones for all three
    at once, with a rollback, as batched decoding and verification do."""
    runner = ModelRunner(loaded, num_blocks=24, block_size=4)
    g = torch.Generator().manual_seed(2)
    V = loaded.config.vocab_size
    seqs = {s: torch.randint(1, V, (40,), generator=g).tolist() for s in range(3)}
    prompt = {0: 7, 1: 12, 2: 5}
    for step in range(6):  # interleave the block tables: 4 slots at a time, in turns
        for s in range(3):
            runner.kv.reserve(s, 4 * (step + 1))
    out = []
    for s in range(3):
        out.append(runner.run([s], [seqs[s][: prompt[s]]], [0], [1]))
    ids = list(range(3))
    n = dict(prompt)
    for _ in range(2):
        out.append(runner.run(ids, [[seqs[s][n[s]]] for s in ids], [n[s] for s in ids], [1] * 3))
        n = {s: n[s] + 1 for s in ids}
    out.append(runner.run(ids, [seqs[s][n[s]: n[s] + 3] for s in ids], [n[s] for s in ids], [3] * 3))
    n = {s: n[s] + 1 for s in ids}  # only the first of the three kept: the rest rolled back
    out.append(runner.run(ids, [seqs[s][n[s]: n[s] + 3] for s in ids], [n[s] for s in ids], [3] * 3))
    n = {s: n[s] + 2 for s in ids}
    k = {0: 2, 1: 4, 2: 1}  # unequal blocks: packed on the fused path (7 rows), padded to 4 a sequence in PyTorch
    out.append(runner.run(ids, [seqs[s][n[s]: n[s] + k[s]] for s in ids], [n[s] for s in ids], [k[s] for s in ids]))
    n = {s: n[s] + k[s] for s in ids}
    out.append(runner.run(ids, [[seqs[s][n[s]]] for s in ids], [n[s] for s in ids], [1] * 3))
    return out


@pytest.mark.parametrize("whole", [True, False], ids=["one-call", "per-layer"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window"])
def test_fused_batches_match_pytorch_path(name, dtype, whole, tmp_path, tokenizer, kernels_switch, monkeypatch):
    kernels_switch(True)
    if cpu_kernels.kernels() is None:
        pytest.skip("fused kernels unavailable (no C compiler)")
    if not whole:
        monkeypatch.setattr(LlamaModel, "_layer_pointers", lambda self: ())
    path = make_model_dir(tmp_path, seed=4, tokenizer=tokenizer, **CASES[name])
    shapes = []
    real = LlamaModel._fused_forward

    def spy(self, *a, **kw):
        shapes.append(tuple(a[0].shape))
        return real(self, *a, **kw)

    monkeypatch.setattr(LlamaModel, "_fused_forward", spy)
    on = run_batch_rounds(load_with_distinct_norms(path, dtype))
    assert {(3, 1), (3, 3), (1, 7)} <= set(shapes), "batches, unequal (packed) ones too, take the fused path"
    kernels_switch(False)
    shapes.clear()
    off = run_batch_rounds(load_with_distinct_norms(path, dtype))
    assert shapes == []
    for a, b in zip(on, off):
        scale = b.abs().max().item()
        tol = 1e-5 * max(1.0, scale) if dtype == "float32" else 0.02 * scale
        assert (a - b).abs().max().item() <= tol


@pytest.mark.parametrize("kernels_on", [True, False], ids=["kernels", "pytorch"])
def test_long_prefill_chunks_of_different_lengths_run_one_forward_each(kernels_on, tmp_path, tokenizer,
                                                                       kernels_switch, monkeypatch):
    """Prefill chunks of 170, 200 and 33 tokens in one call: too long for the packed path, they run
    one forward per sequence (no padding to 200 rows each) and give the logits of three separate
    calls, in order."""
    from draftwise.model import runner as runner_mod

    kernels_switch(kernels_on)
    path = make_model_dir(tmp_path, seed=8, tokenizer=tokenizer, max_pos=512)
    loaded = load_model(path, load_tokenizer=False)
    g = torch.Generator().manual_seed(3)
    V = loaded.config.vocab_size
    chunks = [torch.randint(1, V, (n,), generator=g).tolist() for n in (170, 200, 33)]
    nlog = [1, 2, 1]

    def fresh():
        r = ModelRunner(loaded, num_blocks=60, block_size=8)
        for s, c in enumerate(chunks):
            r.kv.reserve(s, len(c))
        return r

    calls = []
    real = runner_mod.ModelRunner._run_split

    def spy(self, *a, **kw):
        calls.append(len(a[0]))
        return real(self, *a, **kw)

    monkeypatch.setattr(runner_mod.ModelRunner, "_run_split", spy)
    together = fresh().run([0, 1, 2], chunks, [0, 0, 0], nlog)
    assert calls == [3]
    r = fresh()
    apart = torch.cat([r.run([s], [c], [0], [n]) for s, (c, n) in enumerate(zip(chunks, nlog))])
    assert together.shape == (4, V)
    assert torch.equal(together, apart)


def test_threads_do_not_change_the_bits(tmp_path, tokenizer, kernels_switch):
    """Attention splits its heads and dw_gemm its outputs across the OpenMP team: 1 and 2 threads
    give bitwise the same logits (lone sequence and batches; blocks big enough to go parallel)."""
    kernels_switch(True)
    if cpu_kernels.kernels() is None:
        pytest.skip("fused kernels unavailable (no C compiler)")
    # two K/V heads (the attention's units of work) and enough keys for its parallel path
    path = make_model_dir(tmp_path, seed=9, tokenizer=tokenizer, hidden=512, heads=8, kv_heads=2, inter=1024, layers=2)
    before = torch.get_num_threads()
    out = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            loaded = load_model(path, load_tokenizer=False)
            out[n] = run_rounds(loaded, []) + run_batch_rounds(loaded)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(out[1], out[2]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("enabled", [True, False])
def test_argmax_confidence_is_torchs(enabled, kernels_switch):
    """A drafter's argmax and confidence exp(max - logsumexp) per row: the kernel's (dw_argmax_conf)
    and the fallback's equal torch's: the first maximum among ties, the value within float32
    rounding, NaN for a row holding a NaN, an all -inf row or one with +inf; -inf entries (masked
    tokens) count for nothing. Rows of 1..69 values: the 8-lane loop, its tail and the scalar scan."""
    import math

    kernels_switch(enabled)
    if enabled and cpu_kernels.kernels() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(0)
    for trial in range(400):
        n, v = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 70, (1,), generator=g))
        x = torch.randint(-3, 4, (n, v), generator=g).float()  # small integers: ties everywhere
        r, i, j = trial % 6, int(torch.randint(n, (1,), generator=g)), int(torch.randint(v, (1,), generator=g))
        if r == 1:
            x[i, j] = math.nan
        elif r == 2:
            x[i, j] = math.inf
        elif r == 3:
            x[i] = -math.inf
        elif r == 4:
            x[i, j] = -math.inf
        tok, conf = cpu_kernels.argmax_confidence(x)
        top, am = x.max(dim=-1)
        want = torch.exp(top - torch.logsumexp(x, dim=-1)).tolist()
        assert tok == am.tolist(), (x, tok)
        for a, b in zip(conf, want):
            assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-5), (x, conf, want)
    x = torch.randn(3, 8192, generator=g) * 4  # a drafter's vocabulary
    tok, conf = cpu_kernels.argmax_confidence(x)
    assert tok == x.argmax(dim=-1).tolist()
    assert conf == pytest.approx(torch.softmax(x, dim=-1).max(dim=-1).values.tolist(), rel=1e-5)
