"""Time per output token of one greedy request through `LLM.generate`, without a server:
(t(65 tokens) - t(1 token)) / 64, median of 3 pairs. For A/B runs of two trees on one machine:
    for t in /path/old /path/new; do (cd $t && PYTHONPATH=$t OMP_NUM_THREADS=2 python tools/decode_tpot.py FILE.gguf); done
"""

from __future__ import annotations

import argparse
import statistics
import time

from octavo import LLM
from octavo.sampling.params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="a .gguf path or a packaged model name (default: the embedded one)")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--activation-dtype", default=None, help="as octavo serve takes it (default: serve's default)")
    args = parser.parse_args()
    llm = LLM(args.model, **({"activation_dtype": args.activation_dtype} if args.activation_dtype else {}))
    prompt = "The history of the city begins " * 8

    def run(n: int) -> float:
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - t

    run(4)  # warm-up: first-call allocations
    per_token = []
    for _ in range(3):
        first = run(1)
        per_token.append((run(args.steps + 1) - first) / args.steps)
    print(f"TPOT {statistics.median(per_token) * 1e3:.1f} ms (runs {[round(x * 1e3, 1) for x in per_token]})")


if __name__ == "__main__":
    main()
