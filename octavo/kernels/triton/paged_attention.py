"""Paged attention for one mixed batch in Triton: decode rows and prefill chunks through block tables.

Same contract as `kernels.reference.paged_attention`. One program takes BLOCK_Q query tokens of one
request and the GROUP query heads that share one KV head (the rows of its tiles are
token-major: row r is token r // GROUP_P, head r % GROUP_P), and walks the request's keys TILE_N
at a time, looking each key's block up in the block table (so any cache block size works),
with an online softmax. Causal: the query at absolute position p sees keys 0..p, or with a
sliding window keys p - window + 1 .. p (tiles wholly before the window are skipped, never read).
Soft-capping (Gemma 2) applies softcap * tanh(s / softcap) to each score; a head's sink (gpt-oss)
is folded into the softmax's denominator after the last tile (in the merge, split-KV).

`paged_attention_split_kv` is the flash-decoding variant for decode-only steps with long
contexts and few (request, KV head) pairs: each program covers one slice of the keys, and a
second kernel merges the slices by their log-sum-exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.metadata import AttentionMetadata
from octavo.kernels.triton import is_interpreted, next_pow2

TILE_N = 32  # keys per inner iteration (tl.dot needs >= 16 on GPUs)


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, q_pos, window, first_key, key_start, num_keys, seq, kvh,
    k_cache_ptr, v_cache_ptr, block_tables_ptr, stride_bt,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    scale, softcap, d, d_ok,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One TILE_N slice of keys [key_start, key_start + TILE_N) folded into the running softmax.
    Keys before `first_key` (outside every row's window) are never loaded: their blocks may be gone.
    UPCAST: feed tl.dot float32 (the interpreter's half-precision dot is wrong)."""
    n = key_start + tl.arange(0, TILE_N)
    n_ok = (n < num_keys) & (n >= first_key)
    block_id = tl.load(block_tables_ptr + seq * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    offset = n % BLOCK_SIZE
    k = tl.load(
        k_cache_ptr + block_id[None, :] * stride_kb + offset[None, :] * stride_ks + kvh * stride_kh + d[:, None],
        mask=n_ok[None, :] & d_ok[:, None], other=0.0,
    )  # [HEAD_DIM_P, TILE_N]
    if UPCAST:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, TILE_N]
    if SOFTCAP:  # softcap * tanh(s / softcap), tanh written with exp (1 - 2 / (e^2x + 1): saturates cleanly)
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    visible = (n[None, :] <= q_pos[:, None]) & (n[None, :] > q_pos[:, None] - window) & n_ok[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see no key yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    v = tl.load(
        v_cache_ptr + block_id[:, None] * stride_vb + offset[:, None] * stride_vs + kvh * stride_vh + d[None, :],
        mask=n_ok[:, None] & d_ok[None, :], other=0.0,
    )  # [TILE_N, HEAD_DIM_P]
    p_v = p.to(v.dtype)
    if UPCAST:
        p_v = p_v.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc


@triton.jit
def _unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, sinks_ptr,
    block_tables_ptr, query_starts_ptr, query_lens_ptr, context_lens_ptr,
    scale, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_len = tl.load(query_lens_ptr + seq)
    if q_tile * BLOCK_Q < q_len:
        q_start = tl.load(query_starts_ptr + seq)
        context_len = tl.load(context_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_Q * GROUP_P)
        q_idx = q_tile * BLOCK_Q + rows // GROUP_P  # token within the request's queries
        head = kvh * GROUP + rows % GROUP_P
        row_ok = (q_idx < q_len) & (rows % GROUP_P < GROUP)
        d = tl.arange(0, HEAD_DIM_P)
        d_ok = d < HEAD_DIM
        token = (q_start + q_idx).to(tl.int64)
        q = tl.load(
            q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :], other=0.0,
        )  # [BLOCK_M, HEAD_DIM_P]
        q_pos = context_len - q_len + q_idx  # absolute position of each row's token
        last = tl.minimum(q_len, (q_tile + 1) * BLOCK_Q) - 1
        num_keys = context_len - q_len + last + 1  # the tile's last token sees keys 0..its position
        m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_P, HEAD_DIM_P], tl.float32)
        first_key = tl.maximum(context_len - q_len + q_tile * BLOCK_Q - window + 1, 0)  # the tile's first row's
        for key_start in range(first_key // TILE_N * TILE_N, num_keys, TILE_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, q_pos, window, first_key, key_start, num_keys, seq, kvh,
                k_cache_ptr, v_cache_ptr, block_tables_ptr, stride_bt,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                scale, softcap, d, d_ok, BLOCK_SIZE, TILE_N, DOT_PRECISION, UPCAST, SOFTCAP,
            )
        if SINKS:  # the head's sink joins the denominator: rescale to the larger maximum
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp(sink - m_new)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _split_kv_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, query_starts_ptr, context_lens_ptr,
    scale, window, softcap,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ps, stride_ph, stride_pk, stride_ls, stride_lh,
    NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Decode rows only: program (request, KV head, split) attends to its split's keys and writes
    the normalised partial output and its log-sum-exp (-inf for an empty split)."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), TILE_N) * TILE_N
    begin = split * per_split
    end = tl.minimum(context_len, begin + per_split)
    first_key = tl.maximum(context_len - window, 0)  # the decode query sits at context_len - 1
    begin = tl.maximum(begin, first_key // TILE_N * TILE_N)  # skip tiles before the window
    lanes = tl.arange(0, BLOCK_M)  # the group's heads, padded to >= 16 rows for tl.dot
    rows = lanes % GROUP_P
    head = kvh * GROUP + rows
    row_ok = (rows < GROUP) & (lanes < GROUP_P)
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = d < HEAD_DIM
    token = tl.load(query_starts_ptr + seq).to(tl.int64)
    q = tl.load(
        q_ptr + token * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )
    q_pos = tl.zeros([BLOCK_M], tl.int32) + context_len - 1
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    for key_start in range(begin, end, TILE_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, q_pos, window, first_key, key_start, end, seq, kvh,
            k_cache_ptr, v_cache_ptr, block_tables_ptr, stride_bt,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            scale, softcap, d, d_ok, BLOCK_SIZE, TILE_N, DOT_PRECISION, UPCAST, SOFTCAP,
        )
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    base = seq * stride_ps + head * stride_ph + split * stride_pk
    tl.store(part_out_ptr + base[:, None] + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(part_lse_ptr + seq * stride_ls + head * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_starts_ptr, sinks_ptr,
    stride_ps, stride_ph, stride_pk, stride_ls, stride_lh, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    k = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM_P)
    lse = tl.load(part_lse_ptr + seq * stride_ls + head * stride_lh + k)  # [NUM_SPLITS]
    top = tl.max(lse, 0)
    if SINKS:  # the sink is one more "split" with no output
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        top = tl.maximum(top, sink)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top))
    parts = tl.load(part_out_ptr + seq * stride_ps + head * stride_ph + k[:, None] * stride_pk + d[None, :])
    total = tl.sum(w, 0)
    if SINKS:
        total += tl.exp(sink - top)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    token = tl.load(query_starts_ptr + seq).to(tl.int64)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 stays IEEE float32 (tl.dot would round inputs to tf32 by default on GPUs)
    return "ieee" if dtype == torch.float32 else "tf32"


