"""KV caches held in fewer bytes (kernels/kv_format.py): the int8 rows' quantization, the C++ write
(same bytes as the torch reference) and the C++ paged attention reading each dtype in place (equal
to the torch reference over the same stored cache, and within the format's error of float32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from octavo.config import KV_CACHE_DTYPES, ModelConfig, RopeConfig
from octavo.kernels import cpu, dispatch, kv_format, reference
from tests.kernels.paged_steps import build_step

QUANTIZED = ["bfloat16", "float16", "int8"]
needs_kernels = pytest.mark.skipif(cpu.load() is None, reason="the C++ CPU kernels are not built on this machine")


@pytest.mark.parametrize("head_dim", [64, 80, 12, 128])
def test_int8_rows_hold_values_within_half_a_step_of_their_group(head_dim):
    """A float16 scale per 32 values (the last group shorter where head_dim is not a multiple)."""
    torch.manual_seed(head_dim)
    x = torch.randn(5, 3, head_dim) * torch.logspace(-3, 2, 5)[:, None, None]  # rows of very different sizes
    x[2, 1] = 0.0  # a zero row: scale 0, zeros back, no NaN
    x[4, 2, : min(32, head_dim)] *= 100  # one group far larger than the rest of its row
    rows = kv_format.quantize_rows(x, "int8")
    groups = -(-head_dim // 32)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, head_dim + 2 * groups)
    assert kv_format.head_dim_of(rows) == head_dim
    back = kv_format.dequantize_rows(rows)
    for g in range(groups):
        part = slice(32 * g, min(32 * (g + 1), head_dim))
        scale = (x[..., part].abs().amax(-1, keepdim=True) / 127).half().float()
        assert torch.all((back[..., part] - x[..., part]).abs() <= scale / 2 * 1.01 + 1e-30)
    assert torch.equal(back[2, 1], torch.zeros(head_dim))
    assert rows[..., :head_dim].abs().max() == 127  # a group's largest value uses the whole range


def test_bytes_per_token_and_block():
    """SmolLM2-135M's shape (30 layers, 3 KV heads of 64): 46,080 bytes a token in float32."""
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                      rope=RopeConfig(theta=100000.0), max_position=8192)
    sizes = {name: cfg.kv_bytes_per_token(name) for name in KV_CACHE_DTYPES}
    assert sizes == {"float32": 46080, "bfloat16": 23040, "float16": 23040, "int8": 2 * 30 * 3 * (64 + 2 * 2)}
    assert sizes["int8"] / sizes["float32"] <= 0.27
    assert cfg.kv_bytes_per_block(16, "int8") == 16 * sizes["int8"]  # one KV group: a block spans every layer
    # a cache tensor of each dtype holds exactly those bytes
    for name in KV_CACHE_DTYPES:
        t = torch.empty(2, 16, 3, kv_format.row_elements(kv_format.storage_dtype(name), 64),
                        dtype=kv_format.storage_dtype(name))
        assert t.numel() * t.element_size() * 2 * 30 == 2 * 16 * sizes[name]


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["float32", *QUANTIZED])
@pytest.mark.parametrize("heads, kv_heads, d", [(9, 3, 64), (4, 2, 128), (4, 4, 12)])
def test_cpu_kv_write_stores_the_reference_bytes(kv_dtype, heads, kv_heads, d):
    """cos 1, sin 0 leaves k unrotated in both, so the rows written must be the same bytes."""
    torch.manual_seed(d)
    n = 7
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d) * 3
    qkv[0, -1], qkv[1, -2] = 1e6, -7e4  # past float16's range: held as +-65504 by both
    cos, sin = torch.ones(n, d), torch.zeros(n, d)
    slots = torch.randperm(40)[:n]
    dtype = kv_format.storage_dtype(kv_dtype)
    row = kv_format.row_elements(dtype, d)
    caches = [(torch.zeros(10, 4, kv_heads, row, dtype=dtype), torch.zeros(10, 4, kv_heads, row, dtype=dtype))
              for _ in range(2)]
    reference.rotary_write_kv(qkv.clone(), cos, sin, *caches[0], slots, heads, kv_heads)
    cpu.rotary_write_kv(qkv.clone(), cos, sin, *caches[1], slots, heads, kv_heads)
    for want, got in zip(caches[0], caches[1]):
        assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))


