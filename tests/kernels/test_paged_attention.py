"""Paged attention equals dense causal attention over a grid of shapes (odd lengths, chunks that
start mid-block, block boundaries, spans longer than the CPU kernel's query tile, GQA ratios 1, 3
and 4, head dims on and off the vector width): the torch reference (with and without its reused
gather workspace) and the C++ CPU kernel, each against the dense oracle and against each other."""

import dataclasses
import shutil

import pytest
import torch

from octavo.kernels import cpu, dispatch
from octavo.kernels.metadata import gather_contexts
from octavo.kernels.reference import copy_blocks, paged_attention
from tests.kernels.paged_steps import build_step

ATOL = RTOL = 1e-5  # float32


LENGTHS = [
    [(0, 1), (0, 13), (5, 3)],
    [(16, 1), (7, 9), (31, 1), (0, 17)],
    [(100, 1), (3, 40), (0, 1), (33, 35)],  # spans longer than the CPU kernel's query tile
]
GRID = pytest.mark.parametrize("lengths", LENGTHS)
SHAPES = pytest.mark.parametrize("heads, kv_heads, d", [(4, 4, 8), (9, 3, 64), (8, 2, 12), (4, 2, 128)])
BLOCKS = pytest.mark.parametrize("block_size", [1, 4, 16])


def cpu_kernel_or_skip():
    if cpu.load() is None:
        if shutil.which("c++") is None:
            pytest.skip("no C++ compiler on this machine")
        pytest.fail("the CPU kernel failed to build although a compiler exists (see the log)")


@BLOCKS
@SHAPES
@GRID
@pytest.mark.parametrize("workspace", [None, "reused"])
def test_reference_matches_dense(block_size, heads, kv_heads, d, lengths, workspace):
    q, k_cache, v_cache, meta, expected = build_step(block_size, heads, kv_heads, d, lengths)
    if workspace:  # a too-large scratch full of NaN: only the gathered part may be read
        scratch = (torch.full((200_000,), float("nan")), torch.full((200_000,), float("nan")))
        meta.gathered = gather_contexts(meta, block_size, scratch)
    out = paged_attention(q, k_cache, v_cache, meta, scale=d**-0.5)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


@BLOCKS
@SHAPES
@GRID
def test_cpu_kernel_matches_dense_and_reference(block_size, heads, kv_heads, d, lengths):
    cpu_kernel_or_skip()
    q, k_cache, v_cache, meta, expected = build_step(block_size, heads, kv_heads, d, lengths)
    meta.backend = "cpu"
    out = dispatch.paged_attention(q, k_cache, v_cache, meta, scale=d**-0.5)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out, paged_attention(q, k_cache, v_cache, meta, scale=d**-0.5), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("tile", [1, 2, 3, 16])
@pytest.mark.parametrize("window", [None, 37])
def test_cpu_kernel_any_query_tile(tile, window, monkeypatch):
    """Tiles smaller than a span (a few query tokens per work item: a speculative step's 1 + k
    tokens spread over the threads) give the same result."""
    cpu_kernel_or_skip()
    assert (cpu.q_tile(5, 2), cpu.q_tile(1, 2), cpu.q_tile(4096, 2)) == (3, 1, cpu.Q_TILE)
    monkeypatch.setattr(cpu, "q_tile", lambda num_tokens, num_threads: tile)
    q, k_cache, v_cache, meta, _ = build_step(16, 9, 3, 64, [(100, 5), (3, 40), (33, 35), (70, 9)])
    meta.backend = "cpu"
    out = dispatch.paged_attention(q, k_cache, v_cache, meta, scale=0.125, window=window)
    want = paged_attention(q, k_cache, v_cache, dataclasses.replace(meta, backend="reference"), scale=0.125, window=window)
    torch.testing.assert_close(out, want, atol=ATOL, rtol=RTOL)


WINDOW_LENGTHS = pytest.mark.parametrize("lengths", [
    [(0, 1), (0, 13), (5, 3), (40, 1)],
    [(100, 1), (3, 40), (33, 35), (70, 9)],  # spans longer than the window and than the CPU query tile
])


