"""What a mixture-of-experts decode step reads: for B requests decoding together, the experts each
layer runs (counted from the router's choices in the engine's own steps), the expert bytes that
makes against the layer's total, and the step's median time, B = 1, 4, 16.

    .venv/bin/python tools/moe_step_bytes.py /work/bench/qwen3-30b-a3b-16l.Q4_K_M.gguf

Random weights route tokens close to uniformly (the most distinct experts a step can use on
average): a trained router, whose tokens agree more, reads fewer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a mixture-of-experts GGUF")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--steps", type=int, default=24, help="decode steps per batch size (after 4 warm-up steps)")
    args = parser.parse_args()

    from octavo.kernels import dispatch
    from octavo.llm import LLM
    from octavo.models.moe import SparseMoE
    from octavo.sampling.params import SamplingParams

    llm = LLM(model=args.model, max_num_seqs=64)
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not layers:
        print("not a mixture of experts", file=sys.stderr)
        return 1
    expert_bytes = sum(t.numel() * t.element_size() for t in layers[0].experts[0].state_dict().values())
    per_layer_total = expert_bytes * layers[0].num_experts
    counts: list[int] = []
    original = dispatch.moe_route

    def counting(*args, **kwargs):
        weights, ids = original(*args, **kwargs)
        counts.append(int(ids.unique().numel()))  # the experts this layer's step runs
        return weights, ids

    dispatch.moe_route = counting
    print(f"{len(layers)} MoE layers; {layers[0].num_experts} experts of {expert_bytes / 2**20:.2f} MiB, "
          f"{layers[0].top_k} per token; {per_layer_total / 2**20:.0f} MiB of experts per layer")
    print("| requests decoding | experts run per layer (mean) | expert bytes read per step | of all experts | step time (median) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [[(7 * i + 3 * j) % 1000 + 300 for j in range(32)] for i in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 4, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            llm.engine.add_request(f"b{batch}-{i}", prompt, params)
        times, active = [], []
        step = 0
        while llm.engine.has_unfinished_requests():
            counts.clear()
            start = time.perf_counter()
            llm.engine.step()
            elapsed = time.perf_counter() - start
            running = llm.engine.get_stats().scheduler.num_running
            if step >= 4 and running == batch and counts and len(counts) == len(layers):
                times.append(elapsed)
                active.append(statistics.mean(counts))
            step += 1
        if not times:
            continue
        mean_active = statistics.mean(active)
        read = mean_active * expert_bytes * len(layers)
        print(f"| {batch} | {mean_active:.1f} | {read / 2**30:.2f} GiB | {mean_active / layers[0].num_experts:.0%} | "
              f"{statistics.median(times) * 1e3:.0f} ms |")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
