"""What the dashboard costs a busy engine: one snapshot (built on the engine thread, then
serialised) against one engine step, with the default KV pool and N requests decoding.

    .venv/bin/python tools/dashboard_cost.py [--requests 32]

At most 4 snapshots a second are built however many pages watch, so the share of engine time is
4 x snapshot / 1 s; printed beside the per-step ratio (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from octavo.dashboard.snapshot import build_snapshot
from octavo.engine import LLMEngine
from octavo.engine_args import EngineArgs
from octavo.sampling.params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=512)
    args = ap.parse_args()
    engine = LLMEngine.from_args(EngineArgs())
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(str(i), [100 + (7 * i + j) % 30000 for j in range(args.prompt_len)], params)
    while engine.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()  # every prompt computed: all decode from here
    steps, snaps, sizes = [], [], []
    for _ in range(20):
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
        start = time.perf_counter()
        text = json.dumps(build_snapshot(engine.scheduler, engine.step_log), separators=(",", ":"))
        snaps.append(time.perf_counter() - start)
        sizes.append(len(text))
    step, snap = statistics.median(steps), statistics.median(snaps)
    kv = engine.scheduler.kv_cache
    print(f"pool {kv.num_blocks} blocks, {args.requests} requests decoding")
    print(f"step {step * 1e3:.1f} ms, snapshot {snap * 1e3:.2f} ms ({snap / step:.1%} of a step), "
          f"{statistics.median(sizes) / 1024:.0f} KiB; at 4 a second: {4 * snap:.1%} of the engine's time")
    engine.close()


if __name__ == "__main__":
    main()
