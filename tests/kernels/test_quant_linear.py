"""Quantized linear kernels: the formats' definition equals gguf-py's, the C++ kernels equal the
torch reference on a grid of shapes (rows x columns x inputs, every format), and the packed layout
rebuilds every weight bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from octavo.kernels import cpu, dispatch, reference
from octavo.quantization import Q4_0, Q4_1, Q8_0, dequantize, quantize

needs_kernels = pytest.mark.skipif(cpu.load() is None, reason="the C++ CPU kernels are not built on this machine")
FMTS = [Q4_0, Q4_1, Q8_0]  # the formats Octavo quantizes into (K-quants: tests/kernels/test_k_quants.py)


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, :32] += 0.3  # a skewed block: Q4_1's min differs from -max
    return w


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_dequantize_is_gguf_py_bit_for_bit(fmt):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    q = quantize(weights(24, 96), fmt)
    ours = dequantize(q, fmt, 96)
    theirs = gguf_dequantize(q.numpy(), GGMLQuantizationType(fmt.gguf_type))
    assert np.array_equal(ours.numpy(), np.asarray(theirs, dtype=np.float32).reshape(24, 96))


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_quantize_error_is_within_half_a_step(fmt):
    w = weights(40, 128, seed=3)
    q = quantize(w, fmt)
    err = (dequantize(q, fmt, 128) - w).abs().reshape(40, 4, 32)
    blocks = w.reshape(40, 4, 32)
    amax = blocks.abs().amax(-1)
    # width of one level: Q8_0 max/127; Q4_1 (max - min)/15; Q4_0 max/8 (ggml maps the largest
    # magnitude to -8, so the far end can clamp at +7: up to a whole step there)
    step = {Q8_0: amax / 127, Q4_1: (blocks.amax(-1) - blocks.amin(-1)) / 15, Q4_0: amax / 8}[fmt]
    bound = step * (1.0 if fmt is Q4_0 else 0.5) * 1.01 + 1e-6  # + fp16 rounding of the scale
    assert bool((err.amax(-1) <= bound).all())
    assert q.dtype == torch.uint8 and q.shape == (40, fmt.row_bytes(128))


def test_quantize_refuses_widths_that_are_not_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 40), Q8_0)


@needs_kernels
@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100])
@pytest.mark.parametrize("k", [32, 96, 576])
def test_packed_layout_rebuilds_every_weight_exactly(fmt, n, k):
    q = quantize(weights(n, k), fmt)
    packed = cpu.pack(q, fmt)
    expect = dequantize(q, fmt, k)
    assert torch.equal(cpu.dequantize_rows(packed, fmt, torch.arange(n), k, n), expect)
    assert torch.equal(cpu.dequantize_transposed(packed, fmt, k, n), expect.t())
    rows = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert torch.equal(cpu.dequantize_rows(packed, fmt, rows, k, n), expect[rows])


@needs_kernels
@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
@pytest.mark.parametrize("n,k", [(1, 32), (16, 64), (17, 96), (100, 576), (33, 1536)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 17, 130])
def test_kernel_matches_reference(fmt, n, k, m):
    q = quantize(weights(n, k, seed=n + k), fmt)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    expect = reference.quant_linear(x, q, fmt, k)
    got = cpu.quant_linear(x, cpu.pack(q, fmt), fmt, n)
    torch.testing.assert_close(got, expect, atol=2e-5 * k**0.5, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("m", [1, 7, dispatch.REBUILD_MIN_ROWS + 3])
def test_dispatch_paths_match_reference_with_bias_and_non_float32(m):
    """Every dispatch path: factored kernel, rebuilt-weight GEMM (many rows), bf16 activations."""
    q = quantize(weights(48, 64), Q4_1)
    packed, layout = dispatch.prepare_quant_weight(q, Q4_1)
    assert layout == "packed"
    x, bias = torch.randn(m, 64), torch.randn(48)
    expect = reference.quant_linear(x, q, Q4_1, 64, bias)
    torch.testing.assert_close(dispatch.quant_linear(x, packed, layout, Q4_1, 64, 48, bias), expect, atol=1e-4, rtol=1e-4)
    xb = x.bfloat16()
    torch.testing.assert_close(
        dispatch.quant_linear(xb, packed, layout, Q4_1, 64, 48), reference.quant_linear(xb, q, Q4_1, 64), atol=0.05, rtol=0.02
    )
    ids = torch.tensor([3, 0, 47])
    assert torch.equal(dispatch.quant_embedding(ids, packed, layout, Q4_1, 64, 48, torch.float32), dequantize(q, Q4_1, 64)[ids])


@needs_kernels
def test_kernels_refuse_what_they_cannot_do():
    q = quantize(weights(16, 64), Q8_0)
    packed = cpu.pack(q, Q8_0)
    with pytest.raises(RuntimeError, match="float32"):
        cpu.quant_linear(torch.randn(2, 64).bfloat16(), packed, Q8_0, 16)
    with pytest.raises(RuntimeError, match="packed weight"):
        cpu.quant_linear(torch.randn(2, 96), packed, Q8_0, 16)  # wrong in_features
    with pytest.raises(RuntimeError, match="out of range"):
        cpu.dequantize_rows(packed, Q8_0, torch.tensor([16]), 64, 16)
    with pytest.raises(RuntimeError, match="whole blocks"):
        cpu.pack(q[:, :-1].contiguous(), Q8_0)
