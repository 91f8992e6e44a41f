"""The quantized kernels' other vector paths, built on this machine with its wider units turned off
(OCTAVO_CPU_ISA): AVX2 (8-wide groups; with AVX-VNNI where the CPU has it, and without: the int8
kernels' vpmaddubsw fallback) and plain C++ (software fp16 conversion), against the same
torch reference. CPUs of the same kind differ (one has AVX-512, another AVX2 only), so every path
must be checked wherever the tests run. Each build is compiled once per machine (~1 min) and cached."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from octavo.kernels import cpu

CHECK = r"""
import torch
from octavo.kernels import cpu, reference
from octavo.quantization import K_FORMATS, Q4_0, Q4_1, Q8_0, dequantize, quantize
from tests.kernels.test_k_quants import random_blocks
assert cpu.load() is not None, "the build failed"
print(cpu.quant_isa(), cpu.load().pack_width(), cpu.quant_vnni())
g = torch.Generator().manual_seed(0)
for fmt in K_FORMATS.values():  # read from files: random blocks, every bit pattern
    for n, k in ((1, 256), (9, 512), (17, 256)):
        q = torch.from_numpy(random_blocks(fmt, n, k, seed=n))
        packed = cpu.pack(q, fmt)
        exact = dequantize(q, fmt, k)
        assert torch.equal(cpu.dequantize_rows(packed, fmt, torch.arange(n), k, n), exact), (fmt.name, n, k)
        assert torch.equal(cpu.dequantize_transposed(packed, fmt, k, n), exact.t()), (fmt.name, n, k)
        for m in (1, 5, 9):
            x = torch.randn(m, k, generator=g)
            # random blocks give weights up to ~100 whose products cancel: summation order (which
            # differs between the vector paths) moves the result by float32 rounding of the terms'
            # size, |x| @ |w|^T, not of the result's; a wrong block or lane is off by that size
            err = (cpu.quant_linear(x, packed, fmt, n) - reference.quant_linear(x, q, fmt, k)).abs()
            size = x.abs() @ exact.abs().t()
            assert bool((err <= 1e-5 * size + 1e-5).all()), (fmt.name, n, k, m, float((err / size).max()))
for fmt in (Q4_0, Q4_1, Q8_0):
    for n, k in ((1, 32), (9, 64), (17, 96), (40, 576)):
        w = torch.randn(n, k, generator=g) * 0.1
        w[:, :32] += 0.2
        q = quantize(w, fmt)
        packed = cpu.pack(q, fmt)
        exact = dequantize(q, fmt, k)
        assert torch.equal(cpu.dequantize_rows(packed, fmt, torch.arange(n), k, n), exact), (fmt.name, n, k)
        assert torch.equal(cpu.dequantize_transposed(packed, fmt, k, n), exact.t()), (fmt.name, n, k)
        for m in (1, 3, 4, 5, 9):
            x = torch.randn(m, k, generator=g)
            torch.testing.assert_close(cpu.quant_linear(x, packed, fmt, n), reference.quant_linear(x, q, fmt, k),
                                       atol=1e-4, rtol=1e-4)
from tests.kernels.test_quant_linear_i8 import ALL, check_against_reference
for name in ALL:  # the int8-activation kernels: VNNI, vpmaddubsw pairs or plain C++ dot products
    for n, k in ((9, 256), (17, 512)):
        check_against_reference(name, n, k, ms=(1, 5, 9))
x, r, wn = torch.randn(3, 64), torch.randn(3, 64), torch.randn(64)
torch.testing.assert_close(cpu.add_rms_norm(x.clone(), r.clone(), wn, 1e-6)[0], reference.add_rms_norm(x, r, wn, 1e-6)[0])
print("ok")
"""


@pytest.mark.skipif(cpu.load() is None, reason="the C++ CPU kernels are not built on this machine")
@pytest.mark.parametrize("isa,expect", [
    ("avx2", ("avx2", 8, "avx_vnni" in cpu.cpu_flags())),
    ("avx2-novnni", ("avx2", 8, False)),
    ("generic", ("scalar", 8, False)),
])
def test_narrower_builds_match_the_reference(isa, expect):
    flags = cpu.cpu_flags()
    if isa.startswith("avx2") and not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    env = {**os.environ, "OCTAVO_CPU_ISA": isa, "OMP_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    lines = done.stdout.split()
    assert (lines[0], int(lines[1]), lines[2] == "True") == expect and lines[-1] == "ok"
