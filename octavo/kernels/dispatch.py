"""The one place that picks a kernel implementation: torch reference or C++ on the CPU, Triton on GPU (later)."""

from __future__ import annotations

import functools

import torch

from octavo.kernels import cpu, reference
from octavo.kernels.metadata import BACKENDS, AttentionMetadata

rms_norm = reference.rms_norm
apply_rotary = reference.apply_rotary
silu_and_mul = reference.silu_and_mul
write_kv = reference.write_kv
copy_blocks = reference.copy_blocks


@functools.cache
def _onednn_linear() -> bool:
    return cpu.has_onednn_linear()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias: oneDNN for float32 on the CPU where torch has it, else torch's own."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and _onednn_linear():
        return cpu.linear(x, weight, bias)
    return reference.linear(x, weight, bias)


def select_attention_backend(requested: str, device: torch.device, kv_dtype: torch.dtype) -> str:
    """"auto" -> the C++ CPU kernel where it applies and builds (float32 on the CPU), else the
    torch reference; "cpu" and "reference" force one (ValueError if "cpu" can't run here).
    The first call on a machine may compile the CPU kernel (~1 min, cached)."""
    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"attention backend must be one of auto, {', '.join(BACKENDS)}; got {requested!r}")
    if requested == "reference":
        return "reference"
    applies = device.type == "cpu" and kv_dtype == torch.float32
    if requested == "cpu":
        if not applies:
            raise ValueError(f"the cpu attention backend needs float32 on the CPU, not {kv_dtype} on {device}")
        if cpu.load() is None:
            raise ValueError("the cpu attention backend could not be built here (see the log); use 'reference'")
        return "cpu"
    return "cpu" if applies and cpu.load() is not None else "reference"


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention over the paged cache by the kernel the step's metadata names."""
    if meta.backend == "cpu":
        return cpu.paged_attention(q, k_cache, v_cache, meta, scale)
    return reference.paged_attention(q, k_cache, v_cache, meta, scale)
