"""What the dashboard costs a busy engine: one snapshot (built on the engine thread, then
serialised) against one engine step, with the default KV pool and N requests decoding.

    .venv/bin/python tools/dashboard_cost.py [--requests 32]
    .venv/bin/python tools/dashboard_cost.py --no-model   # the builder alone, same pool shape

--no-model: the real scheduler and KV-cache manager with a 5,825-block pool and the same requests,
no model (tokens made up): the snapshot's own cost, measured in a few seconds.

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


def without_model(args: argparse.Namespace) -> None:
    from octavo.config import SchedulerConfig
    from octavo.outputs import StepLog, StepRecord
    from octavo.kv_cache.manager import KVCacheManager
    from octavo.outputs import ModelRunnerOutput
    from octavo.request import Request
    from octavo.scheduler import Scheduler

    cfg = SchedulerConfig(max_num_batched_tokens=1 << 16, max_num_seqs=256, max_model_len=2048, admission_headroom_steps=0)
    scheduler = Scheduler(cfg, KVCacheManager(5825, 16))
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i in range(args.requests):
        scheduler.add_request(Request(str(i), [100 + (7 * i + j) % 30000 for j in range(args.prompt_len)], params, 0.0))
    for _ in range(3):
        out = scheduler.schedule()
        scheduler.update(out, ModelRunnerOutput(tokens={sid: [7] for e in out.scheduled for sid in e.sample_ids}))
    steps = StepLog()
    for i in range(steps.records.maxlen):
        steps.add(StepRecord(i, float(i), 0.05, 0, args.requests, args.requests, 0))
    times = []
    for _ in range(50):
        start = time.perf_counter()
        json.dumps(build_snapshot(scheduler, steps), separators=(",", ":"))
        times.append(time.perf_counter() - start)
    print(f"pool 5825 blocks, {args.requests} requests decoding, no model: snapshot {statistics.median(times) * 1e3:.2f} ms "
          "(median of 50)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--no-model", action="store_true", help="the snapshot builder alone (see above)")
    args = ap.parse_args()
    if args.no_model:
        without_model(args)
        return
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
