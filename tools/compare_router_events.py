"""`octavo router --policy kv-events` against the text-chunk tree (cache-aware), side by side.

    .venv/bin/python tools/compare_router_events.py --requests 160

For each policy, two fresh `octavo serve` replicas (one thread each, a small KV cache, sha256_cbor
hashes, KV events) behind a fresh router; two loads, in this order:
  * rendered: 8 system prompts (~300 tokens each), every request one of them plus its own
    question, half sent as chat messages, half as completions of the same conversation rendered by
    the client through the model's chat template (same tokens, other text);
  * plain: the same system prompts and questions, all as completions of plain text (no template).
Each load is sent at concurrency 8. Prints, per load and policy, the replicas' prefix-cache hit
rate (hit tokens / prompt tokens looked up, from their /metrics) and the requests per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], log: Path, url: str, timeout_s: float = 300) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[3]} exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy in {timeout_s} s (log {log})")


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process, then wait for each (30 s, then SIGKILL)."""
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def hit_tokens(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^octavo:{name}_total\{{[^}}]*\}} (\S+)", text, re.M))
    return total("prefix_cache_hits"), total("prefix_cache_queries")


def loads(n: int, tokenizer) -> dict[str, list[tuple[str, dict]]]:
    rng = random.Random(0)
    topics = ["tides", "lenses", "fog signals", "keepers", "storms", "charts", "ships", "bells"]
    systems = [f"You are the guide of museum number {i}, which is about {topics[i]}. " +
               f"Answer visitors about {topics[i]} kindly, in two sentences, citing the museum's own collection. " * 10
               for i in range(8)]
    rendered, plain = [], []
    for i in range(n):
        system = rng.choice(systems)
        question = f"Visitor {i} asks: what should I see first about {rng.choice(topics)}?"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        if i % 2 == 0:
            rendered.append(("/v1/chat/completions", {"messages": messages}))
        else:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            rendered.append(("/v1/completions", {"prompt": text, "add_special_tokens": False}))
        plain.append(("/v1/completions", {"prompt": system + "\n" + question}))
    return {"rendered": rendered, "plain": plain}


async def send(url: str, requests: list[tuple[str, dict]], concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(path: str, body: dict) -> None:
            async with sem:
                r = await client.post(url + path, json={"model": "m", "max_tokens": 8, "temperature": 0, **body})
                r.raise_for_status()
        start = time.perf_counter()
        await asyncio.gather(*(one(p, b) for p, b in requests))
        return time.perf_counter() - start


def run_policy(policy: str, work: dict, tmp: Path, kv_cache: str) -> dict[str, tuple[float, float]]:
    procs, urls, endpoints = [], [], []
    py = [sys.executable, "-m", "octavo.cli"]
    try:
        for i in range(2):
            port = free_port()
            pub, replay = f"ipc://{tmp}/{policy}-{i}", f"ipc://{tmp}/{policy}-{i}-replay"
            conf = {"enable_kv_cache_events": True, "endpoint": pub, "replay_endpoint": replay}
            url = f"http://127.0.0.1:{port}"
            procs.append(start(py + ["serve", "--port", str(port), "--served-model-name", "m", "--kv-cache-memory", kv_cache,
                                     "--max-model-len", "1024", "--prefix-caching-hash-algo", "sha256_cbor",
                                     "--kv-events-config", json.dumps(conf), "--log-interval", "60"],
                               tmp / f"{policy}-replica{i}.log", url))
            urls.append(url)
            endpoints += ["--kv-events-endpoint", f"{pub},{replay}"]
        port = free_port()
        router = f"http://127.0.0.1:{port}"
        procs.append(start(py + ["router", "--policy", policy, "--port", str(port),
                                 *[a for u in urls for a in ("--worker", u)],
                                 *(endpoints if policy == "kv-events" else [])], tmp / f"{policy}-router.log", router))
        out = {}
        for name, requests in work.items():
            before = [hit_tokens(u) for u in urls]
            seconds = asyncio.run(send(router, requests, 8))
            after = [hit_tokens(u) for u in urls]
            hits = sum(a[0] - b[0] for a, b in zip(after, before))
            queries = sum(a[1] - b[1] for a, b in zip(after, before))
            out[name] = (hits / max(queries, 1.0), len(requests) / seconds)
            sent = re.findall(r'octavo_router_requests_total\{worker="[^"]+"\} (\S+)', httpx.get(f"{router}/metrics").text)
            print(f"{policy} {name}: requests per replica so far {sent}", flush=True)
        return out
    finally:
        stop_all(procs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=160, help="requests per load")
    parser.add_argument("--kv-cache", default="48MiB", help="each replica's KV cache (SmolLM2 keeps 45 KiB a token: "
                        "48MiB holds ~1,090 tokens: four of the ~200-token system prompts beside the running requests)")
    args = parser.parse_args()
    from octavo.models.loader import resolve_model
    from octavo.tokenizer import load_tokenizer

    work = loads(args.requests, load_tokenizer(resolve_model(None)))
    tmp = Path(tempfile.mkdtemp(prefix="router-events-"))
    results = {policy: run_policy(policy, work, tmp, args.kv_cache) for policy in ("cache-aware", "kv-events")}
    print(f"| load ({args.requests} requests, concurrency 8) | cache-aware hit rate | kv-events hit rate | ratio | "
          "cache-aware req/s | kv-events req/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in work:
        (ha, ta), (hk, tk) = results["cache-aware"][name], results["kv-events"][name]
        print(f"| {name} | {ha:.1%} | {hk:.1%} | {hk / max(ha, 1e-9):.2f}x | {ta:.2f} | {tk:.2f} |")
    print(f"logs: {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
