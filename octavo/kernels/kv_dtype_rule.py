"""--kv-cache-dtype: what the KV cache holds a value in, the choice `auto` makes, and the
combinations refused at start (named with what would work, never ignored).

The rule for `auto`: the smallest dtype the kernels read whose accuracy, measured against a float32
cache on the same weights (`octavo eval --modes kv-...`), keeps the same top token at >= 99.5% of
positions with a mean KL <= 1e-3 on every model measured, and never more bytes a value than
llama.cpp's default cache (float16). On the CPU with float32 activations that is float16: 100.00%
same top token on SmolLM2-135M and Gemma 3 270M (mean KL < 5e-6), half float32's bytes, and a
faster step at long context (the kernel converts in registers: docs/BENCHMARKS.md, "KV cache
dtypes"). bfloat16 missed (99.48% on Gemma 3), int8 too (98.7-98.8%): both stay by name. On the GPU
the kernels read the model's own dtype (bfloat16 or float16), which is `auto` there; and where
the CPU runs other activations than float32 the cache keeps their dtype.
"""

from __future__ import annotations

from octavo.config import KV_CACHE_DTYPE_CHOICES, KV_CACHE_DTYPES, ModelConfig


def auto_kv_cache_dtype(dtype: str, device: str) -> tuple[str, str]:
    """(the KV dtype --kv-cache-dtype auto picks, why) for activations in `dtype` on `device`."""
    if not device.startswith("cuda") and dtype == "float32":
        return "float16", ("auto: half float32's bytes, llama.cpp's default; the same top token as float32 "
                           "at 100% of positions measured")
    return dtype, "auto: the model's dtype"


def resolve_kv_cache_dtype(requested: str, dtype: str, device: str, model_config: ModelConfig) -> tuple[str, str]:
    """(the KV dtype, why) for `requested` (KV_CACHE_DTYPE_CHOICES) with activations in `dtype` on
    `device`; ValueError for a combination no kernel here reads."""
    if requested not in KV_CACHE_DTYPE_CHOICES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, got {requested!r}")
    if requested == "auto":
        return auto_kv_cache_dtype(dtype, device)
    on_gpu = device.startswith("cuda")
    if on_gpu and requested != dtype:
        raise ValueError(f"--kv-cache-dtype {requested}: the GPU kernels read a KV cache in the model's dtype only "
                         f"({dtype} here); use --kv-cache-dtype auto on the GPU, or {requested} on the CPU")
    if requested == "int8" and any(group.kind == "conv" for group in model_config.kv_groups()):
        raise ValueError("--kv-cache-dtype int8 is not built for models with short-convolution layers (LFM2): use "
                         f"{', '.join(name for name in KV_CACHE_DTYPES if name != 'int8')}")
    return requested, "--kv-cache-dtype"
