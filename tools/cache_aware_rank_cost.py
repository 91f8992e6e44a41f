"""What ranking the waiting queue by cached tokens costs per step, against fcfs, with no model.

    .venv/bin/python tools/cache_aware_rank_cost.py [--waiting 1024] [--prefix-len 1024] [--steps 50]

A pool holding 16 system prompts of --prefix-len tokens; --waiting requests wait, each one of the
prompts (or, for a tenth, a prompt of its own) plus a 32-token suffix. Times what the cache-aware
policy adds to a step, ranking the queue (a walk of each request's block hashes up to its first
miss, then a sort), over --steps repeats; and `schedule()` of a step that can admit nobody
(max_num_seqs reached) under fcfs and cache-aware, where the ranking is skipped.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from octavo.config import SchedulerConfig
from octavo.kv_cache.manager import KVCacheManager
from octavo.outputs import ModelRunnerOutput
from octavo.policies import cache_aware_key
from octavo.request import Request
from octavo.sampling.params import SamplingParams
from octavo.scheduler import Scheduler


def build(policy: str, prompts: list[list[int]], waiting: list[list[int]], block_size: int) -> Scheduler:
    num_blocks = sum(len(p) for p in prompts) // block_size + 256
    cfg = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=1, max_model_len=4096, policy=policy)
    s = Scheduler(cfg, KVCacheManager(num_blocks, block_size))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i, prompt in enumerate(prompts):  # compute each system prompt once: its blocks stay cached
        s.add_request(Request(f"warm{i}", prompt + [1], params, arrival_time=0.0))
        while s.has_unfinished_requests():
            out = s.schedule()
            s.update(out, ModelRunnerOutput(tokens={sid: [2] for e in out.scheduled for sid in e.sample_ids}))
    s.add_request(Request("running", [3] * 8, SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True),
                          arrival_time=0.0))
    out = s.schedule()  # it takes the one seat: the waiting requests below stay waiting
    s.update(out, ModelRunnerOutput(tokens={sid: [2] for e in out.scheduled for sid in e.sample_ids}))
    for i, prompt in enumerate(waiting):
        s.add_request(Request(f"w{i}", prompt, params, arrival_time=1.0 + i))
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--waiting", type=int, default=1024)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(4, 49152) for _ in range(n)]

    prompts = [tokens(args.prefix_len) for _ in range(16)]
    waiting = [(tokens(args.prefix_len) if i % 10 == 9 else prompts[i % 16]) + tokens(32) for i in range(args.waiting)]
    s = build("cache-aware", prompts, waiting, args.block_size)
    times = []
    for _ in range(args.steps + 1):  # the first one hashes every prompt once: reported apart
        start = time.perf_counter()
        s.waiting.rank(cache_aware_key(s.config, s.kv_cache, s._num_steps))
        times.append(time.perf_counter() - start)
    print(f"rank {args.waiting} waiting by cached tokens: median {1e3 * statistics.median(times[1:]):.2f} ms "
          f"(first, hashing the prompts: {1e3 * times[0]:.1f} ms)")
    for policy in ("fcfs", "cache-aware"):
        s = build(policy, prompts, waiting, args.block_size)
        times = []
        for _ in range(args.steps + 1):  # the first step hashes every prompt once: reported apart
            start = time.perf_counter()
            out = s.schedule()
            times.append(time.perf_counter() - start)
            s.update(out, ModelRunnerOutput(tokens={sid: [2] for e in out.scheduled for sid in e.sample_ids}))
        assert s.num_waiting == args.waiting, "a waiting request was admitted: the measurement is not the order alone"
        print(f"{policy:12s} {args.waiting} waiting: schedule() median {1e3 * statistics.median(times[1:]):.2f} ms "
              f"(first step {1e3 * times[0]:.1f} ms)")


if __name__ == "__main__":
    main()
