"""Where one user's decode step goes, on a real model: the whole step (forward + LM head) against the
head alone, the bytes each reads and the rate that makes, beside this machine's copy bandwidth.

    .venv/bin/python tools/decode_step_cost.py gemma3-270m        # or a .gguf path; default: embedded
Prints a markdown table (medians of --repeats runs, after warm-up) for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from octavo.config import CacheConfig
from octavo.model_runner import ModelRunner
from octavo.models.layers import QuantLinear
from octavo.models.loader import load_model, resolve_model
from octavo.outputs import SampleRow, ScheduledRequest
from octavo.sampling.params import SamplingParams


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in [*module.parameters(), *module.buffers()] if b.dtype != torch.float32 or b.dim() > 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--context", type=int, default=128, help="tokens already in the sequence")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    model_dir = resolve_model(args.model)
    model, cfg = load_model(model_dir, quantization="auto")
    bs = 16
    num_blocks = -(-(args.context + 1) // bs) * len(cfg.kv_groups())
    runner = ModelRunner(model, cfg, CacheConfig(block_size=bs, num_blocks=num_blocks), eos_token_ids=())
    groups = len(cfg.kv_groups())
    per_group = num_blocks // groups
    tables = [list(range(g * per_group, (g + 1) * per_group)) for g in range(groups)]
    prompt = [(7 * i + 3) % cfg.vocab_size for i in range(args.context)]
    entry = ScheduledRequest("a", prompt, 0, tables, SamplingParams(temperature=0), [], prompt)
    with torch.inference_mode():
        ids, pos, meta = runner.prepare([entry])
        model(ids, pos, runner.kv_caches, meta)  # the context, once
        step = ScheduledRequest("a", [11], args.context, tables, SamplingParams(temperature=0), [SampleRow("a")],
                                prompt)
        ids, pos, meta = runner.prepare([step])
        hidden = model(ids, pos, runner.kv_caches, meta)
        whole = median_ms(lambda: model.compute_logits(model(ids, pos, runner.kv_caches, meta)), args.repeats)
        head = median_ms(lambda: model.compute_logits(hidden), args.repeats)
    head_module = model.lm_head if model.lm_head is not None else model.embed_tokens
    head_bytes = weight_bytes(head_module)
    body_bytes = sum(weight_bytes(m) for m in model.modules() if isinstance(m, (QuantLinear, torch.nn.Linear))
                     and m is not head_module)
    big = torch.empty(head_bytes // 8, dtype=torch.int64).random_(0, 255)
    dst = torch.empty_like(big)  # preallocated: a fresh clone would time page faults, not bandwidth
    copy = median_ms(lambda: dst.copy_(big), max(5, args.repeats // 3))
    read = median_ms(lambda: big.sum(), max(5, args.repeats // 3))
    print(f"model {model_dir.name}, context {args.context}, threads {torch.get_num_threads()}")
    print("| part | ms (median) | MB read | GB/s |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| whole decode step (1 user) | {whole:.2f} | {(head_bytes + body_bytes) / 1e6:.0f} | {(head_bytes + body_bytes) / whole / 1e6:.1f} |")
    print(f"| LM head alone ({type(head_module).__name__}, {getattr(head_module, 'fmt', None) and head_module.fmt.name}) "
          f"| {head:.2f} | {head_bytes / 1e6:.0f} | {head_bytes / head / 1e6:.1f} |")
    print(f"| copy of as many bytes (read + write) | {copy:.2f} | {head_bytes / 1e6:.0f} | {2 * head_bytes / copy / 1e6:.1f} |")
    print(f"| sum of as many bytes (read only) | {read:.2f} | {head_bytes / 1e6:.0f} | {head_bytes / read / 1e6:.1f} |")
    print(f"head share of the step: {head / whole:.0%}")


if __name__ == "__main__":
    main()
