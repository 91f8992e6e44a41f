"""Builds (once per machine, cached) and loads the C++ CPU kernels; None when they can't be built."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("bindings.cpp", "layer_ops.cpp", "paged_attention.cpp", "quant_linear.cpp"))
HEADERS = (Path(__file__).with_name("vec_math.h"),)  # compiled through the sources; part of the cache key
# -march=native: the build is cached per machine (the key includes the CPU flags), so it may use
# whatever vector units this CPU has (AVX-512, AVX2 or neither: the kernels pick at compile time).
# -fopenmp: at::parallel_for is an OpenMP region in the header; the library resolves to the
# libgomp torch already loaded. -ffp-contract=off: the quantized kernels rebuild each weight as
# d * q + m with two roundings, as gguf-py does; a fused multiply-add would round once.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]
# OCTAVO_CPU_ISA narrows what the build may use, to test the other code paths on a bigger CPU:
# "avx2" (no AVX-512) or "generic" (no AVX2, FMA or F16C: the plain C++ paths). Default "native".
ISA_FLAGS = {
    "native": [],
    "avx2": ["-mno-avx512f"],
    "generic": ["-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c"],
}


def _cflags() -> list[str]:
    isa = os.environ.get("OCTAVO_CPU_ISA", "native")
    if isa not in ISA_FLAGS:
        raise ValueError(f"OCTAVO_CPU_ISA must be one of {', '.join(ISA_FLAGS)}, got {isa!r}")
    return CFLAGS + ISA_FLAGS[isa]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as the kernel reports them (/proc/cpuinfo; empty where unreadable)."""
    line = _cpu_flags()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def cpu_has_bf16() -> bool:
    """Whether the CPU has bfloat16 arithmetic units (AVX512_BF16 or AMX-BF16): detected, never assumed."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_matmul_speedups(in_features: int, out_features: int, rows: tuple[int, ...] = (1, 64)) -> dict[int, float]:
    """float32 time / bfloat16 time of this torch's linear on this CPU, per row count, for a layer
    of this shape (8 copies, so that one row reads weights from memory as a decode step does).

    Measured, because having bf16 units is not enough: with torch 2.13 on a Xeon with AVX512_BF16
    the bf16 product was no faster at 1 row and slower at 64 (docs/BENCHMARKS.md). ~0.1-0.3 s.
    """
    import time

    import torch

    weights = [torch.randn(out_features, in_features) for _ in range(8)]
    out: dict[int, float] = {}
    for n in rows:
        x = torch.randn(n, in_features)
        times = []
        for dtype in (torch.float32, torch.bfloat16):
            ws, xs = [w.to(dtype) for w in weights], x.to(dtype)
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for w in ws:
                    torch.nn.functional.linear(xs, w)
                best = min(best, time.perf_counter() - start)
            times.append(best)
        out[n] = times[0] / times[1]
    return out


def build_dir() -> Path:
    """Where the build lives: keyed by the source, the flags, torch, Python and the CPU."""
    import torch

    from octavo.models.loader import cache_dir

    key = hashlib.sha256(
        "\n".join([*(s.read_text() for s in SOURCES + HEADERS), " ".join(_cflags()), torch.__version__, platform.python_version(), _cpu_flags()]).encode()
    ).hexdigest()[:16]
    return cache_dir() / "kernels" / f"cpu-{key}"


@functools.cache
def load() -> ModuleType | None:
    """The compiled module (with `paged_attention`), or None if this machine can't build it.

    Set OCTAVO_CPU_KERNELS=0 to skip it (the torch reference kernels are used instead).
    The first call on a machine compiles for ~30-60 s; later calls load the cached library.
    """
    if os.environ.get("OCTAVO_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        directory = build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        if not any(directory.glob("*.so")):
            logger.info("compiling Octavo's CPU kernels (once per machine, ~1 min) into %s", directory)
        return load_extension(
            name="octavo_cpu_kernels",
            sources=[str(s) for s in SOURCES],
            extra_cflags=_cflags(),
            build_directory=str(directory),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers, ...: the reference kernels still work
        logger.warning("Octavo's CPU kernels are unavailable (%s); using the slower torch reference", exc)
        return None


def has_onednn_linear() -> bool:
    """Whether this torch exposes oneDNN's matmul on plain tensors (an op Inductor uses on CPUs)."""
    import torch

    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x, weight, bias=None):
    """Same contract as `octavo.kernels.reference.linear`, through oneDNN instead of MKL's sgemm.

    Measured on a 2-core AVX2 EPYC (docs/BENCHMARKS.md): 7-22% faster at 2,048 rows and ~37%
    faster for the 49,152-wide LM head at ~36 rows; within noise at decode shapes.
    """
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _module() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError("Octavo's CPU kernels could not be built on this machine (see the log)")
    return module


