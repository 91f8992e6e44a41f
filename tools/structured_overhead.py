"""What structured outputs cost per step: the same batch of requests decoded with and without a
JSON-schema constraint, on the embedded model, side by side in one run. Both runs generate
exactly the same number of tokens: the constrained run first, then the unconstrained one is
given each request's constrained output length (ignore_eos, max_tokens = that length). The
constrained run's extra time is split into the matchers' bitmask filling (xgrammar, engine
thread) and the rest (mask applied in the sampler).

Run: PYTHONPATH=. .venv/bin/python tools/structured_overhead.py [--requests 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from octavo.llm import LLM
from octavo.sampling.params import SamplingParams, StructuredOutputsParams
from tests.structured.schemas import PET_SCHEMA

SCHEMA = PET_SCHEMA


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llm = LLM()
    manager = llm.engine.structured
    prompts = [f"Describe pet number {i} as JSON:" for i in range(args.requests)]
    so = StructuredOutputsParams(json=SCHEMA)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, structured_outputs=so), use_tqdm=False)  # compile, warm up
    fill_time = [0.0]
    real_bitmask = manager.bitmask

    def timed_bitmask(rows):
        t = time.perf_counter()
        out = real_bitmask(rows)
        fill_time[0] += time.perf_counter() - t
        return out

    manager.bitmask = timed_bitmask
    rows = []
    for r in range(args.rounds):
        fill_time[0] = 0.0
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=r, max_tokens=200, structured_outputs=so), use_tqdm=False)
        constrained = time.perf_counter() - t
        fill = fill_time[0]
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        t = time.perf_counter()
        llm.generate(prompts, [SamplingParams(temperature=1.0, seed=r, max_tokens=n, ignore_eos=True) for n in lengths],
                     use_tqdm=False)
        free = time.perf_counter() - t
        rows.append((sum(lengths), constrained, free, fill))
        print(f"round {r}: {sum(lengths)} tokens each run; constrained {constrained:.2f} s, unconstrained {free:.2f} s "
              f"(x{constrained / free:.3f}); bitmask filling {fill:.3f} s")
    ratio = statistics.median(c / f for _, c, f, _ in rows)
    share = statistics.median(fill / (c - f) if c > f else float("nan") for _, c, f, fill in rows)
    print(f"median constrained / unconstrained time: {ratio:.3f}; bitmask filling share of the extra: {share:.0%}")


if __name__ == "__main__":
    main()
