"""Paged-attention steps for kernel tests and scripts/gpu_check.py: a KV pool with each request's
prefix at scattered blocks, the step's metadata, and the dense attention it must equal (no pytest
import, so the GPU check can use it on a box without pytest)."""

from __future__ import annotations

import torch

from octavo.kernels.metadata import AttentionMetadata
from octavo.kernels.reference import write_kv


def dense_attention(q, k, v, past: int, scale: float, window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None):
    """q: [n, H, d] at positions past..past+n-1; k, v: [past+n, kvh, d]; with a window, the query
    at position p sees keys p - window + 1 .. p; `softcap`: scores become softcap * tanh(s / softcap);
    `sinks` [H]: one more logit per head in the softmax, with no value."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    n, length = q.shape[0], k.shape[0]
    rows = torch.arange(n)[:, None] + past
    mask = torch.arange(length)[None, :] <= rows
    if window is not None:
        mask &= torch.arange(length)[None, :] > rows - window
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)
    column = sinks[:, None, None].expand(-1, n, 1)
    probs = torch.cat((scores, column), dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hnl,lhd->nhd", probs, v)


def build_step(block_size, heads, kv_heads, d, lengths, seed=0, window=None, softcap=None, sinks=None):
    """A KV pool holding each request's cached prefix at scattered blocks, this step's keys
    written, and the step's metadata. `lengths` lists (tokens already cached, tokens now). With a
    `window`, the expected output is sliding-window attention, and each block table entry wholly
    before its request's first query's window points at the pool's last block, filled with NaN
    (a block a windowed cache has given back: a kernel that reads it fails)."""
    torch.manual_seed(seed)
    num_blocks = max(256, sum(-(-(past + new) // block_size) for past, new in lengths) + 8)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, d)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks - (window is not None)).tolist()  # the NaN block is nobody's
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
    if window is not None:
        k_cache[-1], v_cache[-1] = float("nan"), float("nan")
        for row, i in enumerate(order):
            gone = max(0, reqs[i][0] + 1 - window) // block_size  # blocks before the first query's window
            meta.block_tables[row, :gone] = num_blocks - 1
    q = torch.cat([reqs[i][4] for i in order])
    expected = torch.cat(
        [dense_attention(reqs[i][4], reqs[i][2], reqs[i][3], reqs[i][0], d**-0.5, window, softcap, sinks) for i in order]
    )
    return q, k_cache, v_cache, meta, expected
