"""The int8-activation kernels (kernels/cpu/quant_linear_i8.cpp) against the plain reference
(`reference.quant_linear_int8`), for every block format: the repacked layout holds every weight bit
for bit at the file's size, the activations are quantized exactly as the reference does, and the
products agree up to float32 summation order. The int8 path's distance from the exact float32 one
is bounded here on random data and measured on real models by `octavo eval` (tests/oracle)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from octavo.kernels import cpu, dispatch, reference
from octavo.quantization import FORMATS, dequantize
from tests.kernels.test_k_quants import FP16_AT

needs_kernels = pytest.mark.skipif(cpu.load() is None, reason="the C++ CPU kernels are not built on this machine")

ALL = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
FP16 = {**FP16_AT, "Q4_0": [(0, 1)], "Q4_1": [(0, 2)], "Q8_0": [(0, 1)]}


def random_blocks(name: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Blocks of every bit pattern a file may hold (fp16 fields kept finite and small)."""
    fmt = FORMATS[name]
    g = np.random.default_rng(seed)
    nb = cols // fmt.block_size
    blocks = g.integers(0, 256, size=(rows, nb, fmt.block_bytes), dtype=np.uint8)
    for offset, count in FP16[name]:
        values = g.uniform(-0.05, 0.05, size=(rows, nb, count)).astype(np.float16)
        blocks[..., offset : offset + 2 * count] = values.view(np.uint8)
    if name == "MXFP4":  # exponents of weights near the other formats' (2^-8 .. 2^1 a step)
        blocks[..., 0] = g.integers(120, 130, size=(rows, nb), dtype=np.uint8)
    return torch.from_numpy(blocks.reshape(rows, nb * fmt.block_bytes))


def check_against_reference(name: str, n: int, k: int, ms=(1, 2, 5, 9, 17)) -> None:
    """Everything the int8 kernels promise for one format and shape (also run by the narrower ISA
    builds: tests/kernels/test_quant_isa_paths.py)."""
    fmt = FORMATS[name]
    q = random_blocks(name, n, k, seed=n * k + fmt.code)
    packed = cpu.pack_i8(q, fmt)
    exact = dequantize(q, fmt, k)
    assert torch.equal(cpu.dequantize_rows_i8(packed, fmt, torch.arange(n), k, n), exact), (name, n, k)
    for m in ms:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
        x[0, :32] = 0.0  # a chunk of zeros: dx 0
        xq, dx = cpu.quantize_activations_i8(x)
        rxq, rdx = reference.quantize_activations(x)
        assert torch.equal(xq, rxq) and torch.equal(dx, rdx), (name, m)
        got = cpu.quant_linear_i8(x, packed, fmt, n)
        expect = reference.quant_linear_int8(x, q, fmt, k)
        # weights of random blocks reach ~100 and cancel: compare by the size of the terms
        size = x.abs() @ exact.abs().t()
        err = (got - expect).abs()
        assert bool((err <= 1e-5 * size + 1e-5).all()), (name, n, k, m, float((err / size).max()))


@needs_kernels
@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("n,k", [(1, 256), (17, 512), (40, 1024)])
def test_kernel_matches_reference(name, n, k):
    check_against_reference(name, n, k)


@needs_kernels
@pytest.mark.parametrize("name", ALL)
def test_layout_is_the_files_size(name):
    fmt = FORMATS[name]
    n, k = 64, 1024  # whole groups: no padding rows
    q = random_blocks(name, n, k, seed=1)
    held = cpu.pack_i8(q, fmt).numel()
    extra = {"Q4_K": 4 / 144, "Q5_K": 4 / 176}.get(name, 0.0)  # 6-bit scales and mins: a byte each
    assert held == pytest.approx(q.numel() * (1 + extra), rel=1e-9)


