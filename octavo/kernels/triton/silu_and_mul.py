"""silu(gate) * up in Triton (reference.silu_and_mul), rounding silu to the activation dtype first
as torch's two ops do."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * inter] -> [num_tokens, inter]."""
    rows, width = gate_up.shape
    inter = width // 2
    if gate_up.stride(-1) != 1:
        raise ValueError("silu_and_mul needs rows with unit stride")
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, BLOCK))](gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=BLOCK)
    return out
