"""Floods a live `octavo serve` as issue 60's hostile clients did, and measures what a keyed user
sees meanwhile: /health's latency, a keyed 4-token chat's latency against its idle median, and the
server's RSS before and after each flood.

    .venv/bin/python tools/hostile_floods.py [--seconds 20]

Floods: 8 clients sending chat templates that loop 10^10 times or write 30 MB (with
--trust-request-chat-template), and 16 keyless clients posting 195 KB prompts to /tokenize. The
server is started here (the embedded model, --api-key) and stopped at the end."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

KEY = "flood-key"
HI = [{"role": "user", "content": "Hi"}]
LOOP = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
BOMB = "{{ 'x' * 30000000 }}"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    """The process's CPU seconds so far (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(fn) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def keyed_chat(url: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=300,
                   json={"model": "SmolLM2-135M-Instruct", "messages": HI, "max_tokens": 4, "temperature": 0})
    r.raise_for_status()


def flood(url: str, stop: threading.Event, kind: str, index: int, counts: dict) -> None:
    with httpx.Client(timeout=300) as client:
        while not stop.is_set():
            if kind == "templates":
                body = {"model": "SmolLM2-135M-Instruct", "messages": HI, "max_tokens": 4,
                        "chat_template": LOOP if index % 2 else BOMB}
                r = client.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
            else:
                r = client.post(f"{url}/tokenize", json={"prompt": "word " * 39_000})  # ~195 KB, no key
            counts[r.status_code] = counts.get(r.status_code, 0) + 1


def flood_process(url: str, kind: str, clients: int, seconds: float, results: Any) -> None:
    """In a process of its own (its GIL is not the measuring client's): `clients` threads flooding
    for `seconds`, then the count of each answer's status into `results`."""
    stop, counts = threading.Event(), {}
    threads = [threading.Thread(target=flood, args=(url, stop, kind, i, counts), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(60)
    results.put(counts)


def measure(url: str, pid: int, kind: str, clients: int, seconds: float, idle_chat: float) -> dict:
    before = rss_mib(pid)
    results: Any = multiprocessing.Queue()
    flooder = multiprocessing.Process(target=flood_process, args=(url, kind, clients, seconds + 2.0, results))
    flooder.start()
    time.sleep(1.0)
    health, chats = [], []
    start_cpu, start = cpu_s(pid), time.monotonic()
    deadline = start + seconds
    while time.monotonic() < deadline:
        health.append(timed(lambda: httpx.get(f"{url}/health", timeout=60).raise_for_status()))
        chats.append(timed(lambda: keyed_chat(url)))
    server_cores = (cpu_s(pid) - start_cpu) / (time.monotonic() - start)
    counts = results.get(timeout=120)
    flooder.join(60)
    time.sleep(2.0)
    return {"flood": kind, "clients": clients, "answers": dict(sorted(counts.items())),
            "health max s": max(health), "chat median s": statistics.median(chats),
            "chat / idle": statistics.median(chats) / idle_chat, "server cores": server_cores, "RSS before MiB": before, "RSS after MiB": rss_mib(pid)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open("/tmp/hostile-floods-server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "octavo.cli", "serve", "--port", str(port), "--api-key", KEY,
                             "--trust-request-chat-template"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "2"})
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        for _ in range(3):
            keyed_chat(url)  # warm
        idle = statistics.median(timed(lambda: keyed_chat(url)) for _ in range(7))
        print(f"idle: keyed 4-token chat median {idle:.3f} s; server RSS {rss_mib(proc.pid):.0f} MiB")
        for kind, clients in (("templates", 8), ("tokenize", 16)):
            row = measure(url, proc.pid, kind, clients, args.seconds, idle)
            print("  ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in row.items()))
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
