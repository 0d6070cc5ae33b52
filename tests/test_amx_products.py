"""kernels/amx.c: vnni.c's int8-activation products on AMX tiles. A row's result must be bitwise the
one the VPDPBUSD path gives it, whatever the block's row count (blocks of 16 and a remainder), the
threads, or the weight format (int8 groups, int4 groups, Q4_K super-blocks); and a model's greedy
speculative output stays its plain output with the tiles on. Skipped where the CPU or the build
has no AMX."""
from __future__ import annotations

import pytest
import torch

from draftwise.model import cpu_kernels
from draftwise.model.gguf_blocks import q4k_blocks, q4k_subscales
from draftwise.model.quantize import Int4Linear, Int8Linear
from test_gguf_blocks import _q4k

needs_amx = pytest.mark.skipif(not (cpu_kernels.vnni() and cpu_kernels.set_amx(cpu_kernels.amx_min_rows())),
                               reason="kernels without AMX (or AVX-512 VNNI)")


def _q8g(o: int, n: int, seed: int) -> Int8Linear:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (o, n), generator=g, dtype=torch.int8)
    scale = (torch.rand(o, n // 32, generator=g) * 0.02 + 1e-3).half()
    return Int8Linear([], [torch.randn(o, generator=g)], blocks=[(q, scale)])


def _q4(o: int, n: int, seed: int) -> Int4Linear:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (o, n // 2), generator=g, dtype=torch.uint8)
    sm = torch.stack([torch.rand(o, n // 32, generator=g) * 0.02 + 1e-3,
                      -torch.rand(o, n // 32, generator=g) * 0.1], -1).half()
    return Int4Linear([], None, blocks=[(q, sm)])


def _q4k_layer(o: int, n: int, seed: int) -> Int4Linear:
    t = _q4k(o, n, seed=seed)
    layer = Int4Linear([], [torch.randn(o)], blocks=[q4k_blocks(t)], subscales=[q4k_subscales(t)])
    assert layer.super_blocks
    return layer


LAYERS = {"q8g": _q8g, "q4": _q4, "q4k": _q4k_layer}


def _both(layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tiles, VPDPBUSD) outputs of one product."""
    try:
        assert cpu_kernels.set_amx(1)
        on = layer(x)
        cpu_kernels.set_amx(0)
        return on, layer(x)
    finally:
        cpu_kernels.set_amx(cpu_kernels.amx_min_rows())


@needs_amx
@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 35])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_give_the_vnni_bits(kind, rows, dtype):
    layer = LAYERS[kind](72, 768, seed=rows)  # 72 outputs: a padded block of 16
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(1)) * 2
    x[:, 7::101] *= 40  # outliers: Q4_K's finer sub-steps where none is
    on, off = _both(layer, x.to(dtype))
    assert on.dtype == dtype and on.shape == (rows, 72)
    assert torch.equal(on, off)


@needs_amx
@pytest.mark.parametrize("kind", list(LAYERS))
def test_rows_do_not_depend_on_the_block_or_the_threads(kind):
    layer = LAYERS[kind](40, 512, seed=3)
    x = torch.randn(19, 512, generator=torch.Generator().manual_seed(2))
    block = layer(x)  # 16 rows on tiles and 3 more
    assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(len(x))]), block)
    n = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(layer(x), block)
    finally:
        torch.set_num_threads(n)


@needs_amx
def test_speculative_blocks_on_tiles_equal_plain_steps(q4k_model, monkeypatch):
    """Plain decoding one request at a time (1-row steps: VPDPBUSD) against speculative decoding of
    both together (verification blocks of 5 rows and more: tiles): the same greedy tokens."""
    import draftwise.model.llama as llama
    from draftwise import LLM, SamplingParams, SpecConfig

    monkeypatch.setattr(llama, "QUANT_MIN_NUMEL", 0)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ps = [[5, 17, 40, 99, 123, 5, 17, 40], [7, 8, 9, 7, 8, 9, 7]]
    plain = LLM(q4k_model)
    assert all(m.super_blocks for m in plain.engine.runner.model.modules() if isinstance(m, Int4Linear))
    one_by_one = [plain.generate([p], sp)[0].token_ids for p in ps]
    spec = LLM(q4k_model, draft=str(q4k_model), spec=SpecConfig(method="draft", k=4), draft_dtype="float32")
    assert [o.token_ids for o in spec.generate(ps, sp)] == one_by_one
