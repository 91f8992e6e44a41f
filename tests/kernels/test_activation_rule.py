"""--activation-dtype auto's rule (kernels/activation_rule.py): pure, over CPU flag sets and sizes,
and the resolver in front of it (loader.resolve_activation_dtype) on the embedded model's files."""

from __future__ import annotations

import pytest

from octavo.kernels.activation_rule import activation_rule, cpu_kind

AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c"}
ZEN4 = AVX2 | {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}
XEON = ZEN4 | {"amx_tile", "amx_int8", "amx_bf16"}


@pytest.mark.parametrize("flags,kind", [(AVX2, "avx2"), (AVX2 | {"avx_vnni"}, "avx-vnni"), (ZEN4, "avx512-vnni"),
                                        (XEON, "amx"), ({"avx512f"} | AVX2, "avx512"), ({"sse2"}, "plain")])
def test_cpu_kinds_are_named_by_what_the_int8_kernels_run_on(flags, kind):
    assert cpu_kind(flags) == kind


@pytest.mark.parametrize("flags,kind", [(AVX2, "avx2"), (AVX2 | {"avx_vnni"}, "avx-vnni"), (ZEN4, "avx512-vnni"),
                                        (XEON, "amx")])
def test_with_avx2_int8_at_every_size(flags, kind):
    for num_bytes in (1, 97 * 10**6, 271 * 10**6, 813 * 10**6, 5 * 10**9):
        dtype, why = activation_rule(num_bytes, flags)
        assert dtype == "int8" and f"an {kind} CPU" in why and "--activation-dtype float32" in why, why


def test_no_quantized_weights_or_no_avx2_keep_float32():
    assert activation_rule(0, AVX2) == ("float32", "no quantized weights: activations meet dense weights in float32")
    assert activation_rule(10**9, {"sse2"})[0] == "float32"


def test_the_resolver_reads_the_file_and_this_cpu(smol_dir):
    from octavo.cpu_features import cpu_flags
    from octavo.kernels import cpu
    from octavo.models.loader import gguf_source, quantized_file_bytes, resolve_activation_dtype

    assert quantized_file_bytes(smol_dir, "auto") == gguf_source(smol_dir).stat().st_size
    assert quantized_file_bytes(smol_dir, "none") == 0
    assert resolve_activation_dtype("float32", smol_dir, "auto", "cpu") == ("float32", "as asked")
    assert resolve_activation_dtype("auto", smol_dir, "none", "cpu")[0] == "float32"
    assert resolve_activation_dtype("auto", smol_dir, "auto", "cuda")[0] == "float32"
    want = activation_rule(quantized_file_bytes(smol_dir, "auto"), cpu_flags())[0] if cpu.load() is not None else "float32"
    assert resolve_activation_dtype("auto", smol_dir, "auto", "cpu")[0] == want
