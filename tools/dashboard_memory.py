"""Does a dashboard left open grow the server's memory? One `octavo serve`, a client reading
/dashboard/events the whole time, and requests sent one after another for --minutes; the
server's resident memory sampled every --every seconds (docs/BENCHMARKS.md).

    .venv/bin/python tools/dashboard_memory.py --minutes 5
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time

import httpx


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--every", type=float, default=30.0)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "octavo.cli", "serve", "--port", str(port), "--kv-cache-memory",
                               "256MiB", "--max-model-len", "1024"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": "2"})
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        stop = threading.Event()
        events = [0]

        def watch() -> None:  # the open page
            with httpx.stream("GET", f"{url}/dashboard/events", timeout=None) as resp:
                for line in resp.iter_lines():
                    events[0] += line.startswith("data: ")
                    if stop.is_set():
                        return

        def load() -> None:  # requests one after another, each a new prompt
            i = 0
            while not stop.is_set():
                httpx.post(f"{url}/v1/completions", json={"prompt": f"Request {i}: tell me about paging.", "max_tokens": 48,
                                                          "temperature": 0}, timeout=120)
                i += 1

        threads = [threading.Thread(target=f, daemon=True) for f in (watch, load)]
        for t in threads:
            t.start()
        start = time.monotonic()
        print("| minutes | server RSS (MiB) | snapshots streamed |\n| --- | --- | --- |")
        while time.monotonic() - start < args.minutes * 60:
            print(f"| {(time.monotonic() - start) / 60:.1f} | {rss_mib(server.pid):.0f} | {events[0]} |", flush=True)
            time.sleep(args.every)
        print(f"| {(time.monotonic() - start) / 60:.1f} | {rss_mib(server.pid):.0f} | {events[0]} |", flush=True)
        stop.set()
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