@needs_kernels
def test_batch_rows_do_not_change_a_rows_result():
    """A row's output is the same bits alone or among others (batch invariance of the int8 path)."""
    fmt = FORMATS["Q4_K"]
    q = random_blocks("Q4_K", 48, 512, seed=3)
    packed = cpu.pack_i8(q, fmt)
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(4))
    together = cpu.quant_linear_i8(x, packed, fmt, 48)
    for i in (0, 5, 12):
        assert torch.equal(cpu.quant_linear_i8(x[i : i + 1], packed, fmt, 48)[0], together[i])


def test_int8_reference_is_close_to_the_exact_product():
    """The reference itself: quantizing activations per 32 to int8 moves a product by about
    max|x| / 254 per term (half a step), so by well under 1% of the terms' size on random data."""
    fmt = FORMATS["Q4_1"]
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    from octavo.quantization import quantize

    q = quantize(w, fmt)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(6))
    exact = reference.quant_linear(x, q, fmt, 256)
    approx = reference.quant_linear_int8(x, q, fmt, 256)
    size = x.abs() @ dequantize(q, fmt, 256).abs().t()
    rel = ((approx - exact).abs() / size).max()
    assert 0 < rel < 0.01


@needs_kernels
def test_dispatch_takes_the_int8_layout_with_bias_and_3d_input():
    fmt = FORMATS["Q6_K"]
    q = random_blocks("Q6_K", 24, 256, seed=7)
    weight, layout = dispatch.prepare_quant_weight(q, fmt, "int8")
    assert layout == "packed_i8"
    bias = torch.randn(24)
    x = torch.randn(2, 3, 256)
    got = dispatch.quant_linear(x, weight, layout, fmt, 256, 24, bias)
    expect = reference.quant_linear_int8(x.reshape(6, 256), q, fmt, 256, bias).reshape(2, 3, 24)
    torch.testing.assert_close(got, expect, atol=1e-3, rtol=1e-4)
    ids = torch.tensor([0, 23, 5])
    assert torch.equal(dispatch.quant_embedding(ids, weight, layout, fmt, 256, 24, torch.float32),
                       dequantize(q[ids], fmt, 256))
    with pytest.raises(ValueError, match="float32 or int8"):
        dispatch.prepare_quant_weight(q, fmt, "int4")


def test_reference_layout_without_kernels_computes_the_same_numbers():
    fmt = FORMATS["Q4_0"]
    q = random_blocks("Q4_0", 8, 64, seed=8)
    x = torch.randn(3, 64)
    got = dispatch.quant_linear(x, q, "gguf_i8", fmt, 64, 8)
    torch.testing.assert_close(got, reference.quant_linear_int8(x, q, fmt, 64))


@needs_kernels
def test_amx_tiles_give_the_vector_paths_bits(monkeypatch):
    """Where the build has AMX-INT8 and a child's self-test passes, the tile path (steps of 16+
    rows) gives the same bits as the vector dot products: exact integers, the same float scaling."""
    if not cpu.load().amx_built():
        pytest.skip("this build has no AMX-INT8 (the CPU does not list it)")
    monkeypatch.setenv("OCTAVO_AMX", "1")
    cpu.disable_amx()
    try:
        if not cpu.amx_enabled():
            pytest.skip("AMX-INT8 listed but its self-test failed in a child process (logged)")
        for name in ALL:
            fmt = FORMATS[name]
            q = random_blocks(name, 40, 512, seed=9)
            packed = cpu.pack_i8(q, fmt)
            x = torch.randn(33, 512, generator=torch.Generator().manual_seed(10))
            tiles = cpu.quant_linear_i8(x, packed, fmt, 40)
            cpu.load().amx_enable(False)
            vectors = cpu.quant_linear_i8(x, packed, fmt, 40)
            cpu.load().amx_enable(True)
            assert torch.equal(tiles, vectors), name
    finally:
        cpu.disable_amx()


needs_bf16_tiles = pytest.mark.skipif(cpu.load() is None or not cpu.amx_bf16_enabled(),
                                      reason="AMX-BF16 tiles are not built or do not run on this machine")