NO_WINDOW = 1 << 30  # "window" of a global layer: more keys than any context


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim] (reference contract).
    Caches [num_blocks, block_size, num_kv_heads, head_dim]; rows of requests with context length 0
    (padding) are left as zeros."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    group_p = next_pow2(group)
    num_seqs = meta.query_lens.shape[0]
    max_query_len = meta.max_query_len if meta.max_query_len is not None else int(meta.query_lens.max())
    block_m = 16 if max_query_len == 1 else 64
    block_q = max(1, block_m // group_p)
    out = torch.zeros_like(q)
    if num_seqs == 0 or num_tokens == 0:
        return out
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _unified_attention_kernel[grid](
        q, k_cache, v_cache, out, q if sinks is None else sinks.float().contiguous(),
        meta.block_tables, meta.query_starts, meta.query_lens, meta.context_lens,
        scale, NO_WINDOW if window is None else window, 1.0 if softcap is None else softcap,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        meta.block_tables.stride(0),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_P=max(16, next_pow2(head_dim)),
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, TILE_N=TILE_N, DOT_PRECISION=_dot_precision(q.dtype), UPCAST=is_interpreted(),
        SOFTCAP=softcap is not None, SINKS=sinks is not None,
    )
    return out


def paged_attention_split_kv(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, num_splits: int,
    window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference contract for a decode-only step (every request has one query token), its keys
    cut into `num_splits` slices (a power of two) that run in parallel and are merged."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if meta.num_decode_tokens != num_tokens:
        raise ValueError("the split-KV kernel takes decode-only steps (one query token per request)")
    group = num_heads // num_kv_heads
    head_dim_p = max(16, next_pow2(head_dim))
    num_seqs = meta.query_lens.shape[0]
    out = torch.zeros_like(q)
    if num_seqs == 0:
        return out
    # partial outputs [seq, head, split, d_p] and their log-sum-exps [seq, head, split]
    part_out = torch.empty((num_seqs, num_heads, num_splits, head_dim_p), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    strides = (*part_out.stride()[:3], *part_lse.stride()[:2])
    _split_kv_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, part_out, part_lse,
        meta.block_tables, meta.query_starts, meta.context_lens,
        scale, NO_WINDOW if window is None else window, 1.0 if softcap is None else softcap,
        q.stride(0), q.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        meta.block_tables.stride(0), *strides,
        NUM_SPLITS=num_splits, BLOCK_M=max(16, next_pow2(group)), BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p, GROUP=group, GROUP_P=next_pow2(group), TILE_N=TILE_N, DOT_PRECISION=_dot_precision(q.dtype), UPCAST=is_interpreted(),
        SOFTCAP=softcap is not None,
    )
    _merge_splits_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, meta.query_starts, q if sinks is None else sinks.float().contiguous(),
        *strides, out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, SINKS=sinks is not None,
    )
    return out
