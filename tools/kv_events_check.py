"""KV events on a long mixed run: whether an independent subscriber ends holding the engine's
cache exactly, and what publishing costs.

    .venv/bin/python tools/kv_events_check.py --requests 1000 --repeats 3

One engine (the embedded model, a 48-block pool, a disk tier, sha256_cbor hashes): `--requests`
chat-like prompts (a few shared system prompts, each with its own question) go through in waves
of 64, so blocks are evicted to the tier, loaded back and requests preempted. A subscriber
(tests/kv_events_subscriber.py: msgspec structs from docs/API.md, hashes recomputed with cbor2)
is stopped a third of the way in and started again from the replay socket. At the end it must
hold exactly the pool's hash map and the tier's ready entries, with no sequence gap.

Cost: the same waves run with events off and on, alternately, `--repeats` times each on one
engine of each kind built side by side; the wall-time medians are compared, and the time the
engine thread spent draining and encoding (KVEventStream.seconds) is given as a share of its
run. Prints one table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def workload(n: int, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    systems = [f"You are assistant number {i}. " + "Answer carefully, briefly and politely. " * (4 + i) for i in range(6)]
    topics = ["rivers", "bridges", "printing", "bees", "glass", "maps", "clocks", "salt", "paper", "wind"]
    return [rng.choice(systems) + f"Question {i}: tell me one fact about {rng.choice(topics)} and {rng.choice(topics)}."
            for i in range(n)]


def build(tmp: Path, events: bool, tag: str):
    from octavo.llm import LLM

    conf = None
    if events:
        conf = json.dumps({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp}/{tag}-pub",
                           "replay_endpoint": f"ipc://{tmp}/{tag}-replay", "hash_format": "bytes"})
    return LLM(num_kv_blocks=48, max_num_batched_tokens=256, kv_offload_size=256 << 20,
               kv_offload_path=str(tmp / f"tier-{tag}"), prefix_caching_hash_algo="sha256_cbor", kv_events_config=conf)


def run(llm, prompts: list[str], wave: int = 64) -> float:
    from octavo.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    start = time.perf_counter()
    for i in range(0, len(prompts), wave):
        llm.generate(prompts[i:i + wave], params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3, help="cost runs per setting (alternating)")
    args = parser.parse_args()
    from tests.kv_events_subscriber import Subscriber

    tmp = Path(tempfile.mkdtemp(prefix="kv-events-check-"))
    prompts = workload(args.requests)
    llm = build(tmp, True, "on")
    sub = Subscriber(f"ipc://{tmp}/on-pub", f"ipc://{tmp}/on-replay")
    sub.start(catch_up=True)
    third = len(prompts) // 3
    run(llm, prompts[:third])
    sub.stop()
    run(llm, prompts[third:2 * third])  # published while the subscriber is down: back through the replay
    sub.start(catch_up=True)
    run(llm, prompts[2 * third:])
    engine = llm.engine
    stream, kv = engine.kv_events, engine.scheduler.kv_cache
    sub.wait_for(lambda s: s.last_seq == stream.publisher.num_sent - 1, timeout_s=120, what="the last batch")
    want = {("GPU", g, h) for g, h in kv.pool.cached} | {("DISK", g, h) for g, h in kv.tier.ready_keys()}
    stats = engine.get_stats().scheduler
    sub.stop()
    print(f"requests {len(prompts)}, batches {stream.publisher.num_sent}, events {stream.num_events}, "
          f"preemptions {stats.preemption.num_preemptions}, tier stored {stats.tier.num_stored} / loaded {stats.tier.num_loaded}")
    print(f"subscriber: {len(sub.index)} entries, engine {len(want)}; missing {len(want - sub.index)}, "
          f"extra {len(sub.index - want)}, gaps {sub.num_gaps}, hashes recomputed {sub.num_checked} "
          f"(wrong {len(sub.bad_hashes)})")
    llm.close()

    cost_prompts = prompts[: max(64, len(prompts) // 4)]
    engines = {"off": build(tmp, False, "off"), "on": build(tmp, True, "cost")}
    times: dict[str, list[float]] = {"off": [], "on": []}
    share = []
    for _ in range(args.repeats):
        for name, eng in engines.items():
            before = eng.engine.kv_events.seconds if eng.engine.kv_events else 0.0
            wall = run(eng, cost_prompts)
            times[name].append(wall)
            if eng.engine.kv_events:
                share.append((eng.engine.kv_events.seconds - before) / wall)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"| {len(cost_prompts)} requests, {args.repeats} runs each | events off | events on | on / off | "
          f"drain + encode share of the run (median) |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| wall, median | {off:.2f} s | {on:.2f} s | {on / off:.3f} | {100 * statistics.median(share):.2f}% |")
    for eng in engines.values():
        eng.close()
    return 0 if want == sub.index and sub.num_gaps == 0 and not sub.bad_hashes else 1


if __name__ == "__main__":
    sys.exit(main())
