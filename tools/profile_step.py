"""Where one engine step's time goes, at a fixed batch of decodes (docs/BENCHMARKS.md quotes it).

    .venv/bin/python tools/profile_step.py --batch 1 --batch 64 [--quantization none --dtype float32]
    .venv/bin/python tools/profile_step.py --model gemma3-270m --batch 1

Each of `--batch` requests gets a 128-token prompt; after warm-up steps, N decode steps are timed
with timers around the kernel dispatch functions and the runner's parts. Works on older checkouts
too (it wraps whichever dispatch functions exist), for before/after tables.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import time

from octavo.engine import LLMEngine
from octavo.engine_args import EngineArgs
from octavo.kernels import dispatch
from octavo.sampling.params import SamplingParams

CATEGORIES = {
    "linear": ("linear", "quant_linear"),
    "attention": ("paged_attention",),
    "norm": ("rms_norm", "add_rms_norm"),
    "rotary + KV write": ("apply_rotary", "write_kv", "rotary_write_kv"),
    "act x up": ("silu_and_mul", "act_and_mul"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, action="append", default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--activation-dtype", default=None, help="int8 or float32 (default: the engine's)")
    parser.add_argument("--model", default=None, help="a packaged model's name, .gguf or directory (default: embedded)")
    args = parser.parse_args()
    seconds: collections.Counter[str] = collections.Counter()

    def timed(owner, name, category):
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[category] += time.perf_counter() - start

        setattr(owner, name, wrapper)

    for category, names in CATEGORIES.items():
        for name in names:
            if hasattr(dispatch, name):
                timed(dispatch, name, category)
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    kwargs = {"dtype": args.dtype, "max_num_seqs": 256}
    if args.model is not None:
        kwargs["model"] = args.model
    if args.quantization is not None and "quantization" in fields:
        kwargs["quantization"] = args.quantization
    if args.activation_dtype is not None and "activation_dtype" in fields:
        kwargs["activation_dtype"] = args.activation_dtype
    engine = LLMEngine.from_args(EngineArgs(**kwargs))
    model = engine.runner.model
    timed(engine.runner, "execute", "_execute")
    timed(model, "forward", "_forward")
    head = model.compute_logits

    def compute_logits(*a, **k):  # its linear is the LM head: count it here, not under "linear"
        linear_before, start = seconds["linear"], time.perf_counter()
        try:
            return head(*a, **k)
        finally:
            seconds["LM head + logits"] += time.perf_counter() - start
            seconds["linear"] = linear_before

    model.compute_logits = compute_logits
    timed(engine.scheduler, "schedule", "scheduler")
    timed(engine.scheduler, "update", "scheduler")
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    print("| batch | step ms | " + " | ".join([*CATEGORIES, "LM head + logits", "model glue", "runner (inputs, sampler)", "scheduler", "engine rest"]) + " |")
    for batch in args.batch or [1, 64]:
        for i in range(batch):
            engine.add_request(f"b{batch}-{i}", [(1000 + 37 * i + j) % 40000 for j in range(128)], params)
        while engine.scheduler.num_waiting:  # admit everything
            engine.step()
        for _ in range(8):  # finish the last prefill chunks; from here every step decodes `batch` tokens
            engine.step()
        seconds.clear()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        total = (time.perf_counter() - start) / args.steps * 1e3
        ms = {k: v / args.steps * 1e3 for k, v in seconds.items()}
        kernels = sum(ms.get(c, 0.0) for c in CATEGORIES)
        glue = ms["_forward"] - kernels  # the forward's Python between its kernels
        cells = [ms.get(c, 0.0) for c in CATEGORIES]
        lm = ms["LM head + logits"]
        # the LM head's linear is counted inside "LM head + logits", not in "linear" of the forward
        runner_rest = ms["_execute"] - ms["_forward"] - lm
        rest = total - ms["_execute"] - ms.get("scheduler", 0.0)
        row = [f"{v:.2f}" for v in cells] + [f"{lm:.2f}", f"{glue:.2f}", f"{runner_rest:.2f}", f"{ms.get('scheduler', 0.0):.2f}", f"{rest:.2f}"]
        print(f"| {batch} | {total:.2f} | " + " | ".join(row) + " |")
        engine.abort_request([f"b{batch}-{i}" for i in range(batch)])
        while engine.has_unfinished_requests():
            engine.step()


if __name__ == "__main__":
    main()
