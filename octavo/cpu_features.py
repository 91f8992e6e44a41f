"""What this CPU can do, detected at run time: its feature flags, bf16 units, and (a measurement,
`python -m octavo.cpu_features`) whether this torch's bf16 linear is faster than float32 here. A
leaf: the kernel build, the loader and the tools read it. `--dtype auto` reads the flags only."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpuinfo_text() -> str:
    """/proc/cpuinfo as text ("" where unreadable): the one reader of it."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags_line() -> str:
    """The 'flags' line of /proc/cpuinfo (the processor name where there is none)."""
    for line in cpuinfo_text().splitlines():
        if line.startswith("flags"):
            return line
    return platform.processor()


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as the kernel reports them (/proc/cpuinfo; empty where unreadable)."""
    line = cpu_flags_line()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def cpu_identity(cpuinfo: str | None = None) -> tuple[str, int]:
    """(vendor_id, cpu family) of /proc/cpuinfo's first processor, ("", 0) where unreadable."""
    cpuinfo = cpuinfo_text() if cpuinfo is None else cpuinfo
    vendor, family = "", 0
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "vendor_id" and not vendor:
            vendor = value
        elif key == "cpu family" and not family and value.isdigit():
            family = int(value)
        if vendor and family:
            break
    return vendor, family


# AMD families whose quantized kernels measured faster without software prefetch of the weights:
# 26 = Zen 5 (the 1B shape's decode forward 11.72 -> 10.99 ms side by side, docs/BENCHMARKS.md).
# Not measured elsewhere: kept on (a 2-core Xeon streamed 15% faster with it).
NO_PREFETCH_AMD_FAMILIES = frozenset({26})


def weight_prefetch(cpuinfo: str | None = None, env: str | None = None) -> bool:
    """Whether the quantized kernels prefetch weights ahead in software on this CPU: by the measured
    rule above; OCTAVO_WEIGHT_PREFETCH=1 / 0 forces it (to measure a CPU kind not yet measured)."""
    env = os.environ.get("OCTAVO_WEIGHT_PREFETCH") if env is None else env
    if env:
        if env not in ("0", "1"):
            raise ValueError(f"OCTAVO_WEIGHT_PREFETCH must be 0 or 1, got {env!r}")
        return env == "1"
    vendor, family = cpu_identity(cpuinfo)
    return not (vendor == "AuthenticAMD" and family in NO_PREFETCH_AMD_FAMILIES)


def cpu_has_bf16() -> bool:
    """Whether the CPU has bfloat16 arithmetic units (AVX512_BF16 or AMX-BF16): detected, never assumed."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_matmul_speedups(in_features: int, out_features: int, rows: tuple[int, ...] = (1, 64)) -> dict[int, float]:
    """float32 time / bfloat16 time of this torch's linear on this CPU, per row count, for a layer
    of this shape (8 copies, so that one row reads weights from memory as a decode step does).

    Having bf16 units is not enough: with torch 2.13 on a Xeon with AVX512_BF16 the bf16 product
    was no faster at 1 row and slower at 64 (docs/BENCHMARKS.md). ~0.1-0.3 s. A tool, not a
    start-up step: a timing depends on the machine's load, and a model's numerics must not.
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


def main() -> None:
    """Print the CPU's relevant flags and bf16 / float32 linear speedups at two layer shapes."""
    flags = cpu_flags()
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")
    print("flags:", " ".join(f for f in wanted if f in flags) or "(none of " + ", ".join(wanted) + ")")
    for shape in ((576, 1536), (2048, 8192)):
        speedups = bf16_matmul_speedups(*shape, rows=(1, 8, 64, 512))
        print(f"bf16 linear vs float32, {shape[0]}x{shape[1]}: " + ", ".join(f"{n} rows {v:.2f}x" for n, v in speedups.items()))


if __name__ == "__main__":
    main()
