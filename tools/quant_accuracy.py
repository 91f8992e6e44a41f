"""What weight-only quantization at load costs: greedy agreement with the float32 model over the
oracle prompts, and perplexity on the oracle's fixed text (docs/BENCHMARKS.md quotes the output).

    PYTHONPATH=. .venv/bin/python tools/quant_accuracy.py [MODEL_DIR]   # default: the embedded model

Each scheme is compared with --quantization none (every weight float32). "auto" on the embedded
model is the GGUF's own blocks, i.e. the same weights: it must agree fully.
"""

from __future__ import annotations

import argparse
import math

import torch

from octavo.config import CacheConfig
from octavo.engine import LLMEngine
from octavo.engine_args import EngineArgs
from octavo.llm import LLM
from octavo.model_runner import ModelRunner
from octavo.models.loader import load_model, prepare_quantized_layers, quantize_model, resolve_model, weight_bytes
from octavo.outputs import SampleRow, ScheduledRequest
from octavo.quantization import Q4_0
from octavo.sampling.params import SamplingParams
from octavo.tokenizer import load_tokenizer
from tests.oracle.reference import NUM_NEW_TOKENS, TEXT, oracle_prompts


def perplexity(model, cfg, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of each token given the ones before it, in one prefill."""
    blocks = (len(token_ids) + 15) // 16
    runner = ModelRunner(model, cfg, CacheConfig(block_size=16, num_blocks=blocks + 1), eos_token_ids=())
    req = ScheduledRequest("t", token_ids, 0, [list(range(blocks))], SamplingParams(temperature=0), [SampleRow("t")], [])
    ids, pos, meta = runner.prepare([req])
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, pos, runner.kv_caches, meta))  # [n, vocab]
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(token_ids[1:]), reduction="mean")
    return math.exp(float(nll))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--schemes", default="auto,int8,int4,q4_0", help="q4_0: symmetric int4 (no zero point), for contrast")
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    prompts = oracle_prompts(tokenizer)
    text_ids = tokenizer.encode(TEXT)
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)

    def run(quantization: str):
        if quantization == "q4_0":  # not a --quantization choice: int4 without a zero point, for contrast
            model, cfg = load_model(model_dir, quantization="none")
            quantize_model(model, Q4_0)
            prepare_quantized_layers(model)
        else:
            model, cfg = load_model(model_dir, quantization=quantization)
        config = EngineArgs(dtype="float32", kv_cache_memory=256 << 20).to_config(cfg)
        llm = LLM.from_engine(LLMEngine(config, model, tokenizer, weight_bytes(model)))
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        return outs, perplexity(model, cfg, text_ids), weight_bytes(model)

    base, base_ppl, base_bytes = run("none")
    print(f"{len(prompts)} oracle prompts x {NUM_NEW_TOKENS} greedy tokens; perplexity on {len(text_ids)} tokens of fixed text")
    print("| weights | MB | prompts identical | tokens before first divergence | perplexity |")
    print("| --- | ---: | ---: | ---: | ---: |")
    print(f"| none (float32) | {base_bytes / 1e6:.0f} | {len(prompts)}/{len(prompts)} | 100.0% | {base_ppl:.3f} |")
    for scheme in args.schemes.split(","):
        outs, ppl, nbytes = run(scheme)
        same = sum(o == b for o, b in zip(outs, base))
        prefix = sum(next((i for i, (x, y) in enumerate(zip(o, b)) if x != y), len(b)) for o, b in zip(outs, base))
        print(f"| {scheme} | {nbytes / 1e6:.0f} | {same}/{len(prompts)} | {100 * prefix / (len(prompts) * NUM_NEW_TOKENS):.1f}% | {ppl:.3f} |")


if __name__ == "__main__":
    main()
