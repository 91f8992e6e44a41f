"""KV blocks one long sequence holds, read from the engine's pool while it runs, against what a
cache blind to sliding windows would hold for it (one block per 16 tokens in every KV group).

    .venv/bin/python tools/kv_per_sequence.py gemma3-270m --tokens 8192
Prints the blocks held after the last step (and the most held at any step), the window-blind
count, their ratio, and the engine's own capacity line (the figures /metrics exports).
"""

from __future__ import annotations

import argparse

from octavo.engine import LLMEngine
from octavo.engine_args import EngineArgs
from octavo.sampling.params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="gemma3-270m")
    ap.add_argument("--tokens", type=int, default=8192, help="prompt + output tokens of the sequence")
    ap.add_argument("--output", type=int, default=32, help="output tokens (the rest is prompt)")
    args = ap.parse_args()
    engine = LLMEngine.from_args(EngineArgs(model=args.model, max_model_len=args.tokens, kv_cache_memory=1 << 30))
    cfg = engine.config.model_config
    prompt = [(7 * i + 3) % 20000 + 1000 for i in range(args.tokens - args.output)]
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True))
    kv = engine.scheduler.kv_cache
    most = last = 0
    while engine.has_unfinished_requests():
        engine.step()
        held = len(kv.view().held_blocks("long"))
        if held:
            last = held
        most = max(most, held)
    bs = engine.config.cache.block_size
    blind = len(cfg.kv_groups()) * -(-args.tokens // bs)
    print(engine.kv_sizing.describe())
    print("| model | tokens | blocks held at the end | most held (a step) | window-blind | held / blind |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {args.model} | {args.tokens} | {last} | {most} | {blind} | {last / blind:.1%} |")


if __name__ == "__main__":
    main()
