"""Greedy tokens with the second KV tier on vs off, request by request, over the oracle's modes.

    .venv/bin/python tools/tier_mismatches.py [--requests 1000] [--max-tokens 8]

The requests are multi-turn conversations (every turn resends its history) and prompts sharing
system prefixes, so the prefix cache and the tier are busy; each mode runs them through one
engine with a pool of --pool blocks and a tier on disk, and one with the same pool and no tier.
Prints, per mode, the requests whose tokens differ, the tier's traffic and preemptions.
"""

from __future__ import annotations

import argparse
import random
import tempfile

from octavo import LLM, SamplingParams
from octavo.simulator.workload import multi_turn_workload

MODES = {  # name -> engine options beside the pool (the oracle's modes)
    "default": {},
    "chunked, budget 32": {"max_num_batched_tokens": 32},
    "block size 8": {"block_size": 8},
    "priority policy": {"scheduling_policy": "priority"},
    "host-memory tier": {"kv_offload_medium": "host"},
}


def requests(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    convs = multi_turn_workload(max(1, num // 8), 4, system_len=96, user_len=24, answer_len=8, seed=seed)
    prompts = [list(t.prompt_token_ids) for c in convs for t in c]
    systems = [[rng.randrange(1000, 30000) for _ in range(128)] for _ in range(4)]
    while len(prompts) < num:
        prompts.append(rng.choice(systems) + [rng.randrange(1000, 30000) for _ in range(rng.randint(4, 80))])
    rng.shuffle(prompts)
    return prompts[:num]


def run(prompts, params, priorities, **options) -> tuple[list[list[int]], object]:
    with LLM(**options) as llm:
        outs = llm.generate(prompts, params, priority=priorities, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine.get_stats().scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="in all, split over the modes")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--pool", type=int, default=48, help="KV blocks of both engines")
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    per_mode = -(-args.requests // len(MODES))
    total = mismatched = 0
    for i, (mode, options) in enumerate(MODES.items()):
        prompts = requests(per_mode, seed=i)
        priorities = [j % 3 for j in range(len(prompts))]
        pool = args.pool * (16 // options.get("block_size", 16))
        off, _ = run(prompts, params, priorities, num_kv_blocks=pool,
                     **{k: v for k, v in options.items() if not k.startswith("kv_offload")})
        with tempfile.TemporaryDirectory() as folder:
            where = {} if options.get("kv_offload_medium") == "host" else {"kv_offload_path": folder}
            on, stats = run(prompts, params, priorities, num_kv_blocks=pool, kv_offload_size=1 << 30, **where, **options)
        bad = [j for j, (a, b) in enumerate(zip(off, on)) if a != b]
        total += len(prompts)
        mismatched += len(bad)
        print(f"{mode}: {len(bad)} of {len(prompts)} requests differ; tier blocks stored {stats.tier.num_stored}, "
              f"loaded {stats.tier.num_loaded}; tier hits {stats.prefix.num_tier_hits_tokens} of {stats.prefix.num_hits_tokens} hit tokens; "
              f"preemptions {stats.preemption.num_preemptions}, tier load rounds {stats.tier.num_load_rounds}" + (f"; first differing: {bad[:5]}" if bad else ""), flush=True)
    print(f"in all: {mismatched} of {total} greedy requests differ with the tier on")


if __name__ == "__main__":
    main()
