"""Time per output token of one greedy request through `LLM.generate`, without a server:
(t(65 tokens) - t(1 token)) / 64, median of 3 pairs. For A/B runs of two trees on one machine:
    for t in /path/old /path/new; do (cd $t && PYTHONPATH=$t OMP_NUM_THREADS=2 python tools/decode_tpot.py FILE.gguf); done
At a long context, per KV dtype (the prompt's blocks come from the prefix cache after the first
run, so each timed run decodes over `--context` tokens without computing them again):
    OMP_NUM_THREADS=2 python tools/decode_tpot.py FILE.gguf --context 8192 --kv-cache-dtype int8
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from octavo import LLM
from octavo.sampling.params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="a .gguf path or a packaged model name (default: the embedded one)")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--activation-dtype", default=None, help="as octavo serve takes it (default: serve's default)")
    parser.add_argument("--kv-cache-dtype", default=None, help="as octavo serve takes it (default: serve's default)")
    parser.add_argument("--context", type=int, default=None,
                        help="a prompt of this many tokens (default: a short sentence, repeated 8 times)")
    args = parser.parse_args()
    kw = {k: v for k, v in (("activation_dtype", args.activation_dtype), ("kv_cache_dtype", args.kv_cache_dtype)) if v}
    if args.context:
        kw["max_model_len"] = args.context + args.steps + 8
    llm = LLM(args.model, **kw)
    if args.context:  # token ids: random ones in the vocabulary's lower half, seeded
        rng = random.Random(0)
        prompt = {"prompt_token_ids": [rng.randrange(100, 10_000) for _ in range(args.context)]}
    else:
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