def pack(qweight, fmt):
    """GGUF-layout blocks [N, row_bytes] -> the layout `quant_linear` reads (same bytes, reordered:
    see quant_linear.cpp)."""
    return _module().pack(qweight.contiguous(), fmt.code)


def quant_linear(x, packed, fmt, out_features: int, bias=None):
    """Same contract as `octavo.kernels.reference.quant_linear`, W packed by `pack`; float32 x."""
    import torch

    x = x.contiguous()
    out = torch.empty((x.shape[0], out_features), dtype=torch.float32)  # [num_tokens, out]
    _module().quant_linear(out, x, packed, fmt.code)
    if bias is not None:
        out += bias
    return out


def dequantize_transposed(packed, fmt, in_features: int, out_features: int):
    """W^T as float32 [in_features, out_features] (a view of a padded buffer), each weight bit for
    bit as `octavo.quantization.dequantize` rebuilds it."""
    import torch

    width = packed.shape[0] * _module().pack_width()
    out = torch.empty((in_features, width), dtype=torch.float32)
    _module().dequantize_transposed(out, packed, fmt.code)
    return out[:, :out_features]


def dequantize_rows(packed, fmt, rows, in_features: int, out_features: int):
    """Rows `rows` of a packed W as float32 [len(rows), in_features], bit for bit as
    `octavo.quantization.dequantize` rebuilds them (the embedding lookup)."""
    import torch

    rows = rows.to(torch.long).contiguous()
    out = torch.empty((rows.shape[0], in_features), dtype=torch.float32)
    _module().dequantize_rows(out, packed, fmt.code, rows, out_features)
    return out


def rms_norm(x, weight, eps: float):
    """Same contract as `octavo.kernels.reference.rms_norm`; float32 [n, dim]."""
    import torch

    x = x.contiguous()
    out = torch.empty_like(x)
    _module().rms_norm(out, x, weight, eps)
    return out


def add_rms_norm(x, residual, weight, eps: float):
    """Same contract as `octavo.kernels.reference.add_rms_norm`, in place on contiguous float32."""
    _module().add_rms_norm(x, residual, weight, eps)
    return x, residual


def rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads: int, num_kv_heads: int):
    """Same contract as `octavo.kernels.reference.rotary_write_kv`; float32, contiguous qkv."""
    _module().rotary_write_kv(qkv, cos.contiguous(), sin.contiguous(), k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)


def silu_and_mul(gate_up):
    """Same contract as `octavo.kernels.reference.silu_and_mul`; float32 [n, 2 * inter]."""
    import torch

    gate_up = gate_up.contiguous()
    out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=torch.float32)
    _module().silu_and_mul(out, gate_up)
    return out


def quant_isa() -> str | None:
    """The vector instructions the quantized kernels use here (avx512, avx2, scalar), or None."""
    module = load()
    return None if module is None else module.quant_isa()


# Query tokens per work item on multi-token spans: 16 tokens x all heads share each key block
# while it is in L1. Chosen, not tuned: other tile sizes have not been measured.
Q_TILE = 16


def paged_attention(q, k_cache, v_cache, meta, scale: float):
    """Same contract as `octavo.kernels.reference.paged_attention`; float32 CPU tensors only."""
    import torch

    module = load()
    if module is None:
        raise RuntimeError("Octavo's CPU kernels could not be built on this machine (see the log)")
    q = q.contiguous()
    out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
    module.paged_attention(
        out, q, k_cache, v_cache, meta.block_tables, meta.query_starts, meta.query_lens, meta.context_lens, scale, Q_TILE
    )
    return out
