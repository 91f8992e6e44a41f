"""RMSNorm, and RMSNorm after a residual add, in Triton: one program per row.

Same contracts and roundings as `kernels.reference.rms_norm` / `add_rms_norm`: the sum x + residual
is rounded to the activation dtype, the norm is computed in float32 and rounded, then scaled by
the weight (rounded again), so bf16 results match the reference's op-by-op roundings.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.triton import next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    stride_x, stride_r, stride_o, stride_s, dim, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / dim + eps)
    normed = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    total = torch.empty_like(x2) if residual is not None else out
    r2 = residual.reshape(-1, shape[-1]) if residual is not None else x2
    if x2.stride(-1) != 1 or r2.stride(-1) != 1:
        raise ValueError("rms_norm needs rows with unit stride")
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, total,
            x2.stride(0), r2.stride(0), out.stride(0), total.stride(0), shape[-1], eps,
            HAS_RESIDUAL=residual is not None, BLOCK=next_pow2(shape[-1]),
        )
    return out.view(shape), total.view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., dim] -> [..., dim] (reference.rms_norm)."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in fresh tensors (reference.add_rms_norm)."""
    return _launch(x, residual, weight, eps)
