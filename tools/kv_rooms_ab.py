"""The same engine workloads on whichever checkout PYTHONPATH points at: counters that must not move
when the KV cache, the tier or speculative decoding are rearranged, and their wall time.

    PYTHONPATH=/path/to/checkout .venv/bin/python tools/kv_rooms_ab.py --json out.json

Workloads (greedy, so every counter is deterministic on one machine):
- gemma-tier: Gemma 3 270M (one global and five sliding-window KV groups), a pool of 480 blocks
  and a disk tier: a 2,000-token prompt, another that evicts it, then one sharing its first
  1,200 tokens (its blocks come back from the tier).
- spec-copy: SmolLM2, prompt-lookup drafts (ngram), four prompts whose answers copy the prompt.
- spec-tier: SmolLM2, drafts with a host-memory tier and a 48-block pool (preemptions swap).
Prints one JSON object per workload: seconds, output tokens' digest, cached tokens, and the
engine's prefix, tier, preemption and drafting counters (read whichever way the checkout keeps them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import tempfile
import time

CODE = """def moving_average(values, window):
    totals = []
    running = 0.0
    for index, value in enumerate(values):
        running += value
        if index >= window:
            running -= values[index - window]
        totals.append(running / min(index + 1, window))
    return totals
"""


def counters(engine) -> dict:
    stats = engine.get_stats()
    s = stats.scheduler
    spec = getattr(stats, "spec", None)
    if hasattr(s, "prefix"):  # the stats in sections by feature (from the commit after 7533a96)
        tier = s.tier
        flat = {"prefix_hits": s.prefix.num_hits_tokens, "preemptions": s.preemption.num_preemptions,
                "recomputed": s.preemption.num_recomputed_tokens, "tier_hits": s.prefix.num_tier_hits_tokens,
                "tier_stored": tier.num_stored if tier else 0, "tier_loaded": tier.num_loaded if tier else 0}
    else:
        flat = {"prefix_hits": s.prefix_cache_hits, "preemptions": s.num_preemptions,
                "recomputed": s.num_recomputed_tokens, "tier_hits": s.tier_hits,
                "tier_stored": s.tier_blocks_stored, "tier_loaded": s.tier_blocks_loaded}
    return {
        **flat, "prompt_tokens_computed": stats.num_prompt_tokens_total, "steps": stats.num_steps,
        "spec_draft_tokens": spec.num_draft_tokens if spec else getattr(s, "spec_num_draft_tokens", 0),
        "spec_accepted": spec.num_accepted_tokens if spec else getattr(s, "spec_num_accepted_tokens", 0),
    }


def run(llm, prompts, params) -> dict:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"seconds": round(seconds, 2), "digest": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16],
            "cached": [o.num_cached_tokens for o in outs]}


def gemma_tier(tmp: str) -> dict:
    from octavo import LLM, SamplingParams

    llm = LLM(model="gemma3-270m", num_kv_blocks=480, max_num_batched_tokens=512, kv_offload_size=512 << 20,
              kv_offload_path=tmp, dtype="float32")
    tok = llm.engine.tokenizer
    text = open(__file__).read() * 4
    sentences = re.split(r"(?<=[.:])\s+", text)
    doc = tok.encode(" ".join(sentences + sentences[::-1]), add_special_tokens=False)
    base, other = doc[:2000], doc[2000:4000]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = [run(llm, [base], greedy), run(llm, [other], greedy), run(llm, [base[:1200] + other[:200]], greedy)]
    out = {"seconds": round(sum(r["seconds"] for r in results), 2), "digest": [r["digest"] for r in results],
           "cached": [r["cached"][0] for r in results], **counters(llm.engine)}
    llm.close()
    return out


def spec_copy() -> dict:
    from octavo import LLM, SamplingParams

    llm = LLM(speculative_method="ngram", dtype="float32")
    prompts = [f"Here is some code:\n\n{CODE.replace('values', name)}\nRepeat the code above exactly:\n\n"
               for name in ("values", "samples", "prices", "readings")]
    out = {**run(llm, prompts, SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)), **counters(llm.engine)}
    llm.close()
    return out


def spec_tier() -> dict:
    from octavo import LLM, SamplingParams

    llm = LLM(num_kv_blocks=48, max_num_batched_tokens=128, kv_offload_size=256 << 20, kv_offload_medium="host",
              speculative_method="ngram", speculative_max_batch=16, admission_headroom_steps=0, dtype="float32")
    prompts = [f"{CODE}\n# variant {i}: repeat it with comments\n" * 2 for i in range(8)]
    out = {**run(llm, prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)), **counters(llm.engine)}
    llm.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--only", default=None, help="one workload: gemma-tier, spec-copy, spec-tier")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("gemma-tier", lambda: gemma_tier(tmp)), ("spec-copy", spec_copy), ("spec-tier", spec_tier)):
            if args.only in (None, name):
                results[name] = fn()
                print(name, json.dumps(results[name]), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
