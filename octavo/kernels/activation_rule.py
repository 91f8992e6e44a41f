"""--activation-dtype auto: which activations a model's quantized layers meet their weights in on
this CPU, decided from the CPU's flags and the quantized weights' bytes, never from a timing (a
timing taken at start moves with the machine's load; a model's numerics must not move with it).

The rule, and the measurements behind it (docs/BENCHMARKS.md, "int8 activations by default"):
- no quantized layer (dense weights): float32, the only path there is;
- a CPU without AVX-512 (AVX2 with or without AVX-VNNI): int8. Measured on an AVX2-only AMD EPYC,
  side by side, one user: int8's step is the faster one on every file served there, from the
  97 MB SmolLM2-135M (10-15% faster) to the 4.9 GB Llama-3.1-8B shape (1.5x);
- a CPU with AVX-512: int8 from INT8_MIN_BYTES_AVX512 of quantized weights up. Measured on an
  Intel Xeon (AVX-512 VNNI, AMX): the 813 MB Llama-3.2-1B shape 1.5x faster in int8, the 97 MB and
  271 MB files 6-13% slower per token (their steps are mostly not matmul there, and the float32
  AVX-512 kernels are fast at one row); the line sits between the two sizes measured.
The exact path (float32: greedy output equal to transformers') is one flag away, and every oracle
test pins it.
"""

from __future__ import annotations

from collections.abc import Iterable

# Between the largest file measured slower in int8 on an AVX-512 Xeon (271 MB) and the smallest
# measured faster (813 MB).
INT8_MIN_BYTES_AVX512 = 512 * 10**6


def cpu_kind(flags: Iterable[str]) -> str:
    """A short name of what the int8 kernels run on here: amx, avx512-vnni, avx512, avx-vnni, avx2 or
    plain (no AVX2: the kernels' scalar build)."""
    f = set(flags)
    if "avx512f" in f:
        if "amx_int8" in f:
            return "amx"
        return "avx512-vnni" if "avx512_vnni" in f else "avx512"
    if "avx2" in f:
        return "avx-vnni" if "avx_vnni" in f else "avx2"
    return "plain"


def activation_rule(quantized_bytes: int, flags: Iterable[str]) -> tuple[str, str]:
    """(dtype, why) for --activation-dtype auto: `quantized_bytes` are the bytes of the weights held
    in quantized blocks (0: none), `flags` the CPU's (cpu_features.cpu_flags())."""
    if quantized_bytes <= 0:
        return "float32", "no quantized weights: activations meet dense weights in float32"
    kind = cpu_kind(flags)
    size = f"{quantized_bytes / 1e6:,.0f} MB of quantized weights"
    if kind == "plain":
        return "float32", f"{size} on a CPU without AVX2: the int8 kernels' scalar build is slower than float32"
    if not kind.startswith("avx512") and kind != "amx":
        return "int8", (f"{size} on a CPU without AVX-512 ({kind}): int8 measured faster at every size there; "
                        "--activation-dtype float32 for the exact path")
    if quantized_bytes >= INT8_MIN_BYTES_AVX512:
        return "int8", (f"{size} on an {kind} CPU: int8 measured faster from {INT8_MIN_BYTES_AVX512 // 10**6} MB; "
                        "--activation-dtype float32 for the exact path")
    return "float32", (f"{size} on an {kind} CPU: below {INT8_MIN_BYTES_AVX512 // 10**6} MB the exact float32 "
                       "path measured faster per token there")
