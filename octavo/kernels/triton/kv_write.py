"""Writing this step's keys and values into their cache slots in Triton (vLLM's reshape_and_cache),
alone or fused with RoPE on q and k (reference.write_kv / rotary_write_kv).

A negative slot means "do not write" (the padding rows of a CUDA-graph batch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.triton import next_pow2


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
    num_kv_heads, head_dim, HEADS_P: tl.constexpr, DIM_P: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, HEADS_P)[:, None]
        d = tl.arange(0, DIM_P)[None, :]
        ok = (h < num_kv_heads) & (d < head_dim)
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=ok)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=ok)
        tl.store(k_cache_ptr + slot * stride_cs + h * stride_ch + d, k, mask=ok)
        tl.store(v_cache_ptr + slot * stride_cs + h * stride_ch + d, v, mask=ok)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim] into caches [num_blocks, block_size, kvh, d]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("write_kv needs unit-stride heads and contiguous caches")
    if num_tokens:
        _write_kv_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2),
            num_kv_heads, head_dim, HEADS_P=next_pow2(num_kv_heads), DIM_P=next_pow2(head_dim),
        )


@triton.jit
def _rotary_write_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_t, stride_cos, stride_sin, stride_cs, stride_ch,
    num_heads, num_kv_heads, half, HEAD_DIM: tl.constexpr, HALF_P: tl.constexpr, ROT_P: tl.constexpr,
    KV_P: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, ROT_P)[:, None]  # q heads then k heads, rotated in place
    i = tl.arange(0, HALF_P)[None, :]  # the rotary pairs (i, half + i): all the head, or its first 2 * half values
    in_pairs = i < half
    ok = (h < num_heads + num_kv_heads) & in_pairs
    row = qkv_ptr + t * stride_t + h * HEAD_DIM
    x1 = tl.load(row + i, mask=ok, other=0.0)
    x2 = tl.load(row + half + i, mask=ok, other=0.0)
    dt = x1.dtype
    c1 = tl.load(cos_ptr + t * stride_cos + i, mask=in_pairs, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_cos + half + i, mask=in_pairs, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_sin + i, mask=in_pairs, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_sin + half + i, mask=in_pairs, other=0.0).to(tl.float32)
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    # reference: x * cos + cat(-x2, x1) * sin, each product rounded to the dtype, then the sum
    o1 = ((f1 * c1).to(dt).to(tl.float32) + (-f2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)).to(dt)
    tl.store(row + i, o1, mask=ok)
    tl.store(row + half + i, o2, mask=ok)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        kh = tl.arange(0, KV_P)[:, None]
        d = tl.arange(0, HEAD_DIM)[None, :]
        kv_ok = kh < num_kv_heads
        is_k = (h >= num_heads) & ok
        # the rotated k heads, straight from registers
        tl.store(k_cache_ptr + slot * stride_cs + (h - num_heads) * stride_ch + i, o1, mask=is_k)
        tl.store(k_cache_ptr + slot * stride_cs + (h - num_heads) * stride_ch + half + i, o2, mask=is_k)
        # a partial-rotary head's values past the rotary part, as they are (never rotated: no race)
        rest = kv_ok & (d >= 2 * half)
        k_rest = tl.load(qkv_ptr + t * stride_t + (num_heads + kh) * HEAD_DIM + d, mask=rest)
        tl.store(k_cache_ptr + slot * stride_cs + kh * stride_ch + d, k_rest, mask=rest)
        v = tl.load(qkv_ptr + t * stride_t + (num_heads + num_kv_heads + kh) * HEAD_DIM + d, mask=kv_ok)
        tl.store(v_cache_ptr + slot * stride_cs + kh * stride_ch + d, v, mask=kv_ok)


def rotary_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """In place on qkv [n, (num_heads + 2 * num_kv_heads) * head_dim]: RoPE on the q and k heads
    (their first cos.shape[-1] values), then k and v into the cache at `slot_mapping`
    (reference.rotary_write_kv). head_dim must be a power of two (every Llama-family size is)."""
    n, head_dim, rot = qkv.shape[0], k_cache.shape[-1], cos.shape[-1]
    if head_dim & (head_dim - 1) or head_dim < 2:
        raise ValueError(f"the Triton rotary kernel needs a power-of-two head_dim, got {head_dim}")
    if not qkv.is_contiguous() or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("rotary_write_kv needs a contiguous qkv and caches")
    if n:
        _rotary_write_kv_kernel[(n,)](
            qkv, cos, sin, k_cache, v_cache, slot_mapping,
            qkv.stride(0), cos.stride(0), sin.stride(0), k_cache.stride(1), k_cache.stride(2),
            num_heads, num_kv_heads, rot // 2, HEAD_DIM=head_dim, HALF_P=next_pow2(rot // 2),
            ROT_P=next_pow2(num_heads + num_kv_heads), KV_P=next_pow2(num_kv_heads),
        )
