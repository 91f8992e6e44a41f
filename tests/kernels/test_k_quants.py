"""Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and MXFP4 blocks dequantized by octavo.quantization equal gguf-py's
dequantization bit for bit, on a grid of shapes, from random block bytes (every bit pattern a
file may hold, fp16 scales kept finite) and from gguf-py's own quantizer where it has one; the C++
kernels' packed layout rebuilds every weight bit for bit, and their products equal the torch
reference's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from octavo.kernels import cpu, dispatch, reference
from octavo.quantization import K_FORMATS, QuantFormat as BlockFormat, dequantize_k

SHAPES = [(1, 256), (3, 512), (16, 1024), (7, 2560)]

# where each format keeps its fp16 values, as (offset, count) within a block
FP16_AT = {"Q5_0": [(0, 1)], "Q5_1": [(0, 2)], "Q4_K": [(0, 2)], "Q5_K": [(0, 2)], "Q6_K": [(208, 1)], "MXFP4": []}


def random_blocks(fmt: BlockFormat, rows: int, cols: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    nb = cols // fmt.block_size
    blocks = g.integers(0, 256, size=(rows, nb, fmt.block_bytes), dtype=np.uint8)
    for offset, count in FP16_AT[fmt.name]:  # finite scales: random bytes could be inf or NaN
        values = g.uniform(-0.05, 0.05, size=(rows, nb, count)).astype(np.float16)
        blocks[..., offset : offset + 2 * count] = values.view(np.uint8)
    if fmt.name == "MXFP4":  # exponents of weights up to ~2^13 and down to ~2^-28 (every one: test_mxfp4_...)
        blocks[..., 0] = g.integers(100, 141, size=(rows, nb), dtype=np.uint8)
    return blocks.reshape(rows, nb * fmt.block_bytes)


@pytest.mark.parametrize("name", sorted(K_FORMATS))
@pytest.mark.parametrize("shape", SHAPES)
def test_random_blocks_dequantize_as_gguf_py_does(name, shape):
    fmt = K_FORMATS[name]
    rows, cols = shape
    blocks = random_blocks(fmt, rows, cols, seed=rows * 7 + cols)
    expected = np.asarray(gguf_dequantize(blocks, GGMLQuantizationType(fmt.gguf_type)), dtype=np.float32)
    got = dequantize_k(torch.from_numpy(blocks), fmt, cols).numpy()
    assert got.shape == (rows, cols)
    np.testing.assert_array_equal(got.view(np.uint32), expected.reshape(rows, cols).view(np.uint32))


@pytest.mark.parametrize("name", ["Q5_0", "Q5_1"])
def test_gguf_quantized_weights_dequantize_as_gguf_py_does(name):
    fmt = K_FORMATS[name]
    w = np.random.default_rng(3).normal(size=(8, 512)).astype(np.float32)
    blocks = gguf_quantize(w, GGMLQuantizationType(fmt.gguf_type))
    expected = np.asarray(gguf_dequantize(blocks, GGMLQuantizationType(fmt.gguf_type)), dtype=np.float32)
    got = dequantize_k(torch.from_numpy(np.ascontiguousarray(blocks)), fmt, 512).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    assert np.abs(got - w).max() < 0.2  # and the weights are near what was quantized


def test_a_changed_bit_changes_the_weight():
    """The comparison is not vacuous: one flipped high bit of a Q5_K weight moves it by 16 steps."""
    fmt = K_FORMATS["Q5_K"]
    blocks = random_blocks(fmt, 1, 256, seed=0)
    before = dequantize_k(torch.from_numpy(blocks.copy()), fmt, 256)
    blocks[0, 16] ^= 0x01  # qh byte 0, bit 0: sub-block 0, weight 0
    after = dequantize_k(torch.from_numpy(blocks), fmt, 256)
    changed = (before != after).nonzero().tolist()
    assert changed == [[0, 0]]


needs_kernels = pytest.mark.skipif(cpu.load() is None, reason="the C++ CPU kernels are not built on this machine")


@needs_kernels
@pytest.mark.parametrize("name", sorted(K_FORMATS))
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100])
@pytest.mark.parametrize("k", [256, 768])
def test_packed_layout_rebuilds_every_weight_bit_for_bit(name, n, k):
    fmt = K_FORMATS[name]
    q = torch.from_numpy(random_blocks(fmt, n, k, seed=n + k))
    packed = cpu.pack(q, fmt)
    expect = dequantize_k(q, fmt, k).view(torch.int32)  # bits, not values: -0.0 is not 0.0 here
    assert torch.equal(cpu.dequantize_rows(packed, fmt, torch.arange(n), k, n).view(torch.int32), expect)
    assert torch.equal(cpu.dequantize_transposed(packed, fmt, k, n).contiguous().view(torch.int32), expect.t().contiguous())
    rows = torch.tensor([n - 1, 0, n // 2])
    assert torch.equal(cpu.dequantize_rows(packed, fmt, rows, k, n).view(torch.int32), expect[rows])
    # bytes per weight and row held: the K-quants' file blocks with 6-bit scales and mins widened to
    # a byte each (Q6_K, Q5_0, Q5_1: exactly the file's)
    g = cpu.load().pack_width()
    per_weight = {"Q4_K": 148 / 256, "Q5_K": 180 / 256, "Q6_K": 210 / 256, "Q5_0": 22 / 32, "Q5_1": 24 / 32,
                  "MXFP4": 17 / 32}[name]
    assert packed.numel() == -(-n // g) * g * k * per_weight


@needs_kernels
@pytest.mark.parametrize("name", sorted(K_FORMATS))
@pytest.mark.parametrize("n,k", [(1, 256), (16, 512), (17, 256), (100, 1024)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 17, 130])
def test_kernel_matches_reference(name, n, k, m):
    fmt = K_FORMATS[name]
    q = torch.from_numpy(random_blocks(fmt, n, k, seed=n * k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    expect = reference.quant_linear(x, q, fmt, k)
    got = dispatch.quant_linear(x, cpu.pack(q, fmt), "packed", fmt, k, n)  # m >= 128: the rebuild + GEMM path
    # random blocks give weights up to ~100 whose products cancel: the summation order (the kernel
    # sums each sub-block in two chains, GEMM libraries otherwise) moves a result by float32
    # rounding of the terms' size, |x| @ |w|^T, not of the result's; a wrong block is off by that size
    size = x.abs() @ dequantize_k(q, fmt, k).abs().t()
    err = (got - expect).abs()
    assert bool((err <= 1e-5 * size + 1e-5).all()), float((err / size).max())


@needs_kernels
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", *sorted(K_FORMATS)])
@pytest.mark.parametrize("pack", ["pack", "pack_i8"])
def test_a_fused_layer_packs_from_its_parts_as_from_their_stack(name, pack):
    """A fused projection's parts are packed where they lie (no stacked copy): the tiles equal those
    of the stacked blocks, across parts whose rows do not fill a group of the layout."""
    from octavo.quantization import FORMATS
    fmt = {**FORMATS, **K_FORMATS}[name]
    q = torch.from_numpy(random_blocks(fmt, 37, 512, seed=5)) if name in K_FORMATS else \
        torch.randint(0, 256, (37, 16 * fmt.block_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    parts = [q[:17], q[17:22], q[22:]]
    packed = getattr(cpu, pack)(parts, fmt)
    assert torch.equal(packed, getattr(cpu, pack)(q, fmt))
    with pytest.raises(RuntimeError, match="rows of the same bytes"):
        getattr(cpu, pack)([q, q[:, : q.shape[1] // 2]], fmt)


def test_mxfp4_every_exponent_dequantizes_as_gguf_py_does():
    """All 256 E8M0 exponents (2^-128 and 2^-127 are subnormal floats, 255 is 2^127, not NaN) and
    all 16 codes, in the torch reference and in the C++ kernels' rebuild of their packed layout."""
    fmt = K_FORMATS["MXFP4"]
    codes = np.arange(16, dtype=np.uint8)
    qs = codes | (codes[::-1] << 4)  # weight j: code j, weight j + 16: code 15 - j
    blocks = np.concatenate([np.arange(256, dtype=np.uint8)[:, None], np.tile(qs, (256, 1))], axis=1)  # [256, 17]
    blocks = blocks.reshape(32, 8 * 17)  # 32 rows of 8 blocks
    with np.errstate(over="ignore"):  # 12 * 2^127 is inf in gguf-py's float32 product, as in ours
        expected = np.asarray(gguf_dequantize(blocks, GGMLQuantizationType.MXFP4), dtype=np.float32).reshape(32, 256)
    got = dequantize_k(torch.from_numpy(blocks.copy()), fmt, 256)
    np.testing.assert_array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))
    assert np.isinf(expected).any() and (expected[expected != 0] != 0).all()  # both ends reached
    if cpu.load() is not None:
        packed = cpu.pack(torch.from_numpy(blocks.copy()), fmt)
        assert torch.equal(cpu.dequantize_rows(packed, fmt, torch.arange(32), 256, 32).view(torch.int32),
                           got.view(torch.int32))
        assert torch.equal(cpu.dequantize_transposed(packed, fmt, 256, 32).contiguous().view(torch.int32),
                           got.t().contiguous().view(torch.int32))
