"""New JSON schemas from many clients at once, and one client whose schema is already compiled.

    python tools/grammar_compile_load.py [--base-url URL] [--clients 8] [--seconds 20]

Starts `octavo serve` (the embedded model) unless --base-url is given. First the idle baseline: the
cached-schema client alone (its schema compiled once, then N requests, median latency). Then
`--clients` clients each send requests with a schema never seen before (one compile each),
back to back, for `--seconds`, while the cached-schema client goes on. Prints new schemas
compiled per second and the cached client's median latency under that load against idle.
Every request: a short prompt, max_tokens 4 (--max-tokens), greedy. `--control` runs the same
clients with the cached schema (no compiles), at `--rate` to match a new-schema run's load.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.live_server import API_KEY, start_server, stop_server  # noqa: E402

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def schema(client: int, n: int) -> dict:
    """A small schema no other request uses (its property names carry client and sequence)."""
    return {"type": "object", "properties": {f"c{client}_n{n}": {"type": "string", "maxLength": 8},
                                             "count": {"type": "integer"}},
            "required": [f"c{client}_n{n}"], "additionalProperties": False}


CACHED = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}


MAX_TOKENS = {"value": 4}  # every request's (--max-tokens)


async def request(client: httpx.AsyncClient, url: str, body_schema: dict) -> tuple[float, int]:
    body = {"prompt": "Reply in JSON:", "max_tokens": MAX_TOKENS["value"], "temperature": 0, "guided_json": body_schema}
    start = time.perf_counter()
    r = await client.post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=300)
    return time.perf_counter() - start, r.status_code


async def cached_client(url: str, stop: asyncio.Event, latencies: list[float], limit: int | None = None) -> None:
    async with httpx.AsyncClient() as client:
        while not stop.is_set() and (limit is None or len(latencies) < limit):
            seconds, status = await request(client, url, CACHED)
            assert status == 200, status
            latencies.append(seconds)


async def fresh_client(url: str, index: int, stop: asyncio.Event, done: list[int], statuses: dict,
                       control: bool = False, interval_s: float = 0.0) -> None:
    async with httpx.AsyncClient() as client:
        n = 0
        while not stop.is_set():
            began = time.perf_counter()
            _, status = await request(client, url, CACHED if control else schema(index, n))
            await asyncio.sleep(max(0.0, interval_s - (time.perf_counter() - began)))
            statuses[status] = statuses.get(status, 0) + 1
            if status == 200:
                done.append(1)
            n += 1


async def run(url: str, num_clients: int, seconds: float, idle_requests: int, control: bool = False,
              rate: float | None = None) -> dict:
    async with httpx.AsyncClient() as client:  # the cached schema compiled once, and a warm-up
        for _ in range(3):
            await request(client, url, CACHED)
    idle: list[float] = []
    await cached_client(url, asyncio.Event(), idle, limit=idle_requests)
    stop, done, statuses, loaded = asyncio.Event(), [], {}, []
    interval = num_clients / rate if rate else 0.0  # each client's pace, for `rate` requests a second in all
    tasks = [asyncio.create_task(fresh_client(url, i, stop, done, statuses, control, interval)) for i in range(num_clients)]
    tasks.append(asyncio.create_task(cached_client(url, stop, loaded)))
    start = time.perf_counter()
    await asyncio.sleep(seconds)
    async with httpx.AsyncClient() as client:  # the engine's last steps: how long and how full
        steps = (await client.get(f"{url}/dashboard/snapshot", headers=HEADERS, timeout=60)).json()["steps"]
    stop.set()
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    return {"compiles_per_s": len(done) / elapsed, "statuses": statuses, "idle_median_s": statistics.median(idle),
            "step_median_s": statistics.median(s[2] for s in steps),
            "steps_per_s": len(steps) / (steps[-1][1] - steps[0][1]) if len(steps) > 1 else 0.0,
            "requests_per_step": statistics.mean(s[5] for s in steps),
            "loaded_median_s": statistics.median(loaded), "loaded_requests": len(loaded), "seconds": elapsed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default=None)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--idle-requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=4, help="every request's max_tokens (default 4)")
    parser.add_argument("--control", action="store_true",
                        help="the other clients send the cached schema too: the same requests without compiles")
    parser.add_argument("--rate", type=float, default=None,
                        help="the other clients' requests a second in all (default: back to back); with --control, "
                             "the rate the new-schema run reached gives the same load without its compiles")
    args = parser.parse_args()
    MAX_TOKENS["value"] = args.max_tokens
    server = None
    if args.base_url is None:
        log = Path(tempfile.mkdtemp(prefix="octavo-grammar-load-")) / "server.log"
        server = start_server(log, ["--api-key", API_KEY, "--kv-cache-memory", str(256 << 20), "--max-model-len", "1024"])
        url = server.url
        print(f"server log: {log}", flush=True)
    else:
        url = args.base_url
    try:
        result = asyncio.run(run(url, args.clients, args.seconds, args.idle_requests, args.control, args.rate))
    finally:
        if server is not None:
            stop_server(server)
    ratio = result["loaded_median_s"] / result["idle_median_s"]
    print(f"{args.clients} clients sending {'the cached schema (control)' if args.control else 'new schemas'} for {result['seconds']:.1f} s: {result['compiles_per_s']:.1f} "
          f"requests a second (responses {result['statuses']})")
    print(f"cached-schema client: median {result['idle_median_s'] * 1e3:.0f} ms idle, "
          f"{result['loaded_median_s'] * 1e3:.0f} ms under the load ({ratio:.2f}x, {result['loaded_requests']} requests)")
    print(f"engine, last {240} steps of the load: {result['steps_per_s']:.0f} steps a second, median step "
          f"{result['step_median_s'] * 1e3:.1f} ms, {result['requests_per_step']:.1f} requests a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
