"""What the second KV tier costs requests that miss everywhere, offline: one engine, 24 random
512-token prompts (16 tokens out, 4 at once) in a 128-block pool, with or without a 2 GiB tier on
disk. Prints the wall time and, with the tier, its writer thread's CPU time. Run it alternating
(tier, off, tier, off, ...) and compare medians: one run's spread on this machine is several percent.

    OMP_NUM_THREADS=2 .venv/bin/python tools/tier_miss_offline.py tier|off
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import threading
import time

from octavo import LLM, SamplingParams


def thread_cpu_seconds(name: str) -> float:
    """User + system CPU seconds of this process's thread called `name` (0 if none; Linux)."""
    for th in threading.enumerate():
        if th.name == name and th.native_id:
            with open(f"/proc/self/task/{th.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "tier"
    if mode not in ("tier", "off"):
        raise SystemExit("usage: tier_miss_offline.py tier|off")
    options = dict(num_kv_blocks=128, max_num_seqs=4)
    with tempfile.TemporaryDirectory() as folder:
        if mode == "tier":
            options.update(kv_offload_size=2 << 30, kv_offload_path=folder)
        rng = random.Random(0)
        prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(512)]} for _ in range(24)]
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        with LLM(**options) as llm:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            stats = llm.engine.get_stats().scheduler
            writer = thread_cpu_seconds("octavo-kv-tier")
    print(f"{mode}: wall {wall:.2f} s, tier blocks stored {stats.tier.num_stored}, writer thread CPU {writer:.2f} s")


if __name__ == "__main__":
    main()
