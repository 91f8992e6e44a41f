"""--activation-dtype auto: which activations a model's quantized layers meet their weights in on
this CPU, decided from the CPU's flags and whether the weights are quantized, never from a timing (a
timing taken at start moves with the machine's load; a model's numerics must not move with it).

The rule, and the measurements behind it (docs/BENCHMARKS.md, "int8 activations by default" and
"int8 on every file, AVX-512 and AMX too"):
- no quantized layer (dense weights): float32, the only path there is;
- a CPU without AVX2: float32 (the int8 kernels' plain C++ build is the slower one);
- a CPU with AVX2 (with or without VNNI, AVX-512, AMX): int8, at every size. Measured side by side,
  one user: on an AVX2-only AMD EPYC int8's step is the faster one on every file served there, from
  the 97 MB SmolLM2-135M (10-15% faster) to the 4.9 GB Llama-3.1-8B shape (1.5x); on an Intel Xeon
  (AVX-512 VNNI, AMX) at `f2ccdb9` the 97 MB and 271 MB files ran 1-8% faster per token and 2.3x
  faster to the first token in int8 (the 6-13% they lost on 2026-12-03 went with the per-call
  costs removed since), the 1B shape 1.5x; on an AMD Zen 5 (AVX-512 VNNI, no AMX) at `d5e201f`
  the two small files tie per token (4.7 vs 4.7 and 7.4 vs 7.6 ms), the 1B shape's step is 1.2x
  faster, and every file reaches its first token 3-3.6x sooner in int8.
The exact path (float32: greedy output equal to transformers') is one flag away, and every oracle
test pins it.
"""

from __future__ import annotations

from collections.abc import Iterable


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
    return "int8", (f"{size} on an {kind} CPU: int8 measured faster at every size on AVX2, AVX-512 and AMX "
                    "CPUs; --activation-dtype float32 for the exact path")