@pytest.mark.parametrize("window", [1, 5, 16, 37])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads, kv_heads, d", [(4, 1, 8), (9, 3, 64), (4, 2, 256)])
@WINDOW_LENGTHS
def test_sliding_window_matches_dense_and_never_reads_outside(window, block_size, heads, kv_heads, d, lengths):
    """Sliding-window attention (keys p - window + 1 .. p) equals the dense masked form; blocks
    wholly before the window hold NaN, so a kernel that read them would fail."""
    q, k_cache, v_cache, meta, expected = build_step(block_size, heads, kv_heads, d, lengths, window=window)
    out = paged_attention(q, k_cache, v_cache, meta, d**-0.5, window)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    if cpu.load() is not None:
        meta.backend = "cpu"
        out = dispatch.paged_attention(q, k_cache, v_cache, meta, d**-0.5, window)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("softcap, with_sinks", [(1.5, False), (None, True), (2.0, True)])
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads, kv_heads, d", [(4, 1, 8), (9, 3, 64)])
def test_soft_capping_and_sinks_match_dense(softcap, with_sinks, window, block_size, heads, kv_heads, d):
    """Gemma 2's soft-capped scores and gpt-oss's per-head sinks, in the reference (decode rows and
    spans) and the C++ kernel, with and without a window, equal the dense form (the scores
    q . k / sqrt(d) are about N(0, 1) here: a cap of 1.5 bends most of them)."""
    sinks = torch.randn(heads) * 2 if with_sinks else None
    q, k_cache, v_cache, meta, expected = build_step(block_size, heads, kv_heads, d, WINDOW_LENGTHS_SPANS, window=window,
                                                     softcap=softcap, sinks=sinks)
    plain = build_step(block_size, heads, kv_heads, d, WINDOW_LENGTHS_SPANS, window=window)[-1]
    assert (expected - plain).abs().max() > 0.05  # the cap and the sinks change the result
    out = paged_attention(q, k_cache, v_cache, meta, d**-0.5, window, softcap, sinks)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    if cpu.load() is not None:
        meta.backend = "cpu"
        out = dispatch.paged_attention(q, k_cache, v_cache, meta, d**-0.5, window, softcap, sinks)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


WINDOW_LENGTHS_SPANS = [(0, 1), (40, 1), (3, 40), (33, 35), (70, 9)]


def test_cpu_kernel_rejects_what_it_cannot_do():
    cpu_kernel_or_skip()
    q, k_cache, v_cache, meta, _ = build_step(4, 4, 4, 8, LENGTHS[0])
    meta.backend = "cpu"
    with pytest.raises(RuntimeError, match="float32"):
        dispatch.paged_attention(q.double(), k_cache, v_cache, meta, scale=1.0)
    bad_table = meta.block_tables.clone()
    bad_table[0, 0] = k_cache.shape[0]  # one past the pool: refused, never read
    with pytest.raises(RuntimeError, match="outside the pool"):
        dispatch.paged_attention(q, k_cache, v_cache, dataclasses.replace(meta, block_tables=bad_table), scale=1.0)
    meta.context_lens = meta.context_lens + 100  # more keys than the block table holds
    with pytest.raises(RuntimeError, match="block table too short"):
        dispatch.paged_attention(q, k_cache, v_cache, meta, scale=1.0)


def test_backend_selection():
    assert dispatch.select_attention_backend("reference", torch.device("cpu"), torch.float32) == "reference"
    with pytest.raises(ValueError, match="float32"):
        dispatch.select_attention_backend("cpu", torch.device("cpu"), torch.bfloat16, torch.bfloat16)
    assert dispatch.select_attention_backend("auto", torch.device("cpu"), torch.bfloat16, torch.bfloat16) == "reference"
    with pytest.raises(ValueError, match="attention backend must be"):
        dispatch.select_attention_backend("flash", torch.device("cpu"), torch.float32)
    if cpu.load() is not None:
        assert dispatch.select_attention_backend("auto", torch.device("cpu"), torch.float32) == "cpu"


def test_copy_blocks_copies_every_layer():
    caches = [(torch.randn(4, 2, 1, 3), torch.randn(4, 2, 1, 3)) for _ in range(2)]
    copy_blocks(caches, [(1, 3)])
    for k, v in caches:
        assert torch.equal(k[3], k[1]) and torch.equal(v[3], v[1])


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("heads, kv_heads, d", [(8, 2, 64), (9, 3, 32), (4, 4, 16)])
def test_items_split_by_kv_head_change_no_bit(window, heads, kv_heads, d):
    """Work items split by KV head (one user's decode spread over the threads): the same output bit
    for bit as a tile's heads in one item, and the dense attention's within tolerance."""
    cpu_kernel_or_skip()
    q, k_cache, v_cache, meta, expected = build_step(16, heads, kv_heads, d, [(100, 1), (3, 40), (0, 70), (50, 9)],
                                                     window=window)
    split = cpu.paged_attention(q, k_cache, v_cache, meta, d**-0.5, window=window, split_kv_heads=True)
    whole = cpu.paged_attention(q, k_cache, v_cache, meta, d**-0.5, window=window, split_kv_heads=False)
    assert torch.equal(split, whole)
    torch.testing.assert_close(split, expected, atol=ATOL, rtol=RTOL)
