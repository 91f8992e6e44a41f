"""Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks dequantized by octavo.quantization_k equal gguf-py's
dequantization bit for bit, on a grid of shapes, from random block bytes (every bit pattern a
file may hold, fp16 scales kept finite) and from gguf-py's own quantizer where it has one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from octavo.quantization_k import K_FORMATS, BlockFormat, dequantize_k

SHAPES = [(1, 256), (3, 512), (16, 1024), (7, 2560)]

# where each format keeps its fp16 values, as (offset, count) within a block
FP16_AT = {"Q5_0": [(0, 1)], "Q5_1": [(0, 2)], "Q4_K": [(0, 2)], "Q5_K": [(0, 2)], "Q6_K": [(208, 1)]}


def random_blocks(fmt: BlockFormat, rows: int, cols: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    nb = cols // fmt.block_size
    blocks = g.integers(0, 256, size=(rows, nb, fmt.block_bytes), dtype=np.uint8)
    for offset, count in FP16_AT[fmt.name]:  # finite scales: random bytes could be inf or NaN
        values = g.uniform(-0.05, 0.05, size=(rows, nb, count)).astype(np.float16)
        blocks[..., offset : offset + 2 * count] = values.view(np.uint8)
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
