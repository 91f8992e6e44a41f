"""Time the quantized linear kernels, float32 activations (exact) against int8 (quant_linear_i8),
on layer shapes of real models, side by side in one process: medians of repeated calls.

    OMP_NUM_THREADS=2 .venv/bin/python tools/bench_quant_kernels.py [--rows 1,4,16,64,256]
    OCTAVO_AMX=1 ... (adds the AMX-INT8 tile path's column, for 16+ rows, where it passes its self-test)

Where AMX-BF16 tiles run (a forked child's self-test), a column for the int8 mode's prompt-row
kernel (`quant_linear_bf16_i8`: x and W rounded to bfloat16) against the int8 one.

Weights are random blocks (every bit pattern; fp16 fields kept finite): the kernels' cost does not
depend on the values. A layer of a few MB sits in the L3 cache between calls, so a real decode
step, which streams every layer from DRAM once, runs closer to its byte floor than these figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from octavo.kernels import cpu
from octavo.quantization import FORMATS

# (format, out_features, in_features, what)
SHAPES = [
    ("Q4_K", 16384, 2048, "Llama-3.2-1B gate|up"),
    ("Q6_K", 2048, 8192, "Llama-3.2-1B down"),
    ("Q4_1", 3072, 576, "SmolLM2-135M gate|up"),
    ("Q8_0", 49152, 576, "SmolLM2-135M tied head"),
    ("MXFP4", 5760, 2880, "gpt-oss-20b expert gate|up"),
]
FP16_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
           "Q6_K": [208], "MXFP4": []}


def random_blocks(name: str, rows: int, cols: int) -> torch.Tensor:
    fmt = FORMATS[name]
    g = np.random.default_rng(0)
    blocks = g.integers(0, 256, size=(rows, cols // fmt.block_size, fmt.block_bytes), dtype=np.uint8)
    for at in FP16_AT[name]:
        blocks[..., at : at + 2] = g.uniform(-0.05, 0.05, size=blocks.shape[:2] + (1,)).astype(np.float16).view(np.uint8)
    if name == "MXFP4":  # E8M0 exponents of ordinary weights (random bytes reach 2^127)
        blocks[..., 0] = g.integers(118, 124, size=blocks.shape[:2])
    return torch.from_numpy(blocks.reshape(rows, -1))


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,64,256", help="activation rows (tokens of a step)")
    args = parser.parse_args()
    amx, tiles = cpu.amx_enabled(), cpu.amx_bf16_enabled()
    print(f"{torch.get_num_threads()} threads, {cpu.quant_isa()}, int8 dot products: "
          f"{'VNNI' if cpu.quant_vnni() else 'vpmaddubsw'}{', AMX-INT8 tiles' if amx else ''}"
          f"{', AMX-BF16 prompt tiles' if tiles else ''}")
    print("| layer | format | rows | float32 ms | int8 ms | int8 speed-up |" + (" int8 AMX ms | AMX vs vectors |" if amx else "")
          + (" bf16 tiles ms | tiles vs int8 |" if tiles else ""))
    print("| --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if amx else "") + (" --- | --- |" if tiles else ""))
    for name, n, k, what in SHAPES:
        fmt = FORMATS[name]
        q = random_blocks(name, n, k)
        packed, packed_i8 = cpu.pack(q, fmt), cpu.pack_i8(q, fmt)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k)
            reps = 15 if m < 64 else 5
            f = median_ms(lambda: cpu.quant_linear(x, packed, fmt, n), reps)
            if amx:
                cpu.load().amx_enable(False)
            i = median_ms(lambda: cpu.quant_linear_i8(x, packed_i8, fmt, n), reps)
            row = f"| {what} {n}x{k} | {name} | {m} | {f:.2f} | {i:.2f} | {f / i:.2f}x |"
            if amx:
                cpu.load().amx_enable(True)
                a = median_ms(lambda: cpu.quant_linear_i8(x, packed_i8, fmt, n), reps) if m >= 16 else float("nan")
                row += f" {a:.2f} | {i / a:.2f}x |"
            if tiles:
                b = median_ms(lambda: cpu.quant_linear_bf16_i8(x, packed_i8, fmt, n), reps)
                row += f" {b:.2f} | {i / b:.2f}x |"
            print(row)


if __name__ == "__main__":
    main()
