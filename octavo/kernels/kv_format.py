"""How a KV-cache dtype lays out a cache tensor, and its torch reference quantize / dequantize.

A cache tensor is [num_blocks, block_size, num_kv_heads, row] where a row is one token's K (or V)
of one KV head. For float32, bfloat16 and float16 a row is the head's head_dim values. For int8 a
row is head_dim int8 values, then one float16 scale per group of 32 values (the last group may be
shorter) in the next 2 * ceil(head_dim / 32) bytes: symmetric, value = q * scale with scale =
amax / 127 over the group. So 68 bytes hold a 64-value row (1.06 bytes a value, llama.cpp's q8_0
granularity). Keeping the scales inside the row makes a block one unit: copy-on-write, the KV tier,
swap and block copies move its scales with it because they move its bytes.

Groups of 32 were measured against one float32 scale per row (the same 68 bytes at head_dim 64):
SmolLM2-135M, `octavo eval` over the committed text, mean KL against float32 KV 0.00031 vs 0.00076
(docs/BENCHMARKS.md). The C++ kernels (cpu/kv_store.h) read and write the same layout; the
functions here are their reference and the oracle a test compares them with.
"""

from __future__ import annotations

import torch

from octavo.config import KV_CACHE_DTYPES

_, INT8_SCALE_BYTES, INT8_GROUP = KV_CACHE_DTYPES["int8"]
INT8_QMAX = 127.0
_HALF_MAX = torch.finfo(torch.float16).max  # a group's scale is clamped to it (values above 8.3e6)
_TINY = torch.finfo(torch.float32).tiny  # a zero group divides by it (giving zeros) instead of by 0

STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


def storage_dtype(kv_dtype: str) -> torch.dtype:
    """The torch dtype of a cache tensor holding `kv_dtype` (KV_CACHE_DTYPES)."""
    if kv_dtype not in STORAGE_DTYPES:
        raise ValueError(f"kv cache dtype must be one of {', '.join(STORAGE_DTYPES)}, got {kv_dtype!r}")
    return STORAGE_DTYPES[kv_dtype]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The KV dtype (KV_CACHE_DTYPES) a cache tensor of torch `dtype` holds: storage_dtype's inverse."""
    for name, stored in STORAGE_DTYPES.items():
        if dtype == stored:
            return name
    raise ValueError(f"no KV cache dtype is held as {dtype}")


def kv_dtype_of(cache: torch.Tensor) -> str:
    """The KV dtype a cache tensor holds."""
    return kv_dtype_name(cache.dtype)


def num_groups(head_dim: int) -> int:
    """int8 scale groups of a row."""
    return -(-head_dim // INT8_GROUP)


def row_elements(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of a cache tensor of `dtype` one row (a token's K or V of one KV head) takes."""
    return head_dim + (num_groups(head_dim) * INT8_SCALE_BYTES if dtype == torch.int8 else 0)


def head_dim_of(cache: torch.Tensor) -> int:
    """The head_dim of a cache tensor [..., row] (row_elements' inverse)."""
    row = cache.shape[-1]
    if cache.dtype != torch.int8:
        return row
    # row = d + 2 * ceil(d / 32) grows strictly with d, so at most one d gives it: at least
    # row - 2 * ceil(row / 32)
    for head_dim in range(max(1, row - num_groups(row) * INT8_SCALE_BYTES), row + 1):
        if row_elements(torch.int8, head_dim) == row:
            return head_dim
    raise ValueError(f"an int8 cache row of {row} bytes fits no head_dim")


def _padded_groups(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] -> [..., groups, 32], the last group zero-padded."""
    head_dim = x.shape[-1]
    pad = num_groups(head_dim) * INT8_GROUP - head_dim
    return torch.nn.functional.pad(x, (0, pad)).view(*x.shape[:-1], num_groups(head_dim), INT8_GROUP)


def quantize_rows(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """float rows [..., head_dim] -> cache rows [..., row_elements] in `kv_dtype`.

    float16: clamped to its range first. int8, per group of 32 values: scale = float16(min(amax(|x|) / 127, 65504)), then
    q = round-half-even(x / max(scale, FLT_MIN)) clamped to +-127 (dividing by the stored scale,
    so q * scale is what is read back); a zero group gets scale 0 and zeros."""
    if kv_dtype == "float16":  # held as the largest float16 past its range, not as inf
        return x.clamp(-_HALF_MAX, _HALF_MAX).to(torch.float16)
    if kv_dtype != "int8":
        return x.to(storage_dtype(kv_dtype))
    head_dim = x.shape[-1]
    groups = _padded_groups(x.float())  # [..., g, 32]
    scale = (groups.abs().amax(dim=-1, keepdim=True) / INT8_QMAX).clamp_(max=_HALF_MAX).to(torch.float16)
    q = torch.round(groups / scale.float().clamp_min(_TINY)).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)
    q = q.view(*x.shape[:-1], -1)[..., :head_dim]
    return torch.cat((q, scale.view(*x.shape[:-1], -1).contiguous().view(torch.int8)), dim=-1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """Cache rows [..., row_elements] -> float32 [..., head_dim] (the values attention reads)."""
    if rows.dtype != torch.int8:
        return rows.float()
    head_dim = head_dim_of(rows)
    scale = rows[..., head_dim:].contiguous().view(torch.float16).float()  # [..., groups]
    values = _padded_groups(rows[..., :head_dim].float()) * scale[..., None]  # [..., groups, 32]
    return values.view(*rows.shape[:-1], -1)[..., :head_dim]
