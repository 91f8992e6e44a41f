"""Paged attention (the reference kernel) equals dense causal attention over a grid of shapes:
odd lengths, chunks that start mid-block, block boundaries, GQA ratios 1, 3 and 4."""

import pytest
import torch

from octavo.kernels.metadata import AttentionMetadata, PrefillSpan
from octavo.kernels.reference import copy_blocks, paged_attention, write_kv


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


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("lengths", [[(0, 1), (0, 13), (5, 3)], [(16, 1), (7, 9), (31, 1), (0, 17)]])
@pytest.mark.parametrize("workspace", [False, True])
def test_paged_matches_dense(block_size, heads, kv_heads, lengths, workspace):
    """`lengths` lists (tokens already cached, tokens computed now) per request."""
    torch.manual_seed(0)
    d, num_blocks = 8, 128
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
        reqs.append((past, new, k, v, q, slots))
    order = sorted(range(len(reqs)), key=lambda i: reqs[i][1] != 1)  # decodes first
    qs, new_slots, dec_slots, dec_lens, spans, offset = [], [], [], [], [], 0
    for i in order:
        past, new, k, v, q, slots = reqs[i]
        qs.append(q)
        new_slots.append(slots[past:])
        if new == 1:
            dec_slots.append(slots)
            dec_lens.append(past + 1)
        else:
            spans.append(PrefillSpan(offset, new, past + new, slots))
        offset += new
    max_len = max(dec_lens, default=0)
    padded = torch.zeros(len(dec_slots), max_len, dtype=torch.long)
    for j, s in enumerate(dec_slots):
        padded[j, : len(s)] = s
    meta = AttentionMetadata(
        slot_mapping=torch.cat(new_slots),
        num_decode_tokens=len(dec_slots),
        decode_slots=padded,
        decode_mask=torch.arange(max_len)[None, :] < torch.tensor(dec_lens, dtype=torch.long)[:, None],
        prefills=spans,
        decode_workspace=(torch.full((10_000,), float("nan")), torch.full((10_000,), float("nan"))) if workspace else None,
    )
    k_new = torch.cat([reqs[i][2][reqs[i][0]:] for i in order])
    v_new = torch.cat([reqs[i][3][reqs[i][0]:] for i in order])
    write_kv(k_cache, v_cache, k_new, v_new, meta.slot_mapping)
    out = paged_attention(torch.cat(qs), k_cache, v_cache, meta, scale=d**-0.5)
    offset = 0
    for i in order:
        past, new, k, v, q, _ = reqs[i]
        torch.testing.assert_close(out[offset : offset + new], dense_attention(q, k, v, past, d**-0.5), atol=1e-5, rtol=1e-5)
        offset += new


def test_copy_blocks_copies_every_layer():
    caches = [(torch.randn(4, 2, 1, 3), torch.randn(4, 2, 1, 3)) for _ in range(2)]
    copy_blocks(caches, [(1, 3)])
    for k, v in caches:
        assert torch.equal(k[3], k[1]) and torch.equal(v[3], v[1])
