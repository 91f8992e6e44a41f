"""One-row (decode) rate of the int8 kernels on layers streamed from DRAM, with the weights' software
prefetch on and off side by side in one process (rounds alternate), beside a plain read of as many
bytes: the measurement behind octavo.cpu_features.weight_prefetch's per-CPU rule.

    OMP_NUM_THREADS=2 .venv/bin/python tools/kernel_stream.py [--rounds 7]

Each shape is held in enough copies to pass the L3 cache (so every call reads DRAM, as a decode
step does), at the Llama-3.2-1B shape's largest layers. A shared machine's bandwidth can swing
between runs (47-97 GB/s on one Zen 5 in one hour): compare columns of one run, never runs.
Prints a markdown table of medians (GB/s of weight bytes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant_kernels import random_blocks  # noqa: E402

from octavo.kernels import cpu  # noqa: E402
from octavo.quantization import FORMATS  # noqa: E402

# (format, out_features, in_features, copies, what)
SHAPES = [
    ("Q4_K", 16384, 2048, 8, "1B gate+up"),
    ("Q6_K", 2048, 8192, 10, "1B down"),
    ("Q6_K", 128256, 2048, 1, "1B tied head"),
    ("Q4_K", 2048, 2048, 24, "1B o_proj"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    lib = cpu.load()
    if lib is None:
        raise SystemExit("the C++ CPU kernels are not built on this machine")
    rule = lib.weight_prefetch()
    layers = []
    for name, n, k, copies, what in SHAPES:
        fmt = FORMATS[name]
        packed = cpu.pack_i8(random_blocks(name, n, k), fmt)
        layers.append((what, name, n, fmt, [packed.clone() for _ in range(copies)], torch.randn(1, k)))
    plain = torch.empty(200_000_000 // 8, dtype=torch.int64).random_(0, 255)
    rates: dict[tuple[str, bool], list[float]] = {(layer[0], on): [] for layer in layers for on in (True, False)}
    reads = []
    try:
        for _ in range(args.rounds):
            start = time.perf_counter()
            plain.sum()
            reads.append(plain.numel() * 8 / (time.perf_counter() - start) / 1e9)
            for on in (True, False):
                lib.set_weight_prefetch(on)
                for what, _, n, fmt, copies, x in layers:
                    cpu.quant_linear_i8(x, copies[0], fmt, n)
                    start = time.perf_counter()
                    for w in copies:
                        cpu.quant_linear_i8(x, w, fmt, n)
                    rates[(what, on)].append(sum(w.numel() for w in copies) / (time.perf_counter() - start) / 1e9)
    finally:
        lib.set_weight_prefetch(rule)
    print(f"{torch.get_num_threads()} threads, {cpu.quant_isa()}; this CPU's rule: prefetch {'on' if rule else 'off'}; "
          f"plain read of 200 MB per round: {' '.join(f'{r:.0f}' for r in reads)} GB/s")
    print("| layer | format | MB streamed | prefetch on GB/s | prefetch off GB/s | off / on |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for what, name, _, _, copies, _ in layers:
        on, off = statistics.median(rates[(what, True)]), statistics.median(rates[(what, False)])
        print(f"| {what} | {name} | {sum(w.numel() for w in copies) / 1e6:.0f} | {on:.1f} | {off:.1f} | {off / on:.2f}x |")


if __name__ == "__main__":
    main()
