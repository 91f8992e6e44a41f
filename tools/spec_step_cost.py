"""What verifying drafts costs: one engine step's time with each of B decoding requests computing
1 + k tokens (its last token and k drafts) against k = 0, on a real model, from the runner down.

    .venv/bin/python tools/spec_step_cost.py [--model gemma3-270m] [--batches 1,4,8,16] [--drafts 0,1,2,4,8]

Speculation pays for a request while the step's time grows by less than the tokens it keeps:
with k drafts and a mean of a kept per step, (1 + a) tokens for cost(k) / cost(0). Prints a
markdown table of medians (after warm-up) and that ratio, for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from octavo.engine import LLMEngine
from octavo.engine_args import EngineArgs
from octavo.outputs import SampleRow, ScheduledRequest, SchedulerOutput
from octavo.sampling.params import SamplingParams


def step(batch: int, num_drafts: int, context: int, block_size: int) -> SchedulerOutput:
    """B decoding requests at `context` tokens, each with its last token and `num_drafts` drafts."""
    greedy = SamplingParams(temperature=0.0)
    blocks_each = -(-(context + num_drafts + 1) // block_size)
    entries = []
    for b in range(batch):
        tokens = [100 + (7 * b + i) % 5000 for i in range(num_drafts + 1)]
        blocks = list(range(b * blocks_each, (b + 1) * blocks_each))
        row = SampleRow(f"r{b}", 0, [], tokens[1:])
        entries.append(ScheduledRequest(f"r{b}", tokens, context, [blocks], greedy, [row], tokens))
    return SchedulerOutput(entries)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--drafts", default="0,1,2,4,8")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    drafts = [int(k) for k in args.drafts.split(",")]
    need = max(batches) * -(-(args.context + max(drafts) + 1) // 16)
    engine = LLMEngine.from_args(EngineArgs(model=args.model, num_kv_blocks=need + 16))
    runner = engine.runner
    print(f"threads {torch.get_num_threads()}, context {args.context}, attention {runner.attention_backend}")
    print("| decoding requests | " + " | ".join(f"k={k}" for k in drafts) + " |")
    print("| --- |" + " --- |" * len(drafts))
    for batch in batches:
        cells = []
        base = None
        for k in drafts:
            out = step(batch, k, args.context, 16)
            for _ in range(3):
                runner.execute(out)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                runner.execute(out)
                times.append(time.perf_counter() - start)
            ms = statistics.median(times) * 1000
            base = ms if base is None else base
            cells.append(f"{ms:.1f} ms ({ms / base:.2f}x)")
        print(f"| {batch} | " + " | ".join(cells) + " |")
    engine.close()


if __name__ == "__main__":
    main()
