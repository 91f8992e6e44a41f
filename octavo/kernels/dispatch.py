"""The one place that picks a kernel implementation: torch reference or C++ on the CPU, Triton on GPU (later)."""

from __future__ import annotations

import functools

import torch

from octavo.kernels import cpu, reference
from octavo.kernels.metadata import BACKENDS, AttentionMetadata
from octavo.quantization import QuantFormat, dequantize

apply_rotary = reference.apply_rotary
write_kv = reference.write_kv
copy_blocks = reference.copy_blocks


def _cpu_f32(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and _cpu_kernels()


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (reference.silu_and_mul): the fused C++ op for float32 rows on the CPU."""
    if _cpu_f32(gate_up):
        return cpu.silu_and_mul(gate_up)
    return reference.silu_and_mul(gate_up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (reference.rms_norm): the fused C++ op for float32 rows on the CPU."""
    if _cpu_f32(x) and weight.dtype == torch.float32:
        return cpu.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual). The C++ op works in place on x and residual (both
    fresh activations the caller owns); the reference allocates."""
    if _cpu_f32(x) and x.is_contiguous() and residual.is_contiguous() and weight.dtype == torch.float32:
        return cpu.add_rms_norm(x, residual, weight, eps)
    return reference.add_rms_norm(x, residual, weight, eps)


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
    """RoPE on qkv's q and k heads in place, then k and v into the cache (reference.rotary_write_kv)."""
    if _cpu_f32(qkv) and qkv.is_contiguous() and k_cache.dtype == torch.float32:
        return cpu.rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
    return reference.rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)


@functools.cache
def _onednn_linear() -> bool:
    return cpu.has_onednn_linear()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias: oneDNN for float32 on the CPU where torch has it, else torch's own."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and _onednn_linear():
        return cpu.linear(x, weight, bias)
    return reference.linear(x, weight, bias)


@functools.cache
def _cpu_kernels() -> bool:
    return cpu.load() is not None


# From this many rows on, a quantized layer rebuilds its float32 weight and runs a float32 GEMM,
# which reaches the FMA peak where the factored kernel reaches ~2/3; measured on a 2-core Xeon
# (AVX-512): 3072x576 at 128 rows 2.04 ms vs 2.26, at 1,024 rows 12.0 vs 20.0. Not for layers
# whose float32 copy would be large (the rebuild's page faults: a 49,152x576 head, 40 ms).
REBUILD_MIN_ROWS = 128
REBUILD_MAX_WEIGHTS = 4 << 20


def prepare_quant_weight(qweight: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, str]:
    """GGUF-layout blocks -> (the tensor the kernels will read, its layout): "packed" for the C++
    kernels (a CPU tensor, kernels built), else "gguf" as given (the reference reads it)."""
    if qweight.device.type == "cpu" and _cpu_kernels():
        return cpu.pack(qweight, fmt), "packed"
    return qweight, "gguf"


def quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    layout: str,
    fmt: QuantFormat,
    in_features: int,
    out_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ W.T + bias, W quantized (from `prepare_quant_weight`). Packed: the C++ kernel (or, from
    REBUILD_MIN_ROWS rows, W rebuilt in float32 and one GEMM), in float32 whatever x's dtype, the
    result cast back. GGUF layout (no kernels): W rebuilt in x's dtype, then a plain linear."""
    if layout == "packed" and x.dim() == 2:
        xf = x if x.dtype == torch.float32 else x.float()  # the kernels compute in float32
        bf = None if bias is None else bias.float()
        if x.shape[0] >= REBUILD_MIN_ROWS and in_features * out_features <= REBUILD_MAX_WEIGHTS:
            w_t = cpu.dequantize_transposed(qweight, fmt, in_features, out_features)  # [in, out]
            out = torch.mm(xf, w_t) if bf is None else torch.addmm(bf, xf, w_t)
        else:
            out = cpu.quant_linear(xf, qweight, fmt, out_features, bf)
        return out if x.dtype == torch.float32 else out.to(x.dtype)
    if layout == "packed":
        rows = torch.arange(out_features)
        return reference.linear(x, cpu.dequantize_rows(qweight, fmt, rows, in_features, out_features).to(x.dtype), bias)
    return reference.quant_linear(x, qweight, fmt, in_features, bias)


def quant_embedding(
    ids: torch.Tensor, qweight: torch.Tensor, layout: str, fmt: QuantFormat, dim: int, num_rows: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `ids` of a quantized weight, rebuilt exactly, in `dtype`: [len(ids), dim]."""
    if layout == "packed":
        return cpu.dequantize_rows(qweight, fmt, ids, dim, num_rows).to(dtype)
    return dequantize(qweight[ids], fmt, dim).to(dtype)


def quant_kernel_name(dtype: torch.dtype, device: torch.device) -> str:
    """What `quant_linear` runs for activations of this dtype on this device (for the start-up line)."""
    if dtype == torch.float32 and device.type == "cpu" and _cpu_kernels():
        return f"octavo-cpu/{cpu.quant_isa()}"
    return "reference (rebuild + matmul)"


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
