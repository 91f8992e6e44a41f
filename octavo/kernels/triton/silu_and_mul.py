"""Gated activations in Triton: silu(gate) * up (reference.silu_and_mul) and gelu_tanh(gate) * up
(reference.gelu_tanh_and_mul), rounding the activation to the activation dtype first as torch's
two ops do."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _act_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, inter, BLOCK: tl.constexpr, GELU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    if GELU:
        # tanh(z) = 2 / (1 + exp(-2z)) - 1, with z = sqrt(2 / pi) * (g + 0.044715 g^3)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = 0.5 * g * (2.0 / (1.0 + tl.exp(tl.minimum(-2.0 * z, 80.0))))  # no overflow warning for g << 0
    else:
        act = g / (1.0 + tl.exp(-g))
    act = act.to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * inter] -> [num_tokens, inter]."""
    return _act_and_mul(gate_up, gelu=False)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * inter] -> [num_tokens, inter] (GeGLU, tanh-approximated GELU)."""
    return _act_and_mul(gate_up, gelu=True)


def _act_and_mul(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    rows, width = gate_up.shape
    inter = width // 2
    if gate_up.stride(-1) != 1:
        raise ValueError("silu_and_mul needs rows with unit stride")
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        _act_and_mul_kernel[(rows, triton.cdiv(inter, BLOCK))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=BLOCK, GELU=gelu
        )
    return out
