"""--kv-cache-dtype's rule (octavo/kernels/kv_dtype_rule.py): what `auto` picks on each device, and
the combinations refused at start with what would work (never ignored)."""

from __future__ import annotations

import dataclasses

import pytest

from octavo.config import KV_CACHE_DTYPE_CHOICES, ModelConfig, RopeConfig
from octavo.kernels.kv_dtype_rule import auto_kv_cache_dtype, resolve_kv_cache_dtype

LLAMA = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_layers=4, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                    rope=RopeConfig(theta=100000.0), max_position=8192)
LFM2 = dataclasses.replace(LLAMA, layer_types=("conv", "full", "conv", "full"), conv_kernel=3)


def test_auto_is_float16_on_the_cpu_and_the_models_dtype_on_the_gpu():
    """float16: the smallest dtype that kept the same top token at >= 99.5% on every model measured,
    and never more bytes than llama.cpp's default cache."""
    kv, why = auto_kv_cache_dtype("float32", "cpu")
    assert kv == "float16" and "llama.cpp" in why
    assert resolve_kv_cache_dtype("auto", "float32", "cpu", LLAMA)[0] == "float16"
    assert resolve_kv_cache_dtype("auto", "float32", "cpu", LFM2)[0] == "float16"  # its conv state too
    assert resolve_kv_cache_dtype("auto", "bfloat16", "cuda", LLAMA)[0] == "bfloat16"
    assert resolve_kv_cache_dtype("auto", "float16", "cuda:0", LLAMA)[0] == "float16"
    # other activations on the CPU keep their own dtype in the cache
    assert resolve_kv_cache_dtype("auto", "bfloat16", "cpu", LLAMA)[0] == "bfloat16"


@pytest.mark.parametrize("name", [c for c in KV_CACHE_DTYPE_CHOICES if c != "auto"])
def test_a_named_dtype_is_what_the_cpu_cache_holds(name):
    assert resolve_kv_cache_dtype(name, "float32", "cpu", LLAMA) == (name, "--kv-cache-dtype")


def test_what_no_kernel_reads_is_refused_naming_what_would_work():
    with pytest.raises(ValueError, match="GPU kernels read a KV cache in the model's dtype only.*auto on the GPU"):
        resolve_kv_cache_dtype("int8", "bfloat16", "cuda", LLAMA)
    with pytest.raises(ValueError, match="short-convolution layers.*float32, bfloat16, float16"):
        resolve_kv_cache_dtype("int8", "float32", "cpu", LFM2)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32"):
        resolve_kv_cache_dtype("fp4", "float32", "cpu", LLAMA)
