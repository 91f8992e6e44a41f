"""The KV pool zero-filled at start against pages taken as written: resident memory of a built
engine, the first step (a prefill) and the first ten steps under load. One mode per process; run
them alternately, several times, and compare medians.

Run: PYTHONPATH=. .venv/bin/python tools/kv_pool_first_steps.py lazy|zero
(OMP_NUM_THREADS=2 OCTAVO_ADAPTIVE_THREADS=0 for the figures in docs/BENCHMARKS.md)
"""

from __future__ import annotations

import sys
import time

import torch

import octavo.model_runner as model_runner


def zero_filled(model_config, num_blocks, block_size, dtype, device):
    """The allocation before 2026-12-01: every page written (zeros) at start."""
    shape = (num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model_config.num_layers)]


def rss_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20


def main(mode: str) -> None:
    if mode == "zero":
        model_runner.allocate_kv_caches = zero_filled
    from octavo.engine import LLMEngine
    from octavo.sampling.params import SamplingParams

    start = time.time()
    engine = LLMEngine.from_args()
    build_s, idle = time.time() - start, rss_mib()
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    for i in range(32):
        engine.add_request(str(i), [100 + i] + [(j * 7 + i) % 40000 + 10 for j in range(600)], params)
    steps = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    print(f"{mode}: build {build_s:.2f} s, idle RSS {idle:.0f} MiB, first step {steps[0] * 1e3:.0f} ms, "
          f"first 10 steps {sum(steps[:10]):.2f} s, all {sum(steps):.2f} s ({len(steps)} steps), RSS after {rss_mib():.0f} MiB")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("lazy", "zero"):
        raise SystemExit(__doc__)
    main(sys.argv[1])
