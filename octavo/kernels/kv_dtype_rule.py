"""--kv-cache-dtype: what the KV cache holds a value in, the choice `auto` makes, and the
combinations refused at start (named with what would work, never ignored).

The rule today: `auto` is the model's own dtype (float32 on the CPU, the GPU's bfloat16 or
float16), what every earlier release held; the smaller dtypes are asked for by name. Which of them
`auto` picks per model waits on their accuracy measured against float32 KV (issue 62).
"""

from __future__ import annotations

from octavo.config import KV_CACHE_DTYPE_CHOICES, KV_CACHE_DTYPES, ModelConfig


def auto_kv_cache_dtype(dtype: str, device: str) -> tuple[str, str]:
    """(the KV dtype --kv-cache-dtype auto picks, why) for activations in `dtype` on `device`."""
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