def quantized_step(kv_dtype, block_size, heads, kv_heads, d, lengths, **kw):
    """build_step's step with its pool re-held in `kv_dtype` (each row stored as kv_format stores it)."""
    q, k_cache, v_cache, meta, expected = build_step(block_size, heads, kv_heads, d, lengths, **kw)
    return q, kv_format.quantize_rows(k_cache, kv_dtype), kv_format.quantize_rows(v_cache, kv_dtype), meta, expected


# how far attention over each stored dtype may be from float32 attention on these N(0, 1) inputs
FORMAT_ATOL = {"bfloat16": 3e-2, "float16": 4e-3, "int8": 5e-2}


@needs_kernels
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("heads, kv_heads, d", [(9, 3, 64), (8, 2, 12), (4, 2, 128), (4, 2, 80)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_cpu_kernel_reads_each_dtype_as_the_reference_does(kv_dtype, heads, kv_heads, d, block_size):
    lengths = [(100, 1), (3, 40), (0, 1), (33, 35), (16, 1)]
    q, k_cache, v_cache, meta, expected = quantized_step(kv_dtype, block_size, heads, kv_heads, d, lengths)
    want = reference.paged_attention(q, k_cache, v_cache, meta, scale=d**-0.5)
    meta.backend = "cpu"
    got = dispatch.paged_attention(q, k_cache, v_cache, meta, scale=d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, expected, atol=FORMAT_ATOL[kv_dtype], rtol=0)


@needs_kernels
@pytest.mark.parametrize("window, softcap, sinks", [(37, None, False), (None, 30.0, True)])
def test_int8_cache_with_windows_softcaps_and_sinks(window, softcap, sinks):
    heads, kv_heads, d = 8, 2, 64
    sink_logits = torch.randn(heads) if sinks else None
    q, k_cache, v_cache, meta, _ = quantized_step("int8", 16, heads, kv_heads, d, [(100, 1), (3, 40), (70, 9)],
                                                  window=window, softcap=softcap, sinks=sink_logits)
    kw = dict(scale=d**-0.5, window=window, softcap=softcap, sinks=sink_logits)
    want = reference.paged_attention(q, k_cache, v_cache, meta, **kw)
    got = dispatch.paged_attention(q, k_cache, v_cache, dataclasses.replace(meta, backend="cpu"), **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_kernels
def test_int8_items_split_by_kv_head_change_no_bit():
    q, k_cache, v_cache, meta, _ = quantized_step("int8", 16, 8, 2, 64, [(100, 1), (3, 40), (0, 70)])
    split = cpu.paged_attention(q, k_cache, v_cache, meta, 0.125, split_kv_heads=True)
    whole = cpu.paged_attention(q, k_cache, v_cache, meta, 0.125, split_kv_heads=False)
    assert torch.equal(split, whole)


def test_attention_backend_for_each_kv_dtype():
    for name in KV_CACHE_DTYPES:
        dtype = kv_format.storage_dtype(name)
        want = "cpu" if cpu.load() is not None else "reference"
        assert dispatch.select_attention_backend("auto", torch.device("cpu"), dtype) == want
    with pytest.raises(ValueError, match="float32 activations"):
        dispatch.select_attention_backend("cpu", torch.device("cpu"), torch.int8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kv cache dtype must be one of"):
        kv_format.storage_dtype("int4")


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["float32", *QUANTIZED])
@pytest.mark.parametrize("group, d", [(2, 64), (3, 64), (4, 64), (5, 32), (7, 64), (8, 128), (16, 64), (4, 256), (3, 80)])
def test_a_kv_heads_query_heads_read_it_together_as_each_would_alone(kv_dtype, group, d):
    """The kernel reads each key and value once for all the query heads that share its KV head (up
    to eight at a time). The same step with every KV head repeated per query head (one query head a
    KV head: each row read alone) must give the same output: the same bits where the one-row path
    has the vector code (head_dim 32, 64, 128), within float rounding elsewhere."""
    kv_heads = 2
    lengths = [(100, 1), (7, 1), (3, 40), (33, 35)]
    q, k_cache, v_cache, meta, _ = quantized_step(kv_dtype, 16, group * kv_heads, kv_heads, d, lengths)
    grouped = cpu.paged_attention(q, k_cache, v_cache, meta, d**-0.5)
    k_alone, v_alone = (c.repeat_interleave(group, dim=2).contiguous() for c in (k_cache, v_cache))
    alone = cpu.paged_attention(q, k_alone, v_alone, meta, d**-0.5)
    if d in (32, 64, 128):
        assert torch.equal(grouped, alone)
    else:
        torch.testing.assert_close(grouped, alone, atol=1e-6, rtol=1e-6)
