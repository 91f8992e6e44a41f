"""Wall time per kernel category over a whole offline run (the profile quoted in docs/BENCHMARKS.md).

    .venv/bin/python tools/profile_categories.py ../shared/workloads/random_n64.json [--attention-backend reference]

It wraps the dispatch functions (and the runner's and scheduler's entry points) in timers and
replays the workload through LLMEngine, greedy, output lengths forced, all requests at t = 0.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

from octavo.engine import LLMEngine
from octavo.engine_args import EngineArgs
from octavo.kernels import dispatch
from octavo.sampling.params import SamplingParams

SECONDS: collections.Counter[str] = collections.Counter()
CALLS: collections.Counter[str] = collections.Counter()


def timed(fn, category):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[category] += time.perf_counter() - start
            CALLS[category] += 1

    return wrapper


def attention(q, k_cache, v_cache, meta, scale, _inner=dispatch.paged_attention):
    category = "attention, decode-only steps" if q.shape[0] == meta.num_decode_tokens else "attention, steps with prefill"
    return timed(_inner, category)(q, k_cache, v_cache, meta, scale)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", help="JSON: {requests: [{prompt_token_ids, max_tokens}]} or a list of them")
    parser.add_argument("--attention-backend", default="auto")
    args = parser.parse_args()
    data = json.load(open(args.workload))
    requests = data["requests"] if isinstance(data, dict) else data

    dispatch.paged_attention = attention
    for name in ("linear", "quant_linear", "rms_norm", "add_rms_norm", "apply_rotary", "rotary_write_kv",
                 "silu_and_mul", "write_kv"):
        if hasattr(dispatch, name):  # older checkouts lack the fused and quantized ones
            setattr(dispatch, name, timed(getattr(dispatch, name), name))
    engine = LLMEngine.from_args(EngineArgs(attention_backend=args.attention_backend))
    engine.runner.prepare = timed(engine.runner.prepare, "runner.prepare (inputs, metadata)")
    engine.scheduler.schedule = timed(engine.scheduler.schedule, "scheduler.schedule")
    engine.scheduler.update = timed(engine.scheduler.update, "scheduler.update")
    for i, r in enumerate(requests):
        params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0)
        engine.add_request(str(i), r["prompt_token_ids"], params)
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    num_out = sum(r["max_tokens"] for r in requests)
    print(f"{len(requests)} requests, {steps} steps, {elapsed:.1f} s, {num_out / elapsed:.1f} output tok/s")
    print(f"{'category':34s} {'seconds':>8s} {'share':>6s} {'calls':>7s}")
    for category, seconds in SECONDS.most_common():
        print(f"{category:34s} {seconds:8.2f} {seconds / elapsed:6.1%} {CALLS[category]:7d}")
    print(f"{'everything else':34s} {elapsed - sum(SECONDS.values()):8.2f}")


if __name__ == "__main__":
    main()
