"""Throughput of a mixed 4-adapter LoRA workload beside the base model alone, side by side.

Four rank-16 adapters on every projection are made with peft (seeded, random) in a temporary
directory; the same requests run (1) on the base model with LoRA off, (2) with LoRA on but every
request on the base model (the cost of the wrappers), (3) round-robin over the four adapters in one
batch (max_loras 4). Rounds alternate the three; medians are reported.

Run: PYTHONPATH=. .venv/bin/python tools/lora_throughput.py [--workload ../shared/workloads/random_n64.json] [--rounds 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile

import torch

from octavo.bench.throughput import run_octavo
from octavo.engine import LLMEngine
from octavo.engine_args import EngineArgs
from octavo.lora.request import LoRARequest
from octavo.models.loader import default_gguf_path, load_model, resolve_model, weight_bytes
from octavo.models.registry import load_model_config
from octavo.simulator.workload import trace_workload
from octavo.tokenizer import load_tokenizer


def make_adapters(directory: str, count: int, rank: int) -> list[LoRARequest]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    base = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    out = []
    for i in range(count):
        torch.manual_seed(100 + i)
        model = get_peft_model(copy.deepcopy(base), LoraConfig(
            r=rank, lora_alpha=rank, lora_dropout=0.0, init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        path = f"{directory}/adapter{i}"
        model.save_pretrained(path)
        out.append(LoRARequest(f"adapter{i}", i + 1, path))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="../shared/workloads/random_n64.json")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    workload = trace_workload(args.workload)
    model_dir = resolve_model(None)
    tokenizer = load_tokenizer(model_dir)
    cfg = load_model_config(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(tmp, 4, args.rank)
        base_model, _ = load_model(model_dir, quantization="auto")
        lora_model, _ = load_model(model_dir, quantization="auto")  # wrapped in place by the LoRA engine
        setups = {
            "base model, LoRA off": (base_model, dict(), None),
            "LoRA on, all requests on the base": (lora_model, dict(enable_lora=True, max_loras=4), None),
            "4 adapters, round-robin": (lora_model, dict(enable_lora=True, max_loras=4),
                                        [adapters[i % 4] for i in range(len(workload))]),
        }
        results: dict[str, list[float]] = {name: [] for name in setups}
        for r in range(args.rounds):
            for name, (model, extra, loras) in setups.items():
                engine = LLMEngine(EngineArgs(dtype="float32", max_lora_rank=args.rank, **extra).to_config(cfg),
                                   model, tokenizer, weight_bytes(model))
                res = run_octavo(workload, {}, progress=False, engine=engine, loras=loras)
                results[name].append(res.output_tok_s)
                print(f"round {r + 1}: {name}: {res.output_tok_s:.1f} output tok/s ({res.elapsed_s:.1f} s)", flush=True)
    base = statistics.median(results["base model, LoRA off"])
    print("\n| setup | output tok/s (median) | vs base |\n| --- | ---: | ---: |")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.1f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
