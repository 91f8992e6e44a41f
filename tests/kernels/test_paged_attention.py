"""Paged attention equals dense causal attention over a grid of shapes (odd lengths, chunks that
start mid-block, block boundaries, spans longer than the CPU kernel's query tile, GQA ratios 1, 3
and 4, head dims on and off the vector width): the torch reference (with and without its reused
gather workspace) and the C++ CPU kernel, each against the dense oracle and against each other."""

import dataclasses
import shutil

import pytest
import torch

from octavo.kernels import cpu, dispatch
from octavo.kernels.metadata import AttentionMetadata, gather_contexts
from octavo.kernels.reference import copy_blocks, paged_attention, write_kv

ATOL = RTOL = 1e-5  # float32


def dense_attention(q, k, v, past: int, scale: float):
    """q: [n, H, d] at positions past..past+n-1; k, v: [past+n, kvh, d]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    n, length = q.shape[0], k.shape[0]
    mask = torch.arange(length)[None, :] <= (torch.arange(n)[:, None] + past)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def build_step(block_size, heads, kv_heads, d, lengths, seed=0):
    """A KV pool holding each request's cached prefix at scattered blocks, this step's keys
    written, and the step's metadata. `lengths` lists (tokens already cached, tokens now)."""
    torch.manual_seed(seed)
    num_blocks = 256
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, d)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks).tolist()
    reqs = []
    for past, new in lengths:
        total = past + new
        nb = -(-total // block_size)
        table, perm = perm[:nb], perm[nb:]
        k, v, q = torch.randn(total, kv_heads, d), torch.randn(total, kv_heads, d), torch.randn(new, heads, d)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(total)])
        write_kv(k_cache, v_cache, k[:past], v[:past], slots[:past])  # the cached prefix
        reqs.append((past, new, k, v, q, slots, table))
    order = sorted(range(len(reqs)), key=lambda i: reqs[i][1] != 1)  # decodes first
    max_blocks = max(len(reqs[i][6]) for i in order)
    starts, offset = [], 0
    for i in order:
        starts.append(offset)
        offset += reqs[i][1]
    meta = AttentionMetadata(
        slot_mapping=torch.cat([reqs[i][5][reqs[i][0] :] for i in order]),
        block_tables=torch.tensor([reqs[i][6] + [0] * (max_blocks - len(reqs[i][6])) for i in order], dtype=torch.int32),
        query_starts=torch.tensor(starts, dtype=torch.int32),
        query_lens=torch.tensor([reqs[i][1] for i in order], dtype=torch.int32),
        context_lens=torch.tensor([reqs[i][0] + reqs[i][1] for i in order], dtype=torch.int32),
        num_decode_tokens=sum(1 for i in order if reqs[i][1] == 1),
    )
    k_new = torch.cat([reqs[i][2][reqs[i][0] :] for i in order])
    v_new = torch.cat([reqs[i][3][reqs[i][0] :] for i in order])
    write_kv(k_cache, v_cache, k_new, v_new, meta.slot_mapping)
    q = torch.cat([reqs[i][4] for i in order])
    expected = torch.cat([dense_attention(reqs[i][4], reqs[i][2], reqs[i][3], reqs[i][0], d**-0.5) for i in order])
    return q, k_cache, v_cache, meta, expected


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
        dispatch.select_attention_backend("cpu", torch.device("cpu"), torch.bfloat16)
    assert dispatch.select_attention_backend("auto", torch.device("cpu"), torch.bfloat16) == "reference"
    with pytest.raises(ValueError, match="attention backend must be"):
        dispatch.select_attention_backend("flash", torch.device("cpu"), torch.float32)
    if cpu.load() is not None:
        assert dispatch.select_attention_backend("auto", torch.device("cpu"), torch.float32) == "cpu"


def test_copy_blocks_copies_every_layer():
    caches = [(torch.randn(4, 2, 1, 3), torch.randn(4, 2, 1, 3)) for _ in range(2)]
    copy_blocks(caches, [(1, 3)])
    for k, v in caches:
        assert torch.equal(k[3], k[1]) and torch.equal(v[3], v[1])
