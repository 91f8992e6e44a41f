"""Does a dashboard left open grow the server's memory? Two measurements (docs/BENCHMARKS.md):

server: one `octavo serve`, --watchers clients reading /dashboard/events the whole time, requests
sent one after another for --minutes; the server's resident memory sampled every --every seconds.
A smaller --interval (the server's --dashboard-interval) packs more of a day's snapshots into the
run: a page open for a day at the default 0.25 s reads 345,600.

    .venv/bin/python tools/dashboard_memory.py server --minutes 30 --interval 0.01 --watchers 4

day: a day's worth of snapshots (--snapshots, 345,600 = 4 a second for 24 hours) built and
serialised as the server does, in process, against an engine serving a stream of requests
(--per-step snapshots between steps); resident memory and live Python objects sampled as it goes.
--per-step 0 runs the same steps without a snapshot: what the engine itself does to memory.

    .venv/bin/python tools/dashboard_memory.py day --snapshots 345600 --per-step 32
    .venv/bin/python tools/dashboard_memory.py day --per-step 0 --steps 10800
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx

DAY_AT_4_PER_S = 4 * 24 * 3600


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def start_server(flags: list[str], num_threads: int = 2) -> tuple[subprocess.Popen, str]:
    """`octavo serve` on a free port with `flags`, once it answers /health: (process, base URL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "octavo.cli", "serve", "--port", str(port), *flags],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": str(num_threads)})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            time.sleep(0.5)
    server.terminate()
    raise SystemExit("the server did not answer /health within 300 s")


def run_server(args: argparse.Namespace) -> None:
    server, url = start_server(["--kv-cache-memory", "256MiB", "--max-model-len", "1024",
                                "--dashboard-interval", str(args.interval)])
    stop = threading.Event()
    events, distinct = [0], [0]  # events streamed to all watchers; distinct snapshots (changes) seen by the first

    def watch(first: bool) -> None:  # an open page
        last = ""
        with httpx.stream("GET", f"{url}/dashboard/events", timeout=None) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events[0] += 1
                    if first and line != last:
                        distinct[0] += 1
                        last = line
                if stop.is_set():
                    return

    def load() -> None:  # requests one after another, each a new prompt
        i = 0
        while not stop.is_set():
            httpx.post(f"{url}/v1/completions", json={"prompt": f"Request {i}: tell me about paging.", "max_tokens": 48,
                                                      "temperature": 0}, timeout=120)
            i += 1

    try:
        threads = [threading.Thread(target=watch, args=(i == 0,), daemon=True) for i in range(args.watchers)]
        threads.append(threading.Thread(target=load, daemon=True))
        for t in threads:
            t.start()
        start = time.monotonic()
        print(f"interval {args.interval} s, {args.watchers} pages open")
        print("| minutes | server RSS (MiB) | events streamed | snapshots (distinct) |\n| --- | --- | --- | --- |")
        while True:
            elapsed = time.monotonic() - start
            print(f"| {elapsed / 60:.1f} | {rss_mib(server.pid):.0f} | {events[0]} | {distinct[0]} |", flush=True)
            if elapsed >= args.minutes * 60:
                break
            time.sleep(min(args.every, args.minutes * 60 - elapsed + 0.01))
        print(f"= {events[0] / DAY_AT_4_PER_S:.2f} days of one page at 4 a second")
        stop.set()
    finally:
        server.terminate()
        server.wait(60)


def run_day(args: argparse.Namespace) -> None:
    from octavo.dashboard.snapshot import build_snapshot
    from octavo.engine import LLMEngine
    from octavo.engine_args import EngineArgs
    from octavo.metrics import EngineMetrics
    from octavo.sampling.params import SamplingParams

    engine = LLMEngine.from_args(EngineArgs(kv_cache_memory=256 << 20, max_model_len=1024))
    metrics = EngineMetrics("octavo-day")
    tokenizer = engine.tokenizer
    # --per-step 0 is the control: the same steps and requests, no snapshot
    num_steps_total = -(-args.snapshots // args.per_step) if args.per_step else args.steps
    num_built = num_steps = num_added = num_finished = 0
    checkpoints = {int(num_steps_total * i / 12) for i in range(1, 13)} | {1}
    start = time.monotonic()
    print(f"{engine.scheduler.kv_cache.num_blocks}-block pool; {args.per_step} snapshots between steps")
    print("| snapshots | steps | requests finished | RSS (MiB) | live Python objects | minutes |\n| --- | --- | --- | --- | --- | --- |")
    while num_steps < num_steps_total:
        while engine.scheduler.num_waiting + len(engine.scheduler.running) < args.concurrency:
            prompt = tokenizer.encode(f"Request {num_added}: tell me about paging, {'and blocks ' * (num_added % 40)}.")
            engine.add_request(f"r{num_added}", prompt, SamplingParams(temperature=0.0, max_tokens=16 + num_added % 48))
            num_added += 1
        num_finished += sum(1 for out in engine.step() if out.finished)
        num_steps += 1
        for _ in range(args.per_step):
            snap = {**build_snapshot(engine.scheduler, engine.step_log), "latency": metrics.recent_latencies()}
            json.dumps(snap, separators=(",", ":"))
            num_built += 1
        if num_steps in checkpoints:
            gc.collect()
            print(f"| {num_built} | {num_steps} | {num_finished} | {rss_mib(os.getpid()):.0f} | {len(gc.get_objects())} "
                  f"| {(time.monotonic() - start) / 60:.1f} |", flush=True)
    engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    srv = sub.add_parser("server", help="a live server, pages open, requests flowing")
    srv.add_argument("--minutes", type=float, default=5.0)
    srv.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    srv.add_argument("--interval", type=float, default=0.25, help="the server's --dashboard-interval")
    srv.add_argument("--watchers", type=int, default=1, help="pages open")
    day = sub.add_parser("day", help="a day's snapshots built in process against a serving engine")
    day.add_argument("--snapshots", type=int, default=DAY_AT_4_PER_S)
    day.add_argument("--per-step", type=int, default=32, help="snapshots between steps (0: the control, none)")
    day.add_argument("--steps", type=int, default=10_800, help="steps of the control (--per-step 0)")
    day.add_argument("--concurrency", type=int, default=8, help="requests kept running")
    args = ap.parse_args()
    (run_server if args.mode == "server" else run_day)(args)


if __name__ == "__main__":
    main()
