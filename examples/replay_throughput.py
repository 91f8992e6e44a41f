"""Rough offline throughput on a replay workload (the benchmark issue builds `octavo bench` on this).

    python examples/replay_throughput.py ../shared/workloads/random_n64.json
"""

from __future__ import annotations

import json
import sys
import time

import torch

from octavo import LLM, SamplingParams


def main(path: str) -> None:
    torch.set_num_threads(2)
    workload = json.load(open(path))["requests"]
    llm = LLM(kv_cache_memory=4 << 30)
    prompts = [r["prompt_token_ids"] for r in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in workload]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert num_out == sum(r["max_tokens"] for r in workload), "every request must produce its forced length"
    num_prompt = sum(len(p) for p in prompts)
    stats = llm.engine.get_stats()
    print(
        f"{len(outs)} requests in {elapsed:.1f} s: {len(outs) / elapsed:.2f} req/s, "
        f"{num_out / elapsed:.1f} output tok/s, {(num_out + num_prompt) / elapsed:.1f} total tok/s; "
        f"steps {stats.num_steps}, preemptions {stats.scheduler.num_preemptions}"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "../shared/workloads/random_n64.json")