@needs_bf16_tiles
@pytest.mark.parametrize("name", ALL)
def test_bf16_tiles_match_the_reference(name):
    """The prompt rows' kernel: x and W rounded to bfloat16, float32 sums (reference.quant_linear_bf16);
    a weight may round to the other bfloat16 neighbour (the kernel rebuilds it as D * u + B, gguf-py
    in its own order), so the bound is a few bfloat16 steps of the terms' size."""
    fmt = FORMATS[name]
    n, k = 40, 512  # a partial column group, rows padded past one 32-row pass
    q = random_blocks(name, n, k, seed=11 + fmt.code)
    packed = cpu.pack_i8(q, fmt)
    exact = dequantize(q, fmt, k)
    for m in (1, 17, 45):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
        bias = torch.randn(n)
        got = cpu.quant_linear_bf16_i8(x, packed, fmt, n, bias)
        expect = reference.quant_linear_bf16(x, q, fmt, k, bias)
        size = x.abs() @ exact.abs().t()
        err = (got - expect).abs()
        assert bool((err <= 2e-5 * size + 1e-5).all()), (name, m, float((err / size).max()))
        # and bfloat16 is a real rounding: the exact product differs by more than float32 noise
        assert float(((got - (x @ exact.t() + bias)).abs() / size).max()) > 1e-4


@needs_bf16_tiles
def test_bf16_tiles_give_a_row_the_same_bits_alone_or_in_a_batch():
    fmt = FORMATS["Q6_K"]
    q = random_blocks("Q6_K", 48, 512, seed=3)
    packed = cpu.pack_i8(q, fmt)
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(4))
    together = cpu.quant_linear_bf16_i8(x, packed, fmt, 48)
    for i in (0, 15, 16, 33, 69):
        assert torch.equal(cpu.quant_linear_bf16_i8(x[i : i + 1], packed, fmt, 48)[0], together[i])
        assert torch.equal(cpu.quant_linear_bf16_i8(x[i : i + 20], packed, fmt, 48)[0], together[i])


@needs_bf16_tiles
def test_dispatch_sends_prompt_rows_to_the_tiles_and_the_rest_to_int8():
    from octavo.kernels.metadata import PromptRows

    fmt = FORMATS["Q4_K"]
    q = random_blocks("Q4_K", 32, 256, seed=9)
    weight, layout = dispatch.prepare_quant_weight(q, fmt, "int8")
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(10))
    rows = PromptRows.of(torch.tensor([False, True, True, False, True, False]))
    assert rows.select(torch.tensor([4, 0])).rows.tolist() == [0] and rows.select(torch.tensor([3, 5])) is None
    out = dispatch.quant_linear(x, weight, layout, fmt, 256, 32, None, rows)
    assert torch.equal(out[[1, 2, 4]], cpu.quant_linear_bf16_i8(x[[1, 2, 4]], weight, fmt, 32))
    assert torch.equal(out[[0, 3, 5]], cpu.quant_linear_i8(x[[0, 3, 5]], weight, fmt, 32))
    every = dispatch.quant_linear(x, weight, layout, fmt, 256, 32, None, PromptRows.of(torch.ones(6, dtype=torch.bool)))
    assert torch.equal(every, cpu.quant_linear_bf16_i8(x, weight, fmt, 32))


class _FakeTiles:
    """A kernels module whose AMX-BF16 self-test does what a CPU may do to it."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour

    def selftest(self) -> bool:
        import os
        import signal

        if self.behaviour == "sigill":
            os.kill(os.getpid(), signal.SIGILL)  # what a listed-but-faulting AMX unit does
        return self.behaviour == "pass"


@pytest.mark.parametrize("behaviour,expect", [("pass", None), ("wrong", "wrong products"), ("sigill", "died of SIGILL")])
def test_the_tiles_self_test_runs_in_a_child_that_may_die(behaviour, expect):
    """The probe forks: a SIGILL kills the child, never this process, and is reported by name."""
    assert cpu._selftest_in_fork(_FakeTiles(behaviour), "selftest") == expect
