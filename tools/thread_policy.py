"""How the engine's OpenMP threads behave on a shared machine: the same decode workload on the
embedded model under each thread setting, with the cores idle and with other processes keeping
every core busy, side by side in one run (settings interleaved, medians of the rounds).

libgomp threads spin-wait between parallel regions (OMP_WAIT_POLICY unset: active for a while);
on a machine whose cores other processes also want, the spinning thread competes with them and
with the thread that has real work, and each step waits for the slowest of its threads.

Run: PYTHONPATH=. .venv/bin/python tools/thread_policy.py [--rounds 3] [--requests 4] [--tokens 32]
A child process is started per (setting, load, round): libgomp reads its settings once, at load.
The fixed settings turn off the engine's load-following thread count (OCTAVO_ADAPTIVE_THREADS=0).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

FIXED = {"OCTAVO_ADAPTIVE_THREADS": "0"}  # the engine keeps the count it starts with
SETTINGS = {
    "2 threads, active wait (libgomp default)": {"OMP_NUM_THREADS": "2", **FIXED},
    "2 threads, passive wait": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "passive", **FIXED},
    "2 threads, spin 10k then sleep": {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "10000", **FIXED},
    "2 threads, spin 100k then sleep": {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "100000", **FIXED},
    "1 thread": {"OMP_NUM_THREADS": "1", **FIXED},
    "2 threads following the load (octavo's default)": {"OMP_NUM_THREADS": "2"},
}
CHILD = r"""
import json, sys, time
from octavo.llm import LLM
from octavo.sampling.params import SamplingParams
requests, tokens = int(sys.argv[1]), int(sys.argv[2])
llm = LLM(kv_cache_memory=64 << 20, max_model_len=512)
prompts = [f"Write a short story about the number {i}." for i in range(requests)]
params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm up
start = time.perf_counter()
llm.generate(prompts[:1], params, use_tqdm=False)
single = time.perf_counter() - start
start = time.perf_counter()
llm.generate(prompts, params, use_tqdm=False)
batch = time.perf_counter() - start
print(json.dumps({"single_s": single, "batch_s": batch}))
"""


def _spin() -> None:
    while True:
        pass


def run_child(env_extra: dict[str, str], requests: int, tokens: int) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "OCTAVO_ADAPTIVE"))} | env_extra
    done = subprocess.run([sys.executable, "-c", CHILD, str(requests), str(tokens)], env=env, capture_output=True,
                          text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--settings", default=None, help="names of SETTINGS to run, separated by | (default: all)")
    args = ap.parse_args()
    num_cores = os.cpu_count() or 2
    settings = {n: SETTINGS[n] for n in args.settings.split("|")} if args.settings else SETTINGS
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for r in range(args.rounds):
        for load in ("idle", "loaded"):
            spinners = []
            if load == "loaded":  # one busy process per core, as other tenants would be
                spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(num_cores)]
                for p in spinners:
                    p.start()
                time.sleep(0.5)
            try:
                for name, env in settings.items():
                    out = run_child(env, args.requests, args.tokens)
                    results.setdefault((name, load), []).append(out)
                    print(f"round {r} {load:6s} {name}: single {out['single_s']:.2f} s, batch {out['batch_s']:.2f} s",
                          flush=True)
            finally:
                for p in spinners:
                    p.kill()
    print(f"\n{args.tokens} tokens greedy; single = 1 request, batch = {args.requests} requests; medians of "
          f"{args.rounds} rounds; loaded = {num_cores} busy-looping processes beside it\n")
    print("| setting | idle: 1 request (s) | idle: batch (s) | loaded: 1 request (s) | loaded: batch (s) | loaded/idle, 1 request |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in settings:
        idle, loaded = results[(name, "idle")], results[(name, "loaded")]
        med = {f"{load}_{k}": statistics.median(o[k] for o in rows) for load, rows in (("idle", idle), ("loaded", loaded))
               for k in ("single_s", "batch_s")}
        print(f"| {name} | {med['idle_single_s']:.2f} | {med['idle_batch_s']:.2f} | {med['loaded_single_s']:.2f} | "
              f"{med['loaded_batch_s']:.2f} | {med['loaded_single_s'] / med['idle_single_s']:.1f}x |")


if __name__ == "__main__":
    main()
