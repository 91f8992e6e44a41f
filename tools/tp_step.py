"""Tensor parallelism's step cost on the CPU: decode-step time at TP=1 and TP=N (dense embedded
model, gloo, the cores shared between the ranks) and the time rank 0 spends in its all-reduces and
the logits gather. No speed target on two cores: this shows where the time goes.

Run: PYTHONPATH=. .venv/bin/python tools/tp_step.py [--tp 3] [--batch 8] [--context 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch.distributed as dist

from octavo.engine import LLMEngine
from octavo.engine_args import EngineArgs
from octavo.sampling.params import SamplingParams


def step_times(tp: int, batch: int, context: int, steps: int) -> tuple[float, float]:
    """(median step seconds, median seconds of rank 0's collectives per step)."""
    engine = LLMEngine.from_args(EngineArgs(tensor_parallel_size=tp, dtype="float32", quantization="none",
                                            kv_cache_memory=256 << 20))
    spent = [0.0]
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[0] += time.perf_counter() - start
            return out
        return wrapper

    try:
        params = SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True)
        for i in range(batch):
            engine.add_request(str(i), [(7 * i + j) % 4000 + 10 for j in range(context)], params)
        while engine.scheduler.stats().num_waiting or engine.get_stats().scheduler.num_scheduled_tokens != batch:
            engine.step()
        for name, fn in originals.items():
            setattr(dist, name, timed(fn))
        totals, comms = [], []
        for _ in range(steps):
            spent[0] = 0.0
            start = time.perf_counter()
            engine.step()
            totals.append(time.perf_counter() - start)
            comms.append(spent[0])
        return statistics.median(totals), statistics.median(comms)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    print("| TP | decode step (median) | rank 0 in all-reduce + gather | share |\n| ---: | ---: | ---: | ---: |")
    for tp in (1, args.tp):
        total, comm = step_times(tp, args.batch, args.context, args.steps)
        print(f"| {tp} | {total * 1e3:.1f} ms | {comm * 1e3:.1f} ms | {comm / total:.0%} |", flush=True)


if __name__ == "__main__":
    main()
