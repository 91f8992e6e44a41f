"""KV blocks held with copy-on-write sharing vs each sequence owning its blocks, for beam search
and parallel sampling (the vLLM paper's claim: savings of 37.6-55.2% for beam search and 6.1-9.8%
for parallel sampling). One request at a time on the embedded model; after every step, the
distinct blocks its sequences hold are counted against the blocks they would hold if each owned
a copy of its whole context. The saving is 1 - sum(shared) / sum(owned) over the request's steps.

Run: PYTHONPATH=. .venv/bin/python tools/block_sharing.py [--output-len 128]
"""

from __future__ import annotations

import argparse

from octavo.llm import LLM
from octavo.sampling.params import BeamSearchParams, SamplingParams
from tests.oracle.reference import TEXT


def measure(llm: LLM, prompt: list[int], params) -> tuple[float, int, int]:
    engine, s = llm.engine, llm.engine.scheduler
    engine.add_request("m", prompt, params)
    shared_total = owned_total = peak_shared = peak_owned = 0
    while engine.has_unfinished_requests():
        engine.step()
        seqs = [s.requests[r] for r in s.sequences_of("m")]
        tables = [s.kv_cache.block_tables(r.request_id)[0] for r in seqs]
        if len(seqs) < 2:
            continue  # before the fork (the prompt) nothing is shared yet
        shared = len({b for t in tables for b in t})
        owned = sum(s.kv_cache.num_blocks_for(r.num_computed_tokens) for r in seqs)
        shared_total, owned_total = shared_total + shared, owned_total + owned
        peak_shared, peak_owned = max(peak_shared, shared), max(peak_owned, owned)
    return 1 - shared_total / owned_total, peak_shared, peak_owned


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    llm = LLM(kv_cache_memory=1 << 30, enable_prefix_caching=False)
    tokens = llm.get_tokenizer().encode(TEXT * 3)
    print("| prompt tokens | kind | width / n | saving (mean over steps) | peak blocks shared / owned |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for prompt_len in (256, 1024):
        prompt = tokens[:prompt_len]
        for width in (2, 4, 8):
            for kind, params in (
                ("beam search", BeamSearchParams(width, max_tokens=args.output_len, ignore_eos=True)),
                ("parallel sampling", SamplingParams(n=width, temperature=1.0, seed=0, max_tokens=args.output_len,
                                                     ignore_eos=True)),
            ):
                saving, peak_shared, peak_owned = measure(llm, prompt, params)
                print(f"| {prompt_len} | {kind} | {width} | {saving:.1%} | {peak_shared} / {peak_owned} |", flush=True)


if __name__ == "__main__":
    main()
